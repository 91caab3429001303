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
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from rollout_gateway.core.admission import AdmissionConfig
from rollout_gateway.core.version_policy import VersionPolicy
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


class LearnerJob(BaseModel):
    """A learner token limited to some consumer groups (one training job)."""

    model_config = {"extra": "forbid"}

    token: SecretStr = Field(min_length=16, max_length=4096, description="The bearer token.")
    groups: list[str] = Field(min_length=1, max_length=1000,
                              description="Consumer groups it may use: exact names, or "
                              "prefixes written 'name*'.")

    @field_validator("groups")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        import re

        for g in v:
            if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,128}\*?", g) or g == "*":
                raise ValueError(f"group {g!r}: 1-128 characters of [A-Za-z0-9_.:@-], "
                                 "optionally ending in '*' (a prefix)")
        return v


#: a tenant's name: what trajectories carry in metadata "tenant" and what namespaces its
#: session and request ids
TENANT_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
#: the tenant of ``client_api_key`` (and of every client call while the client role is open)
DEFAULT_TENANT = "default"


class ClientTenant(BaseModel):
    """A client token of one tenant: its sessions, request ids and held trajectories are its
    own (another tenant's token gets 404 for them)."""

    model_config = {"extra": "forbid"}

    name: str = Field(pattern=TENANT_NAME, description="Tenant name (stamped on its "
                      "trajectories as metadata 'tenant').")
    token: SecretStr = Field(min_length=16, max_length=4096, description="The bearer token.")


class Timeouts(BaseModel):
    """Per-phase deadlines for engine calls, in seconds."""

    connect_s: float = Field(default=5.0, gt=0, le=300, description="TCP connect to an engine.")
    generate_s: float = Field(default=600.0, gt=0, le=86400,
                              description="Max wait for a non-streamed /generate answer.")
    first_byte_s: float = Field(
        default=300.0, gt=0, le=86400, description="Streamed /generate: max wait for the "
        "response head and for the first bytes of the body (queueing + prefill). Waived "
        "while the engine is paused for a swap.")
    stream_idle_s: float = Field(
        default=60.0, gt=0, le=86400, description="Streamed /generate: max silence on the "
        "stream (no byte arriving for this long, within a chunk or between two); past it "
        "the request moves to another engine from its partial output. Waived while the "
        "engine is paused for a swap.")
    control_s: float = Field(default=30.0, gt=0, le=3600,
                             description="pause / continue / abort / info calls.")
    weight_load_s: float = Field(default=600.0, gt=0, le=86400,
                                 description="One engine's weight update call.")
    health_s: float = Field(default=3.0, gt=0, le=60, description="One /health probe.")
    keep_alive_s: float = Field(
        default=4.0, gt=0, le=3600, description="An engine connection idle this long is "
        "closed instead of reused. Keep it below the engine's own keep-alive timeout "
        "(uvicorn's, hence SGLang's SGLANG_TIMEOUT_KEEP_ALIVE, is 5 s): a connection the "
        "engine closes just as a request goes out on it costs a resend.")
    quiesce_s: float = Field(
        default=60.0, gt=0, le=3600, description="In-place swaps: with the engine fenced, max "
        "wait until every request in flight to it has streamed its first token (then none is "
        "being prefilled when the pause lands, and the gateway knows exactly which weights "
        "computed each token). Retract swaps: max wait until the requests in flight that "
        "asked for routed experts have ended after their abort. An engine that does not "
        "quiesce in time keeps its weights and the swap reports it.")
    drain_s: float = Field(default=600.0, gt=0, le=86400,
                           description="Max wait for in-flight requests in drain mode, and for "
                           "a fenced engine to reopen.")
    no_engine_s: float = Field(default=5.0, ge=0, le=3600,
                               description="How long a request waits for some engine to come "
                               "(back) into rotation before failing with 503.")


class CircuitBreaker(BaseModel):
    """Per-engine circuit breaker: ``failures`` engine requests failing in a row open it;
    the engine then stays out of rotation for ``cooldown_s`` (doubling on each trip in a
    row, up to ``max_cooldown_s``) even if its health probe answers. After the cooldown one
    more failure opens it again; a success closes it. An engine that fails its health
    probes has its in-flight requests broken off at once (they resume elsewhere)."""

    failures: int = Field(default=3, ge=1, le=1000,
                          description="Consecutive failed engine requests that open it.")
    cooldown_s: float = Field(default=5.0, gt=0, le=3600,
                              description="Out of rotation after the first trip.")
    max_cooldown_s: float = Field(default=300.0, gt=0, le=86400,
                                  description="Cap of the doubling cooldown.")


