"""/generate as SGLang's GenerateReqInput: every field forwarded or refused by name."""

from __future__ import annotations

import pytest

from rollout_gateway.api.generate import FORWARDED, NOOP_AT_DEFAULT, parse_generate
from rollout_gateway.errors import InvalidArgument

#: GenerateReqInput's fields in SGLang (python/sglang/srt/managers/io_struct.py, read with
#: the search tools): each must be forwarded or known (accepted at its default only)
SGLANG_FIELDS = (
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes "
    "mm_content_hashes use_audio_in_video video_config sampling_params return_logprob "
    "logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask "
    "return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_top_logprobs_b64 "
    "stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len "
    "return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor "
    "positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room "
    "bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank "
    "disagg_prefill_dp_rank kv_router_hint routing_key conversation_id http_worker_ipc "
    "background require_reasoning max_thinking_tokens priority extra_key no_logs "
    "custom_labels return_bytes return_entropy return_prompt_token_ids "
    "external_trace_header received_time need_wait_for_mm_inputs num_items_assigned "
    "encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch "
    "video_max_dynamic_patch images_config multi_item_delimiter_indices cache_salt").split()


def test_every_sglang_field_is_forwarded_or_known():
    assert not set(SGLANG_FIELDS) - FORWARDED - set(NOOP_AT_DEFAULT)


@pytest.mark.parametrize("field", sorted(NOOP_AT_DEFAULT))
def test_unsupported_fields_pass_at_default_and_are_refused_by_name(field):
    default = NOOP_AT_DEFAULT[field]
    parse_generate({"input_ids": [1, 2], field: default})
    other = "x" if default is None else (not default if isinstance(default, bool) else None)
    if other is None:  # None is a no-op for every field
        return
    with pytest.raises(InvalidArgument, match=field):
        parse_generate({"input_ids": [1, 2], field: other})


def test_unknown_field_is_named():
    with pytest.raises(InvalidArgument, match="made_up"):
        parse_generate({"input_ids": [1], "made_up": 1})


def test_batch_lists_and_n():
    items = parse_generate({"input_ids": [[1, 2], [3, 4, 5]], "rid": ["a", "b"],
                            "sampling_params": [{"n": 2}, {"max_new_tokens": 3}],
                            "return_logprob": [True, False], "top_logprobs_num": 3,
                            "logprob_start_len": [0, -1]})
    assert [it.req.input_ids for it in items] == [[1, 2], [3, 4, 5]]
    assert [it.req.n for it in items] == [2, 1] and [it.opts.rid for it in items] == ["a", "b"]
    assert items[0].passthrough.top_logprobs_num == 3
    assert items[0].passthrough.logprob_start_len == 0
    assert items[1].passthrough.keys() == frozenset()  # no return_logprob: no rows forwarded
    items = parse_generate({"text": ["x", "y"], "rid": "p"})
    assert [it.opts.rid for it in items] == ["p_0", "p_1"]
    for bad, needle in [({"text": ["x", "y"], "rid": ["a"]}, "rid"),
                        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
                        ({"input_ids": [1, 2], "logprob_start_len": 3}, "prompt length"),
                        ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
                        ({"input_ids": [1], "text": "x"}, "exactly one")]:
        with pytest.raises(InvalidArgument, match=needle):
            parse_generate(bad)


def test_routing_request_is_a_requirement():
    (it,) = parse_generate({"input_ids": [1], "return_routed_experts": True,
                            "routed_experts_start_len": 1})
    assert it.req.return_routed_experts is True and it.opts.routed_start == 1
    (it,) = parse_generate({"input_ids": [1]})
    assert it.req.return_routed_experts is None
