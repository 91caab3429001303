"""Gateway configuration: environment (prefix ``ROLLOUT_GATEWAY_``) over a config file.

Precedence: explicit keyword arguments > environment variables > the config file
(TOML, JSON or YAML, chosen by suffix; path from ``config_file=`` or
``ROLLOUT_GATEWAY_CONFIG_FILE``) > defaults. Nested fields use ``__`` in env names,
e.g. ``ROLLOUT_GATEWAY_TIMEOUTS__GENERATE_S=60``. ``ROLLOUT_GATEWAY_ENGINES`` takes a
JSON list of ``{"id", "url"}`` objects or a comma-separated list of URLs.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from rollout_gateway.core.admission import AdmissionConfig
from rollout_gateway.errors import InvalidArgument

ENV_PREFIX = "ROLLOUT_GATEWAY_"


class EngineSpec(BaseModel):
    """One inference engine the gateway should route to."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
                    description="Stable engine id used in stamps, segments and the admin API.")
    url: str = Field(min_length=8, description="Base URL of the SGLang HTTP server, e.g. http://h:30000.")
    api_key: str | None = Field(default=None,
                                description="Bearer token for the engine's admin endpoints, if any.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("engine url must start with http:// or https://")
        return v.rstrip("/")


class Timeouts(BaseModel):
    """Per-phase deadlines for engine calls, in seconds."""

    connect_s: float = Field(default=5.0, gt=0, le=300, description="TCP connect to an engine.")
    generate_s: float = Field(default=600.0, gt=0, le=86400,
                              description="Max silence while reading a /generate response.")
    control_s: float = Field(default=30.0, gt=0, le=3600,
                             description="pause / continue / abort / info calls.")
    weight_load_s: float = Field(default=600.0, gt=0, le=86400,
                                 description="One engine's weight update call.")
    health_s: float = Field(default=3.0, gt=0, le=60, description="One /health probe.")
    drain_s: float = Field(default=600.0, gt=0, le=86400,
                           description="Max wait for in-flight requests in drain mode, and for "
                           "a fenced engine to reopen.")
    no_engine_s: float = Field(default=5.0, ge=0, le=3600,
                               description="How long a request waits for some engine to come "
                               "(back) into rotation before failing with 503.")


class ModelShape(BaseModel):
    """MoE shape of the served model, needed to reshape routed experts.

    Left unset, the gateway asks each engine (``/model_info`` fields ``num_hidden_layers``,
    ``num_experts_per_tok``, ``num_experts``) and skips routed experts if it cannot tell."""

    num_layers: int | None = Field(default=None, ge=1, le=1024, description="Model layers.")
    top_k: int | None = Field(default=None, ge=1, le=256, description="Experts per token.")
    num_experts: int | None = Field(default=None, ge=1, le=1 << 20, description="Experts per layer.")


class OldLogitsSettings(BaseModel):
    """Exact old logits (pi_old) filled into the trajectory's ``old_logprobs`` column by a
    dedicated scorer engine (a reference/SGLang engine outside the generation pool, used
    for input-logprob re-scoring). See docs: README "Exact old logits".

    * ``off``: nothing is filled (learner-side strategies: snapshots, EWMA, fallbacks).
    * ``model``: every finished trajectory is scored before delivery, each token under the
      version that produced it (the scorer loads that version's checkpoint on demand).
    * ``interruption``: at each swap, after the fence and before the new weights load, the
      partial rollouts interrupted by it are scored under the outgoing version; the scorer
      then follows the swap; at finish the tail (current version) is scored. Needs
      ``mode=abort_resume`` or ``drain`` swaps from disk, not rolling.
    Both need disk sources (the scorer reloads checkpoints by path)."""

    mode: Literal["off", "model", "interruption"] = Field(
        default="off", description="Which exact old-logit strategy fills old_logprobs.")
    scorer_url: str | None = Field(
        default=None, min_length=8, description="Base URL of the scorer engine (not in the pool).")
    scorer_api_key: str | None = Field(default=None, description="Scorer admin API key.")
    initial_source: str | None = Field(
        default=None, max_length=4096,
        description="Checkpoint dir of the scorer's start-up version (so it can return to "
                    "it after loading newer ones); later versions come from swap records.")
    score_timeout_s: float = Field(default=120.0, gt=0, le=3600,
                                   description="Deadline of one scoring call.")

    @model_validator(mode="after")
    def _scorer_needed(self) -> OldLogitsSettings:
        if self.mode != "off" and not self.scorer_url:
            raise ValueError(f"old_logits.mode={self.mode!r} needs old_logits.scorer_url "
                             "(a scorer engine outside the generation pool)")
        return self


class GatewaySettings(BaseSettings):
    """Everything the gateway reads at start-up."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", validate_default=True)

    engines: Annotated[list[EngineSpec], NoDecode] = Field(
        default_factory=list, description="Engines registered at start-up (more via /v1/engines).")
    store_url: str = Field(default="memory://",
                           description="Trajectory store: memory:// or redis://host:port/db.")
    registry_url: str = Field(default="memory://",
                              description="Version registry: memory:// or redis://host:port/db.")
    http_host: str = Field(default="0.0.0.0", description="HTTP API bind address.")
    http_port: int = Field(default=8000, ge=0, le=65535, description="HTTP API port (0 = any).")
    grpc_host: str = Field(default="0.0.0.0", description="Learner gRPC bind address.")
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="Learner gRPC port (0 = any).")
    admin_api_key: str | None = Field(
        default=None, description="If set, admin routes (/v1/weights, /v1/engines writes) need "
        "'Authorization: Bearer <key>'.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Staleness bound (max_staleness), "
        "admission control (batch_size, max_concurrent) and the stale policy "
        "(drop | mask | recycle). Env: ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS=4 etc.")
    max_samples_per_request: int = Field(default=64, ge=1, le=4096,
                                         description="Largest n accepted by /v1/rollouts.")
    max_new_tokens_limit: int = Field(default=32768, ge=1, le=1 << 20,
                                      description="Largest max_new_tokens accepted.")
    max_prompt_tokens: int = Field(default=131072, ge=1, le=1 << 22,
                                   description="Largest prompt (token ids) accepted.")
    top_logprobs_num: int = Field(default=5, ge=0, le=100,
                                  description="Top-k logprobs requested for entropy estimates.")
    stream_from_engines: bool = Field(
        default=True, description="Read engine output as a stream so tokens generated before an "
        "engine dies are kept and resumed elsewhere (costs some parsing).")
    health_interval_s: float = Field(default=2.0, gt=0, le=3600,
                                     description="Seconds between engine health probes.")
    unhealthy_after: int = Field(default=2, ge=1, le=100,
                                 description="Consecutive failed probes before an engine leaves rotation.")
    max_attempts: int = Field(default=4, ge=1, le=100,
                              description="Engine requests per sample before giving up (failover).")
    sticky_imbalance: int = Field(
        default=8, ge=0, le=1_000_000, description="Sticky routing yields to least-load when the "
        "sticky engine has this many more outstanding requests than the least loaded one.")
    model: ModelShape = Field(default_factory=ModelShape, description="MoE shape (optional).")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="Engine call deadlines.")
    old_logits: OldLogitsSettings = Field(
        default_factory=OldLogitsSettings,
        description="Exact old logits by a dedicated scorer (model) or at swaps (interruption).")
    drain_grace_s: float = Field(default=30.0, ge=0, le=3600,
                                 description="On SIGTERM: seconds to let in-flight rollouts finish.")

    @field_validator("engines", mode="before")
    @classmethod
    def _engines(cls, v: Any) -> Any:
        if isinstance(v, str):
            s = v.strip()
            if not s:
                return []
            if s.startswith("["):
                return json.loads(s)
            return [{"id": f"engine-{i}", "url": u.strip()}
                    for i, u in enumerate(s.split(",")) if u.strip()]
        return v

    @field_validator("engines")
    @classmethod
    def _unique(cls, v: list[EngineSpec]) -> list[EngineSpec]:
        ids = [e.id for e in v]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        return v

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        return (init_settings, env_settings, _FileSource(settings_cls))


class _FileSource(PydanticBaseSettingsSource):
    """Reads the config file named by ``ROLLOUT_GATEWAY_CONFIG_FILE``."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get(ENV_PREFIX + "CONFIG_FILE")
        return read_config_file(path) if path else {}


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read config file {p}: {exc}") from exc
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(raw.decode())
        elif p.suffix == ".json":
            data = json.loads(raw)
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw) or {}
        else:
            raise InvalidArgument(f"config file {p} must end in .toml, .json, .yaml or .yml")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"config file {p} is not valid {p.suffix[1:]}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"config file {p} must hold a mapping at the top level")
    return data


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> GatewaySettings:
    """Build settings; ``config_file`` wins over ``ROLLOUT_GATEWAY_CONFIG_FILE``."""
    from pydantic import ValidationError

    old = os.environ.get(ENV_PREFIX + "CONFIG_FILE")
    try:
        if config_file is not None:
            os.environ[ENV_PREFIX + "CONFIG_FILE"] = str(config_file)
        return GatewaySettings(**overrides)
    except ValidationError as exc:
        raise InvalidArgument(f"invalid gateway settings: {exc}") from exc
    finally:
        if config_file is not None:
            if old is None:
                os.environ.pop(ENV_PREFIX + "CONFIG_FILE", None)
            else:
                os.environ[ENV_PREFIX + "CONFIG_FILE"] = old
