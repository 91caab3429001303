"""Every field a caller can request is returned or refused with a named error: routing,
top-k logprob rows, input logprobs, entropy. And the routing shape is read from a HF
config.json the way a deployment has it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from rollout_gateway.core.trajectory import EntropyKind, TokenColumns
from rollout_gateway.engines.client import EngineInfo
from rollout_gateway.engines.decode import DecodeOptions, RoutingSpec, decode_one
from rollout_gateway.engines.shape import (
    read_hf_config,
    resolve_spec,
    routing_problem,
    shape_from_hf_config,
)
from rollout_gateway.errors import EngineError, FailedPrecondition
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.sample import PassThrough, Piece, SampleRunner, SampleState, wants_routing
from rollout_gateway.settings import GatewaySettings, ModelShape


def _answer(finish: dict | None, **meta) -> bytes:
    return orjson.dumps({"text": "ab", "output_ids": [5, 6], "meta_info": {
        "id": "r", "finish_reason": finish, "prompt_tokens": 2, "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]], **meta}})


# ---- routing ----------------------------------------------------------------------------
def test_requested_routing_missing_from_a_finished_answer_is_an_engine_error():
    opts = DecodeOptions(routing=RoutingSpec(2, 2, 4), require_routing=True)
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        decode_one(_answer({"type": "length", "length": 2}), opts)
    # an aborted request (swap, failover) may end without it: its successor carries it
    assert decode_one(_answer({"type": "abort"}), opts).routed is None
    assert decode_one(_answer(None), opts).routed is None  # a stream chunk, not final
    # not requested: fine
    assert decode_one(_answer({"type": "stop"}), DecodeOptions()).routed is None


def _engine(**info) -> SimpleNamespace:
    return SimpleNamespace(id="e0", client=SimpleNamespace(info=EngineInfo(**info)))


def test_routing_asked_of_an_engine_that_cannot_give_it_is_refused_by_name():
    settings = GatewaySettings()
    req = RolloutRequest(input_ids=[1], return_routed_experts=True)
    unknown = _engine(shape_source="/m/config.json is not readable here (FileNotFoundError)")
    with pytest.raises(FailedPrecondition, match="ROLLOUT_GATEWAY_MODEL__NUM_LAYERS.*config.json"):
        wants_routing(unknown, req, settings)
    flagless = _engine(num_layers=2, top_k=2, num_experts=4, routing_enabled=False)
    with pytest.raises(FailedPrecondition, match="--enable-return-routed-experts"):
        wants_routing(flagless, req, settings)
    # not requested (default None): asked only when the engine can give it
    default = RolloutRequest(input_ids=[1])
    assert wants_routing(unknown, default, settings) is False
    assert wants_routing(_engine(num_layers=2, top_k=2, num_experts=4), default, settings)
    # settings fill what the engine did not say
    fixed = GatewaySettings(model=ModelShape(num_layers=2, top_k=2, num_experts=4))
    assert wants_routing(unknown, req, fixed) is True
    assert routing_problem("e0", unknown.client.info, fixed.model) is None


def test_shape_from_hf_configs(tmp_path):
    assert shape_from_hf_config({"num_hidden_layers": 48, "num_experts_per_tok": 8,
                                 "num_experts": 128}) == (48, 8, 128)  # Qwen3-MoE
    assert shape_from_hf_config({"num_hidden_layers": 32, "num_experts_per_tok": 2,
                                 "num_local_experts": 8}) == (32, 2, 8)  # Mixtral / GPT-OSS
    assert shape_from_hf_config({"num_hidden_layers": 61, "num_experts_per_tok": 8,
                                 "n_routed_experts": 256}) == (61, 8, 256)  # DeepSeek-V3
    nested = {"architectures": ["X"], "text_config": {"num_hidden_layers": 4,
                                                       "num_experts_per_tok": 2,
                                                       "num_experts": 8}}
    assert shape_from_hf_config(nested) == (4, 2, 8)
    assert shape_from_hf_config({"num_hidden_layers": 4}) == (4, None, None)  # dense
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    cfg, where = read_hf_config(str(tmp_path))
    assert cfg == {"num_hidden_layers": 3} and where.endswith("config.json")
    cfg, why = read_hf_config(str(tmp_path / "absent"))
    assert cfg is None and "not readable" in why
    # settings override field by field
    assert resolve_spec(ModelShape(top_k=4), (3, 2, 8)) == RoutingSpec(3, 4, 8)
    assert resolve_spec(ModelShape(), (3, None, 8)) is None


def test_every_routing_payload_is_checked_against_the_shape():
    rows = np.zeros((3, 2, 2), "<i4")  # prompt 2 + output 2 - 1 = 3 rows of 2 x 2
    import base64

    body = _answer({"type": "length"}, routed_experts=base64.b64encode(rows.tobytes()).decode())
    assert decode_one(body, DecodeOptions(routing=RoutingSpec(2, 2, 4))).routed.data.shape == (3, 2, 2)
    for wrong in (RoutingSpec(2, 3, 4), RoutingSpec(3, 2, 4), RoutingSpec(1, 2, 4)):
        with pytest.raises(EngineError, match="routed_experts"):
            decode_one(body, DecodeOptions(routing=wrong))


# ---- top-k rows and input logprobs (the /generate pass-through) -------------------------
def _piece(extra: dict, n: int = 2, start: int = 0) -> Piece:
    cols = TokenColumns(token_ids=np.arange(n, dtype=np.int32),
                        logprobs=np.zeros(n, np.float32), entropy=np.zeros(n, np.float32),
                        policy_version=np.zeros(n, np.int64), kv_version=np.zeros(n, np.int64))
    return Piece(engine_id="e0", input_len=3, cols=cols, segments=[],
                 entropy_kind=EntropyKind.EXACT, entropy_bound=0.0, finish=None, routing=None,
                 extra=extra, input_start=start)


def test_top_logprobs_asked_and_missing_is_an_engine_error():
    pt = PassThrough(top_logprobs_num=2)
    state = SampleState("t", np.array([1, 2, 3], np.int32), pieces=[_piece({})])
    with pytest.raises(EngineError, match="output_top_logprobs"):
        SampleRunner._passed(pt, state, "t")
    rows = [[[-0.1, 5, None], [-2.0, 6, None], [-3.0, 7, None]], None]
    state.pieces = [_piece({"output_top_logprobs": rows})]
    got = SampleRunner._passed(pt, state, "t")["output_top_logprobs"]
    assert got == [rows[0][:2], None]  # the caller's k, from a larger engine request


def test_input_logprobs_asked_and_missing_is_an_engine_error():
    pt = PassThrough(logprob_start_len=1)
    state = SampleState("t", np.array([1, 2, 3], np.int32), pieces=[_piece({})])
    with pytest.raises(EngineError, match="input_token_logprobs"):
        SampleRunner._passed(pt, state, "t")
    rows = [[None, 1, None], [-1.5, 2, None], [-0.5, 3, None]]
    state.pieces = [_piece({"input_token_logprobs": rows}, start=0)]
    # sliced from position 1 with SGLang's null at the start position
    assert SampleRunner._passed(pt, state, "t")["input_token_logprobs"] == [[None, 2, None],
                                                                             [-0.5, 3, None]]


# ---- entropy ----------------------------------------------------------------------------
def test_entropy_is_exact_estimated_with_a_bound_or_explicitly_none():
    exact = decode_one(_answer({"type": "stop"}, output_token_entropy=[1.0, 2.0]))
    assert exact.entropy_kind is EntropyKind.EXACT and exact.entropy_error_bound == 0.0
    top = [[[-0.5, 5, None], [-1.5, 9, None]], [[-0.25, 6, None], [-2.0, 9, None]]]
    est = decode_one(_answer({"type": "stop"}, output_top_logprobs=top))
    assert est.entropy_kind is EntropyKind.TOPK_ESTIMATE
    assert 0 < est.entropy_error_bound < np.inf and est.entropy_error.shape == (2,)
    none = decode_one(_answer({"type": "stop"}))
    assert none.entropy_kind is EntropyKind.NONE and none.entropy_error_bound == np.inf
    assert np.isnan(none.entropy).all()  # marked unknown, never a made-up number
