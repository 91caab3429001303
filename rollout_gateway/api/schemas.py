"""OpenAPI request schemas of routes that parse their body by hand (``/generate``).

``/generate`` reads SGLang's body itself (:func:`api.generate.to_rollout_request`); this
model only documents it, with the same bounds, so that clients and schema-driven fuzzers
(schemathesis, in ``tests/security``) know what a valid request looks like.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout_gateway.rollouts.models import SamplingParams, Text, TokenId


class GenerateSamplingParams(SamplingParams):
    n: int = Field(default=1, ge=1, le=4096, description="Samples of the prompt.")


class GenerateRequest(BaseModel):
    """SGLang ``/generate``: one prompt (``text`` or ``input_ids``), ``n`` samples."""

    model_config = ConfigDict(extra="forbid")

    text: Text | None = Field(default=None, min_length=1, description="Prompt text.")
    input_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=1 << 22,
                                            description="Prompt token ids.")
    sampling_params: GenerateSamplingParams | None = Field(default=None)
    rid: str | None = Field(default=None, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$",
                            description="Request id (idempotency key).")
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=1 << 20)
    stream: bool = False
    return_routed_experts: bool = False
    group_id: Text | None = Field(default=None, max_length=256)
    session_id: Text | None = Field(default=None, max_length=256)
    metadata: dict[Text, Text] | None = Field(default=None, max_length=1024)


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """Resolve local ``#/$defs/X`` references (the OpenAPI document has no $defs)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.split("/")[-1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def generate_openapi_body() -> dict[str, Any]:
    schema = GenerateRequest.model_json_schema()
    body = _inline(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": body}}}}
