"""Request models of a rollout (validated once at the HTTP boundary)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

#: the widest integers engines and the wire carry: token ids are int32 (SGLang, the
#: gateway's columns and rollout.v1), seeds int64, lengths far below either
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
MAX_TOKENS = 1 << 20  # max_new_tokens / min_new_tokens / top_k: beyond any real model


def _utf8(v: str) -> str:
    """Text must be valid Unicode (a JSON "\\ud800" escape decodes to a lone surrogate,
    which no engine, store or JSON encoder can carry)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return v


#: a string that is valid UTF-8
Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

#: sampling_params keys forwarded to SGLang (0.5.23 rejects unknown keys)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "sampling_seed", "custom_params",
})


class SamplingParams(BaseModel):
    """SGLang sampling parameters (the subset the gateway understands and forwards)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=1, le=MAX_TOKENS,
                                description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Softmax temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, le=MAX_TOKENS, description="Top-k sampling (-1 = off).")
    min_p: float = Field(default=0.0, ge=0, le=1, description="Min-p sampling.")
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, description="Frequency penalty.")
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, description="Presence penalty.")
    repetition_penalty: float = Field(default=1.0, gt=0, le=10, description="Repetition penalty.")
    min_new_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS,
                                description="Tokens before stop/EOS may end.")
    stop: Annotated[Text, Field(max_length=4096)] | Annotated[
        list[Annotated[Text, Field(max_length=4096)]], Field(max_length=64)] | None = Field(
        default=None, description="Stop strings.")
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=1024,
                                                 description="Stop token ids.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    skip_special_tokens: bool = Field(default=True, description="Detokenizer option.")
    sampling_seed: int | None = Field(default=None, ge=0, le=INT64_MAX,
                                      description="Per-request sampling seed.")
    no_stop_trim: bool = Field(default=False, description="Keep the matched stop string/token "
                               "in the text (slime sends true).")
    spaces_between_special_tokens: bool = Field(default=True, description="Detokenizer option.")
    custom_params: dict[str, Any] | None = Field(
        default=None, description="Passed to the engine's custom logit processor, if any.")

    def to_engine(self, remaining: int) -> dict[str, Any]:
        """Only the keys the caller set (plus max_new_tokens = what is left)."""
        d = self.model_dump(exclude_unset=True, exclude_none=True)
        d["max_new_tokens"] = remaining
        if "min_new_tokens" in d:
            d["min_new_tokens"] = max(0, d["min_new_tokens"] - (self.max_new_tokens - remaining))
        return d


def one_of(a: str, b: str) -> dict[str, Any]:
    """JSON schema: exactly one of two optional fields holds a value."""
    return {"oneOf": [{"required": [a], "properties": {a: {"not": {"type": "null"}}}},
                      {"required": [b], "properties": {b: {"not": {"type": "null"}}}}]}


class RolloutRequest(BaseModel):
    """``POST /v1/rollouts``: n samples of one prompt."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=one_of("prompt", "input_ids"))

    prompt: Text | None = Field(default=None, min_length=1,
                                description="Prompt text (the engine tokenizes).")
    input_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=1 << 22,
                                            description="Prompt token ids.")
    n: int = Field(default=1, ge=1, le=4096, description="Samples (each its own engine request).")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams,
                                            description="Sampling parameters.")
    group_id: Text | None = Field(default=None, max_length=256,
                                  description="GRPO group id; also the routing stickiness key.")
    session_id: Text | None = Field(default=None, max_length=256,
                                    description="Stickiness key (agent sessions); wins over group.")
    request_id: str | None = Field(
        default=None, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Idempotency key: trajectory ids become '<request_id>:<i>'.")
    metadata: dict[Text, Text] = Field(default_factory=dict, max_length=1024,
                                       description="Stored with each trajectory (string "
                                       "values; at most max_metadata_bytes in all).")
    stream: bool = Field(default=False, description="Server-sent events of stamped chunks.")
    publish: bool = Field(default=True, description="Publish finished trajectories to the store.")
    return_routed_experts: bool | None = Field(
        default=None, description="MoE routing per token. true: required (the request fails "
        "with 409 naming what to configure when the engine cannot give it); null (default): "
        "included whenever the engine can give it; false: never asked for.")

    version_policy: str | None = Field(
        default=None, max_length=64, description="Which engine versions may serve this "
        "request: any | latest | min_version:<v> | max_staleness:<k> (docs/gateway.md, "
        "'Version policy'); null: header x-version-policy, else the gateway's setting. None "
        "qualifying: 503 with Retry-After.")

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'input_ids'")
        return self  # emptiness, id ranges and text validity: the field constraints
