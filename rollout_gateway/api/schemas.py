"""OpenAPI request schemas of routes that parse their body by hand (``/generate``).

``/generate`` reads SGLang's body itself (:func:`api.generate.to_rollout_request`); this
model only documents it, with the same bounds, so that clients and schema-driven fuzzers
(schemathesis, in ``tests/security``) know what a valid request looks like.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollout_gateway.rollouts.models import SamplingParams, Text, TokenId, one_of


class GenerateSamplingParams(SamplingParams):
    n: int = Field(default=1, ge=1, le=4096, description="Samples of the prompt.")


class GenerateRequest(BaseModel):
    """SGLang ``/generate``: one prompt (``text`` or ``input_ids``), ``n`` samples."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=one_of("text", "input_ids"))

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
    version_policy: str | None = Field(
        default=None, max_length=64, description="Which engine versions may serve: any | "
        "latest | min_version:<v> | max_staleness:<k> (the gateway's; as /v1/rollouts).")


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


def apply_limits(doc: dict[str, Any], settings: Any) -> dict[str, Any]:
    """Write this gateway's configured limits (n, max_new_tokens, prompt sizes) into its
    OpenAPI document, so the schema says exactly what it accepts."""
    comps = doc.get("components", {}).get("schemas", {})
    bodies = [comps.get("RolloutRequest"),
              doc.get("paths", {}).get("/generate", {}).get("post", {}).get("requestBody", {})
              .get("content", {}).get("application/json", {}).get("schema")]
    samplings = [comps.get("SamplingParams")]
    for b in bodies:
        if not b:
            continue
        props = b.get("properties", {})
        _set_max(props.get("n"), settings.max_samples_per_request)
        _set_max(props.get("input_ids"), settings.max_prompt_tokens, "maxItems")
        _set_max(props.get("prompt") or props.get("text"), settings.max_prompt_chars, "maxLength")
        sp = props.get("sampling_params")
        if sp:
            samplings.append(sp)
    for sp in samplings:
        for branch in _branches(sp):
            props = branch.get("properties", {})
            _set_max(props.get("max_new_tokens"), settings.max_new_tokens_limit)
            _set_max(props.get("min_new_tokens"), settings.max_new_tokens_limit)
            _set_max(props.get("n"), settings.max_samples_per_request)
    return doc


def _branches(schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not schema:
        return []
    return [schema] + [b for b in schema.get("anyOf", []) if isinstance(b, dict)]


def _set_max(schema: dict[str, Any] | None, limit: int, key: str = "maximum") -> None:
    for branch in _branches(schema):
        if branch.get("type") in ("integer", "array", "string"):
            if key in branch or key == "maximum" and branch.get("type") == "integer":
                branch[key] = min(branch.get(key, limit), limit)
            elif key != "maximum":
                branch[key] = limit