class RedisPool(BaseModel):
    """Redis connections of the store and the registry (each has its own pool)."""

    max_connections: int = Field(default=256, ge=4, le=100_000,
                                 description="Connections per pool at most.")
    wait_s: float = Field(default=20.0, gt=0, le=3600, description="How long a call waits "
                          "for a free connection when all are busy before failing (503).")
    version_cache_s: float = Field(default=0.25, ge=0, le=60, description="How long the "
                                   "learner version read from the registry is reused "
                                   "(this replica's own swaps update it at once).")


class ModelShape(BaseModel):
    """MoE shape of the served model, needed to reshape and check routed experts.

    Each field left unset comes from the engine: the Hugging Face ``config.json`` under the
    ``model_path`` its ``/model_info`` reports (when readable from the gateway, e.g. a
    shared mount), or the reference engine's ``model_config``. Set fields win. When the
    shape stays unknown, a request that asks for routing fails with 409 naming these
    settings (logged once per engine at registration); every ``routed_experts`` payload is
    checked against the shape (rows x layers x top_k ids), a mismatch is an engine error.
    Env: ``ROLLOUT_GATEWAY_MODEL__NUM_LAYERS``, ``__TOP_K``, ``__NUM_EXPERTS``,
    ``__VOCAB_SIZE``."""

    num_layers: int | None = Field(default=None, ge=1, le=1024, description="Model layers.")
    top_k: int | None = Field(default=None, ge=1, le=256, description="Experts per token.")
    num_experts: int | None = Field(default=None, ge=1, le=1 << 20, description="Experts per layer.")
    vocab_size: int | None = Field(
        default=None, ge=1, le=1 << 31, description="Vocabulary size: prompt and stop token "
        "ids at or above it are refused with 400 before any engine sees them (SGLang does "
        "not check input ids). Unset: the engines' config.json / model_config, else "
        "unchecked. Env: ROLLOUT_GATEWAY_MODEL__VOCAB_SIZE.")


class OldLogitsMode(StrEnum):
    """Which exact old-logit strategy fills ``old_logprobs`` (:class:`OldLogitsSettings`)."""

    OFF = "off"
    MODEL = "model"
    INTERRUPTION = "interruption"


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

    mode: OldLogitsMode = Field(
        default=OldLogitsMode.OFF, description="Which exact old-logit strategy fills old_logprobs.")
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
        if self.mode is not OldLogitsMode.OFF and not self.scorer_url:
            raise ValueError(f"old_logits.mode={self.mode.value!r} needs old_logits.scorer_url "
                             "(a scorer engine outside the generation pool)")
        return self


class EngineDiscovery(BaseModel):
    """Engines found by resolving a DNS name (a Kubernetes headless Service): one engine per
    address, re-resolved every ``interval_s`` (see rollout_gateway/engines/discovery.py)."""

    dns_name: str | None = Field(default=None, min_length=1, max_length=253,
                                 description="Name to resolve, e.g. "
                                 "sglang-engine.rollout.svc.cluster.local; unset: off.")
    port: int = Field(default=30000, ge=1, le=65535, description="Engines' HTTP port.")
    scheme: str = Field(default="http", pattern=r"^https?$", description="http or https.")
    interval_s: float = Field(default=10.0, ge=0.1, le=3600,
                              description="Seconds between lookups.")
    id_prefix: str = Field(default="engine", min_length=1, max_length=64,
                           pattern=r"^[A-Za-z0-9_.-]+$",
                           description="Discovered engines are named <id_prefix>-<address>.")
    api_key: str | None = Field(default=None, description="Bearer token for the engines' "
                                "admin endpoints, if any.")


