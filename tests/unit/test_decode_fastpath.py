"""engines.decode (byte-level cuts, chunked fused decoding) against a plain orjson decoder.

The plain decoder parses the whole body with orjson and converts the parsed lists with
numpy; every column the fast path returns must be bit-identical to it, on random bodies
with -inf (null) and exponent-notation logprobs, negative zeros, n > 1 lists, routed
experts spanning several decode chunks; malformed input must give EngineError.
"""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from rollout_gateway.engines import decode_experts, decode_toplogprobs
from rollout_gateway.engines.decode import DecodeOptions, RoutingSpec, decode_generate
from rollout_gateway.engines.decode_entropy import topk_entropy
from rollout_gateway.errors import EngineError

L, K, E = 4, 2, 16
SPECIALS = [float("-inf"), -1e-05, -0.0, -2.5e-300, -1.0000000000000002, -12.75]


@pytest.fixture(params=[64, 1 << 18], autouse=True)
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(decode_experts, "_PY_CHUNK", request.param)
    return request.param


@pytest.fixture(autouse=True)
def fast_for_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_toplogprobs, "MIN_BYTES", 0)


def _output(rng: np.random.Generator, top_k: int) -> dict:
    p, t = int(rng.integers(1, 40)), int(rng.integers(1, 60))
    ids = rng.integers(0, 50_000, t).tolist()
    lps = np.log(rng.uniform(0.01, 1.0, t)).astype(np.float32).astype(float).tolist()
    lps = [SPECIALS[int(rng.integers(len(SPECIALS)))] if rng.random() < 0.2 else x for x in lps]
    meta = {"id": f"r{rng.integers(1000)}", "finish_reason": {"type": "length", "length": t},
            "prompt_tokens": p, "completion_tokens": t, "cached_tokens": 0,
            "weight_version": "7",
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)]}
    if top_k:
        probs = rng.dirichlet(np.ones(top_k + 2), size=t)[:, :top_k]
        meta["output_top_logprobs"] = [[[float(np.log(q)), int(j), None] for j, q in enumerate(r)]
                                       for r in probs]
    else:
        meta["output_token_entropy"] = rng.uniform(0, 5, t).astype(np.float32).tolist()
    rows = rng.integers(0, E, (p + t - 1, L, K)).astype("<i4")
    meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
    meta["weight_versions"] = [{"version": "7", "start": 0, "end": t}]
    return {"text": "x", "output_ids": ids, "meta_info": meta}


def _plain(item: dict, vocab: int) -> dict:
    m = item["meta_info"]
    lp = np.array([-np.inf if r[0] is None else r[0] for r in m["output_token_logprobs"]],
                  dtype=np.float64).astype(np.float32)
    if "output_top_logprobs" in m:
        top = np.array([[-np.inf if e[0] is None else e[0] for e in r]
                        for r in m["output_top_logprobs"]])
        ent, err = topk_entropy(top, vocab)
    else:
        ent, err = np.array(m["output_token_entropy"], dtype=np.float32), None
    routed = np.frombuffer(base64.b64decode(m["routed_experts"]), "<i4").astype(np.uint8)
    return {"ids": np.array(item["output_ids"], np.int32), "lp": lp, "ent": ent, "err": err,
            "routed": routed.reshape(-1, L, K)}


def _bits(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("seed", range(10))
def test_random_bodies_bit_identical_to_plain_orjson(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    items = [_output(rng, top_k=int(rng.integers(0, 2)) * int(rng.integers(1, 6)))
             for _ in range(n)]
    body = orjson.dumps(items if n > 1 else items[0])
    opts = DecodeOptions(routing=RoutingSpec(L, K, E), vocab_size=1000)
    got = decode_generate(body, opts)
    assert len(got) == n
    for d, item in zip(got, items):
        want = _plain(orjson.loads(orjson.dumps(item)), 1000)
        assert _bits(d.output_ids, want["ids"])
        assert _bits(d.logprobs, want["lp"])
        assert _bits(d.entropy, want["ent"])
        assert _bits(d.entropy_error, want["err"])
        assert d.routed is not None and _bits(d.routed.data, want["routed"])
        assert np.signbit(d.logprobs).tolist() == np.signbit(want["lp"]).tolist()


def _one(rng: np.random.Generator) -> dict:
    return _output(rng, top_k=0)


@pytest.mark.parametrize("value, match", [
    ('"AAAA!AAA"', "not valid base64"),
    ('"AAAAAAA"', "routed_experts"),
    ('"#re:7"', "not valid base64"),  # our placeholder text sent by an engine
    ('"#re:x"', "not valid base64"),
    ("12", "base64 string"),
])
def test_malformed_routed_experts_give_engine_error(value: str, match: str) -> None:
    item = _one(np.random.default_rng(1))
    body = orjson.dumps(item).replace(
        b'"' + item["meta_info"]["routed_experts"].encode() + b'"', value.encode())
    with pytest.raises(EngineError, match=match):
        decode_generate(body, DecodeOptions(routing=RoutingSpec(L, K, E)))


def test_unterminated_routed_experts_string() -> None:
    body = b'{"output_ids":[1],"meta_info":{"routed_experts":"' + b"A" * 300
    with pytest.raises(EngineError, match="unterminated routed_experts"):
        decode_generate(body, DecodeOptions(routing=RoutingSpec(L, K, E)))


def test_bad_routed_experts_where_nobody_reads_them_is_ignored_as_before() -> None:
    item = _one(np.random.default_rng(2))
    item["extra"] = {"routed_experts": "!!not base64!!"}  # outside meta_info: never used
    got = decode_generate(orjson.dumps(item), DecodeOptions(routing=RoutingSpec(L, K, E)))
    assert got[0].routed is not None


def test_out_of_range_expert_in_one_of_n_outputs() -> None:
    rng = np.random.default_rng(3)
    items = [_one(rng), _one(rng)]
    rows = np.zeros((items[1]["meta_info"]["prompt_tokens"]
                     + items[1]["meta_info"]["completion_tokens"] - 1, L, K), "<i4")
    rows[-1, -1, -1] = E
    items[1]["meta_info"]["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
    with pytest.raises(EngineError, match="outside"):
        decode_generate(orjson.dumps(items), DecodeOptions(routing=RoutingSpec(L, K, E)))


@pytest.mark.parametrize("field, value", [
    ("output_top_logprobs", b"[[[NaN,1,null]],[[-0.1,1,null]]]"),
    ("output_top_logprobs", b"[[[-Infinity,1,null]],[[-0.1,1,null]]]"),
    ("output_token_logprobs", b"[[NaN,1,null],[-0.1,2,null]]"),
    ("output_token_entropy", b"[NaN,0.5]"),
])
def test_nan_and_infinity_literals_are_not_json(field: str, value: bytes) -> None:
    meta = (b'"prompt_tokens":1,"completion_tokens":2,"output_token_entropy":[0.1,0.2],'
            b'"output_token_logprobs":[[-0.1,1,null],[-0.1,2,null]],')
    body = b'{"output_ids":[1,2],"meta_info":{' + meta + b'"' + field.encode() + b'":' + value
    body += b"}}"
    with pytest.raises(EngineError, match="invalid JSON"):
        decode_generate(body)
