"""Request models of a rollout (validated once at the HTTP boundary)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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

    max_new_tokens: int = Field(default=128, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Softmax temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Top-k sampling (-1 = off).")
    min_p: float = Field(default=0.0, ge=0, le=1, description="Min-p sampling.")
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, description="Frequency penalty.")
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, description="Presence penalty.")
    repetition_penalty: float = Field(default=1.0, gt=0, le=10, description="Repetition penalty.")
    min_new_tokens: int = Field(default=0, ge=0, description="Tokens before stop/EOS may end.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings.")
    stop_token_ids: list[int] | None = Field(default=None, description="Stop token ids.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS.")
    skip_special_tokens: bool = Field(default=True, description="Detokenizer option.")
    sampling_seed: int | None = Field(default=None, description="Per-request sampling seed.")
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


class RolloutRequest(BaseModel):
    """``POST /v1/rollouts``: n samples of one prompt."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(default=None, description="Prompt text (the engine tokenizes).")
    input_ids: list[int] | None = Field(default=None, description="Prompt token ids.")
    n: int = Field(default=1, ge=1, description="Samples (each its own engine request).")
    sampling_params: SamplingParams = Field(default_factory=SamplingParams,
                                            description="Sampling parameters.")
    group_id: str | None = Field(default=None, max_length=256,
                                 description="GRPO group id; also the routing stickiness key.")
    session_id: str | None = Field(default=None, max_length=256,
                                   description="Stickiness key (agent sessions); wins over group.")
    request_id: str | None = Field(
        default=None, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Idempotency key: trajectory ids become '<request_id>:<i>'.")
    metadata: dict[str, str] = Field(default_factory=dict, description="Stored with each trajectory.")
    stream: bool = Field(default=False, description="Server-sent events of stamped chunks.")
    publish: bool = Field(default=True, description="Publish finished trajectories to the store.")
    return_routed_experts: bool | None = Field(
        default=None, description="MoE routing per token. true: required (the request fails "
        "with 409 naming what to configure when the engine cannot give it); null (default): "
        "included whenever the engine can give it; false: never asked for.")

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'input_ids'")
        if self.input_ids is not None:
            if not self.input_ids:
                raise ValueError("input_ids must not be empty")
            if min(self.input_ids) < 0:
                raise ValueError("input_ids must be non-negative token ids")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