class GatewaySettings(BaseSettings):
    """Everything the gateway reads at start-up."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", validate_default=True)

    engines: Annotated[list[EngineSpec], NoDecode] = Field(
        default_factory=list, description="Engines registered at start-up (more via /v1/engines).")
    store_url: str = Field(default="memory://",
                           description="Trajectory store: memory://, redis://host:port/db or "
                           "redis+cluster://host:port[,host:port...] (a Redis Cluster, any "
                           "node as a seed).")
    store_shards: int = Field(default=1, ge=1, le=256, description="Trajectory streams of a "
                              "Redis store (a store URL's ?shards= wins): each in its own "
                              "cluster slot, spread evenly over the slot space, so a multiple "
                              "of the cluster's masters puts the same load on each; a "
                              "trajectory goes to the shard of its id, learners pull from "
                              "every shard. 1 keeps single-node Redis' key names; each "
                              "shard holds max_backlog / store_shards per group.")
    registry_url: str = Field(default="memory://",
                              description="Version registry: memory://, redis://host:port/db "
                              "or redis+cluster://host:port[,...].")
    http_host: str = Field(default="127.0.0.1", description="HTTP API bind address (a "
                           "non-loopback one needs the admin, learner and client keys, or insecure).")
    http_port: int = Field(default=8000, ge=0, le=65535, description="HTTP API port (0 = any).")
    grpc_host: str = Field(default="127.0.0.1", description="Learner gRPC bind address (as "
                           "http_host).")
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="Learner gRPC port (0 = any).")
    workers: int = Field(
        default=1, ge=1, le=64, description="Gateway processes serving this host's HTTP and "
        "gRPC ports (`serve --workers N`; SO_REUSEPORT: the kernel spreads new connections "
        "over them). Each worker is a replica (own replica_id, engine probes and agent "
        "sessions); more than 1 needs a shared store and registry (redis://), never memory://.")
    admin_api_key: SecretStr | None = Field(
        default=None, min_length=16, max_length=4096,
        description="Admin token: /v1/weights, /v1/engines writes and gRPC AnnounceVersion "
        "need 'Authorization: Bearer <key>' (accepted for every other role too). Unset: open.")
    learner_api_key: SecretStr | None = Field(
        default=None, min_length=16, max_length=4096,
        description="Learner token for the gRPC service (Pull, Ack, Nack, CreateGroup, "
        "GetStatus, WatchVersions), every consumer group; metadata 'authorization: Bearer "
        "<key>'. Unset (and no learner_jobs): open.")
    learner_jobs: list[LearnerJob] = Field(
        default_factory=list, max_length=10_000,
        description="Learner tokens bound to consumer groups, one per training job: JSON "
        "'[{\"token\": \"...\", \"groups\": [\"job-a\", \"job-a-*\"]}]'.")
    client_api_key: SecretStr | None = Field(
        default=None, min_length=16, max_length=4096,
        description="Client token for /v1/rollouts, /generate and the OpenAI routes: the "
        "tenant named 'default'. Unset (and no client_tenants): those are open.")
    client_tenants: list[ClientTenant] = Field(
        default_factory=list, max_length=10_000,
        description="Client tokens per tenant: JSON '[{\"name\": \"team-a\", \"token\": "
        "\"...\"}]'. Sessions, request ids and held trajectories belong to the tenant that "
        "made them; another tenant gets 404, the admin token acts on all.")
    max_sessions_per_tenant: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Open sessions of one tenant at most "
        "(429 past it). Unset: max_sessions.")
    max_pending_per_tenant: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Generation requests of one tenant in "
        "progress at most (429 with Retry-After past it). Unset: max_pending_requests.")
    insecure: bool = Field(
        default=False, description="Allow binding a non-loopback address without the admin "
        "and learner keys (and, for the HTTP bind, the client key): serve/up refuse "
        "otherwise; flag --insecure.")
    tls_cert_file: str | None = Field(
        default=None, description="PEM certificate chain: serve HTTPS and gRPC over TLS "
        "(needs tls_key_file).")
    tls_key_file: str | None = Field(default=None, description="PEM private key of tls_cert_file.")
    grpc_client_ca_file: str | None = Field(
        default=None, description="PEM CA bundle: the learner gRPC service requires client "
        "certificates signed by it (mutual TLS; needs tls_cert_file).")
    max_body_bytes: int = Field(default=16 << 20, ge=1024, le=1 << 31,
                                description="Largest HTTP request body (413 beyond).")
    max_prompt_chars: int = Field(default=1 << 20, ge=1, le=1 << 28,
                                  description="Largest text prompt, in characters.")
    max_metadata_bytes: int = Field(default=64 << 10, ge=0, le=1 << 24,
                                    description="Largest rollout metadata (keys + values, UTF-8).")
    max_pending_requests: int = Field(
        default=2048, ge=1, le=1_000_000,
        description="Rollout and /generate requests handled at once by this replica; more "
        "are answered 429 with Retry-After at once (bounded memory under overload).")
    retry_after_s: int = Field(default=1, ge=0, le=3600,
                               description="Retry-After (seconds) sent with 429 answers.")
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
    engine_stream_interval: int = Field(
        default=64, ge=1, le=4096, description="Tokens per streamed chunk the gateway asks "
        "engines for (SGLang's per-request sampling_params.stream_interval, 0.5.23+) when it "
        "reads a stream for a caller who does not stream: SGLang sends the first token at "
        "once, then a chunk whenever this many are unsent (its default is one chunk per "
        "token). Every chunk costs SGLang and the gateway tens of microseconds of CPU; what "
        "an engine death loses beyond the last chunk (at most this many tokens) is generated "
        "again elsewhere; stream_idle_s must exceed the time this many tokens take. 1: "
        "SGLang's default. Env: ROLLOUT_GATEWAY_ENGINE_STREAM_INTERVAL.")
    max_large_answers: int = Field(
        default=16, ge=0, le=1_000_000, description="Large engine answers (the final "
        "streamed chunk with routed experts, or a body, of 64 KiB or more) read and decoded "
        "at once, over all engines; the others wait unread in their sockets (TCP "
        "backpressure), so many rollouts finishing together do not all sit in the gateway's "
        "memory at once. 0: no bound (every answer is read as it arrives).")
    heap_trim_s: float = Field(
        default=5.0, ge=0, le=3600, description="Every this many seconds, when the "
        "gateway's resident memory grew 32 MiB more than malloc's bytes in use since the "
        "last trim, give the heap's freed memory back to the OS (glibc malloc_trim; after "
        "a burst of answers it would stay resident otherwise). While it runs, malloc keeps "
        "freed heap and serves large blocks from it (mallopt: no page faults per "
        "multi-megabyte answer buffer), and this trim is what gives the memory back. 0: "
        "never (and malloc's defaults stay).")
    gc_young_threshold: int = Field(
        default=50_000, ge=0, le=10_000_000, description="Container allocations between "
        "two young-generation garbage collections (CPython's default is 700; set at "
        "start-up of serve / up, with the start-up objects frozen out of later collections). "
        "With 700, rows that live across a request's awaits reach the old generation and "
        "trigger full collections over every live object: 30-45% of the gateway's CPU when "
        "1000 rollouts finish together. 0: leave Python's setting alone.")
    fast_io: bool = Field(
        default=True, description="Serve on the uvloop event loop with uvicorn's httptools "
        "HTTP parser (both C; base dependencies). false: the stdlib asyncio loop and h11, "
        "e.g. to compare (bench/bench_gateway.py measures both side by side).")
    data_plane: Literal["auto", "native", "python"] = Field(
        default="auto", description="Which parsers decode engine answers: the compiled ones "
        "(rollout_gateway/_native.c, built by pip install with the machine's C compiler) or "
        "the pure-Python reference (same results, slower). auto: native when built (a failed "
        "build falls back silently at install; --version and status say which runs); "
        "python: force the reference, e.g. to debug or compare; native: refuse to start "
        "without the compiled module.")
    health_interval_s: float = Field(default=2.0, gt=0, le=3600,
                                     description="Seconds between engine health probes.")
    unhealthy_after: int = Field(default=2, ge=1, le=100,
                                 description="Consecutive failed probes before an engine leaves rotation.")
    max_attempts: int = Field(default=4, ge=1, le=100,
                              description="Engine requests per sample before giving up (failover).")
    sticky_imbalance: int = Field(
        default=8, ge=0, le=1_000_000, description="Sticky routing yields to least-load when the "
        "sticky engine has this many more outstanding requests than the least loaded one.")
    version_policy: str = Field(
        default="any", max_length=64, description="Which engine versions may serve a "
        "request that names no policy (header x-version-policy, body field version_policy): "
        "any | latest (the learner's version) | min_version:<v> | max_staleness:<k> (learner "
        "version - engine version <= k). A request no engine qualifies for is answered 503 "
        "with Retry-After, never served by another version.")
    version_policy_wait_s: float = Field(
        default=0.0, ge=0, le=3600, description="How long a request waits for an engine its "
        "version policy admits (e.g. one loading the learner's version) before the 503; "
        "0: answer at once.")
    record_routing: bool = Field(
        default=True, description="Ask engines for routed experts on every request whose "
        "caller did not refuse them (return_routed_experts unset), so trajectories carry the "
        "routing for the learner's routing replay (R3). false: only when the caller asks "
        "(return_routed_experts: true); a job without routing replay then does not read "
        "~2.3 KB per token (48 layers x top-8) it never uses. Env: "
        "ROLLOUT_GATEWAY_RECORD_ROUTING.")
    model: ModelShape = Field(default_factory=ModelShape, description="MoE shape; overrides "
                              "what engines' config.json says (ROLLOUT_GATEWAY_MODEL__*).")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="Engine call deadlines.")
    old_logits: OldLogitsSettings = Field(
        default_factory=OldLogitsSettings,
        description="Exact old logits by a dedicated scorer (model) or at swaps (interruption).")
    redis: RedisPool = Field(default_factory=RedisPool,
                             description="Redis connection pools (store and registry).")
    breaker: CircuitBreaker = Field(default_factory=CircuitBreaker,
                                    description="Per-engine circuit breaker.")
    drain_grace_s: float = Field(default=30.0, ge=0, le=3600,
                                 description="On SIGTERM: the process exits within this "
                                 "many seconds. New generation requests get 503; in-flight "
                                 "rollouts may finish until near its end, then what still "
                                 "runs is cut short and published with the output so far "
                                 "(finish_reason abort, counted cut_short).")
    engine_discovery: EngineDiscovery = Field(
        default_factory=EngineDiscovery, description="Find engines through DNS (headless "
        "Service). Env: ROLLOUT_GATEWAY_ENGINE_DISCOVERY__DNS_NAME=... etc.")
    lag_history_interval_s: float = Field(
        default=2.0, ge=0.1, le=3600, description="Seconds between points of the version-lag "
        "history the dashboard (/dashboard, /v1/lag?history=true) draws; 900 points are kept.")
    # ---- agent sessions (/v1/chat/completions, /v1/completions; docs/agents.md) ----
    chat_template: str = Field(
        default="reference", min_length=1, description="'reference' (the reference engine's "
        "byte tokenizer and documented template) or a model / tokenizer directory whose "
        "tokenizer and chat template transformers.AutoTokenizer loads (as SGLang does).")
    served_model_name: str = Field(default="reference", min_length=1, max_length=256,
                                   description="Model id listed by GET /v1/models and echoed "
                                   "in OpenAI responses.")
    session_idle_timeout_s: float = Field(
        default=600.0, gt=0, le=7 * 86400, description="A session with no call for this long "
        "is ended and published (metadata session_ended_by=idle_timeout).")
    session_reward_wait_s: float = Field(
        default=600.0, gt=0, le=7 * 86400, description="How long a session ended with "
        "await_reward waits for POST /v1/trajectories/{id}/reward before it is published "
        "without one (metadata reward=missing).")
    max_sessions: int = Field(default=10_000, ge=1, le=10_000_000,
                              description="Open sessions at most (every replica's, on a "
                              "shared store); a new one past it gets 429.")
    session_lease_s: float = Field(
        default=30.0, ge=0.3, le=3600, description="A call's lock on its session in the "
        "session store lasts this long and is renewed every third of it while the call "
        "runs; when the replica running a call dies, the session's next call (on any "
        "replica) is accepted at most this long after (409 with Retry-After before).")
    session_remember_s: float = Field(
        default=86_400.0, ge=1, le=30 * 86400, description="Shared (Redis) store: how long "
        "ended session ids and published session trajectory ids are remembered, so a call to "
        "an ended session is 409 (not a new session) and a late reward 409 (not 404). The "
        "embedded store remembers the last 100000 of each.")

    @model_validator(mode="after")
    def _tenants(self) -> GatewaySettings:
        names = [t.name for t in self.client_tenants]
        if len(set(names)) != len(names):
            raise ValueError("client_tenants: tenant names must be unique")
        if self.client_api_key is not None and DEFAULT_TENANT in names:
            raise ValueError(f"client_tenants: {DEFAULT_TENANT!r} is client_api_key's tenant; "
                             "name the tenant otherwise or drop client_api_key")
        tokens = [t.token.get_secret_value() for t in self.client_tenants]
        if self.client_api_key is not None:
            tokens.append(self.client_api_key.get_secret_value())
        if len(set(tokens)) != len(tokens):
            raise ValueError("client_tenants: every tenant needs its own token")
        return self

    @model_validator(mode="after")
    def _workers(self) -> GatewaySettings:
        if self.workers > 1:
            local = [f"{name}={url}" for name, url in (("store_url", self.store_url),
                                                        ("registry_url", self.registry_url))
                     if not is_shared_url(url)]
            if local:
                raise ValueError(
                    f"workers={self.workers} needs a store and a registry the workers share "
                    f"(redis://...); {' and '.join(local)} would give each worker its own "
                    "(embedded, in memory): use --store/--registry redis://... or --workers 1")
        return self

    @model_validator(mode="after")
    def _tls(self) -> GatewaySettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.grpc_client_ca_file and not self.tls_cert_file:
            raise ValueError("grpc_client_ca_file (mutual TLS) needs tls_cert_file/tls_key_file")
        return self

    @field_validator("version_policy")
    @classmethod
    def _version_policy(cls, v: str) -> str:
        try:
            return str(VersionPolicy.parse(v))
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None

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


def is_shared_url(url: str) -> bool:
    """A store/registry URL several processes can share (redis://, rediss://, unix://)."""
    return url.split("://", 1)[0].lower() in ("redis", "rediss", "unix")


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
