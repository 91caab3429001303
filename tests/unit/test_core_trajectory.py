import numpy as np
import pytest

from rollout_gateway.core.staleness import lag, trajectory_staleness
from rollout_gateway.core.trajectory import (
    FinishReason, RoutedExperts, Segment, TokenColumns, Trajectory, narrowest_uint,
)
from rollout_gateway.errors import HTTP_STATUS, ErrorCode, InvalidArgument


def cols(n, version=3, kv=None):
    return TokenColumns(
        token_ids=np.arange(n), logprobs=-np.ones(n), entropy=np.ones(n),
        policy_version=np.full(n, version), kv_version=np.full(n, version if kv is None else kv),
    )


def test_columns_cast_to_wire_dtypes():
    c = cols(4)
    assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
    assert c.policy_version.dtype == np.int32 and len(c) == 4


def test_kv_version_never_exceeds_policy_version():
    with pytest.raises(InvalidArgument):
        cols(3, version=2, kv=3)


def test_segments_must_cover_tokens():
    with pytest.raises(InvalidArgument, match="segments cover"):
        Trajectory("t", np.array([1, 2]), cols(3), FinishReason("stop"),
                   [Segment(0, 2, 3, "e0")])


def test_narrowest_uint():
    assert narrowest_uint(8) == np.uint8 and narrowest_uint(256) == np.uint8
    assert narrowest_uint(257) == np.uint16


def test_routed_experts_from_int32_checks_range():
    flat = np.array([0, 1, 2, 3], dtype="<i4")
    r = RoutedExperts.from_int32(flat, num_layers=1, top_k=2, num_experts=4)
    assert r.data.shape == (2, 1, 2) and r.data.dtype == np.uint8
    with pytest.raises(InvalidArgument):
        RoutedExperts.from_int32(flat, num_layers=1, top_k=2, num_experts=3)


def test_concat_and_staleness():
    c = TokenColumns.concat([cols(2, version=1), cols(3, version=2, kv=1)])
    assert c.policy_version.tolist() == [1, 1, 2, 2, 2]
    assert lag(4, c.policy_version).tolist() == [3, 3, 2, 2, 2]
    s = trajectory_staleness(4, c.policy_version)
    assert (s.intra, s.inter, s.max_lag) == (1, 2, 3)


def test_error_codes_map_to_http():
    assert InvalidArgument("x").http_status == 400
    assert set(HTTP_STATUS) == set(ErrorCode)
