import numpy as np
import pytest

from rollout_gateway.core.stamping import Span, normalize_spans, stamp_request, stitch_routing
from rollout_gateway.core.trajectory import Transition
from rollout_gateway.errors import EngineError


def test_no_spans_uses_the_version_the_engine_ran():
    spans = normalize_spans([], 4, 7)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START, installed_by={})
    assert st.policy_version.tolist() == [7, 7, 7, 7]
    assert st.kv_version.tolist() == [7, 7, 7, 7]
    assert [(s.start, s.end, s.began, s.policy_version) for s in st.segments] == [
        (0, 4, Transition.START, 7)]


def test_no_spans_and_no_version_is_an_engine_error():
    with pytest.raises(EngineError):
        normalize_spans([], 3, None)


def test_in_place_keeps_the_oldest_kv_version():
    spans = normalize_spans([Span(1, 0, 3), Span(2, 3, 5), Span(3, 5, 6)], 6, None)
    st = stamp_request(spans, offset=10, engine_id="e0", began=Transition.START,
                       installed_by={2: Transition.IN_PLACE, 3: Transition.IN_PLACE})
    assert st.policy_version.tolist() == [1, 1, 1, 2, 2, 3]
    assert st.kv_version.tolist() == [1, 1, 1, 1, 1, 1]
    assert [(s.start, s.end) for s in st.segments] == [(10, 13), (13, 15), (15, 16)]
    assert st.segments[0].ended == Transition.IN_PLACE
    assert st.segments[1].began == Transition.IN_PLACE


def test_retract_rebuilds_kv_under_the_new_version():
    spans = normalize_spans([Span(1, 0, 2), Span(2, 2, 4), Span(3, 4, 5)], 5, None)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                       installed_by={2: Transition.RETRACT, 3: Transition.IN_PLACE})
    assert st.policy_version.tolist() == [1, 1, 2, 2, 3]
    # retract to 2 rebuilt the KV at 2; the in-place swap to 3 keeps it at 2
    assert st.kv_version.tolist() == [1, 1, 2, 2, 2]
    assert st.segments[1].began == Transition.RETRACT


def test_resubmitted_request_starts_fresh_kv():
    spans = normalize_spans([Span(4, 0, 3)], 3, None)
    st = stamp_request(spans, offset=5, engine_id="e1", began=Transition.FAILOVER, installed_by={})
    assert st.kv_version.tolist() == [4, 4, 4]
    assert st.segments[0].began == Transition.FAILOVER and st.segments[0].start == 5


def test_spans_with_gaps_or_wrong_total_are_rejected():
    with pytest.raises(EngineError):
        normalize_spans([Span(1, 0, 2), Span(2, 3, 4)], 4, None)
    with pytest.raises(EngineError):
        normalize_spans([Span(1, 0, 2)], 3, None)


def test_versions_going_backwards_inside_a_request_are_rejected():
    spans = normalize_spans([Span(2, 0, 2), Span(1, 2, 3)], 3, None)
    with pytest.raises(EngineError):
        stamp_request(spans, offset=0, engine_id="e0", began=Transition.START, installed_by={})


def test_equal_neighbour_spans_merge():
    spans = normalize_spans([Span(1, 0, 2), Span(1, 2, 3)], 3, None)
    assert spans == [Span(1, 0, 3)]


def test_stitch_routing_keeps_each_requests_own_rows_and_fills_gaps():
    # request 1: prompt 3, 2 outputs -> rows 0..3 (4 rows); request 2: input 5, 2 outputs -> 6 rows
    r1 = np.full((4, 2, 1), 1)
    r2 = np.full((6, 2, 1), 2)
    out = stitch_routing([(3, r1), (5, r2)])
    assert out.shape == (6, 2, 1)
    assert out[:4].max() == 1 and out[4:].min() == 2
    # a request that died without routing: the next one's recomputed rows fill in
    out = stitch_routing([(3, None), (5, r2)])
    assert out.shape == (6, 2, 1) and (out == 2).all()
    assert stitch_routing([(3, None)]) is None


def test_prefix_cache_hit_after_an_in_place_swap_keeps_the_old_kv_version():
    spans = normalize_spans([Span(3, 0, 2)], 2, None)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START, installed_by={},
                       cached_floor=1)
    assert st.policy_version.tolist() == [3, 3] and st.kv_version.tolist() == [1, 1]


def test_overlap_scheduler_moves_in_place_boundaries_one_token_later():
    """SGLang's overlap scheduler labels the token of the batch in flight at the pause with
    the new version although the old weights computed it (docs/gateway.md: SGLang
    behaviours the gateway corrects)."""
    spans = normalize_spans([Span(1, 0, 3), Span(2, 3, 5), Span(3, 5, 7)], 7, None)
    st = stamp_request(spans, offset=10, engine_id="e0", began=Transition.START,
                       installed_by={2: Transition.IN_PLACE, 3: Transition.IN_PLACE},
                       label_lag=1)
    assert st.policy_version.tolist() == [1, 1, 1, 1, 2, 2, 3]
    assert st.kv_version.tolist() == [1] * 7
    assert [(s.start, s.end, s.policy_version) for s in st.segments] == [
        (10, 14, 1), (14, 16, 2), (16, 17, 3)]


def test_overlap_lag_leaves_retract_boundaries_and_caps_at_the_end():
    spans = normalize_spans([Span(1, 0, 2), Span(2, 2, 4), Span(3, 4, 5)], 5, None)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                       installed_by={2: Transition.RETRACT, 3: Transition.IN_PLACE}, label_lag=1)
    # retract processed the batch in flight before the pause: exact; the in-place boundary
    # at 4 moves to 5, the end: the request finished in the batch in flight, all under 2
    assert st.policy_version.tolist() == [1, 1, 2, 2, 2]
    assert [s.policy_version for s in st.segments] == [1, 2]


def test_overlap_lag_drops_a_one_token_span_between_two_in_place_swaps():
    spans = normalize_spans([Span(1, 0, 2), Span(2, 2, 3), Span(3, 3, 4)], 4, None)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                       installed_by={2: Transition.IN_PLACE, 3: Transition.IN_PLACE}, label_lag=1)
    assert st.policy_version.tolist() == [1, 1, 1, 2]
    no_lag = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                           installed_by={2: Transition.IN_PLACE, 3: Transition.IN_PLACE})
    assert no_lag.policy_version.tolist() == [1, 1, 2, 3]
