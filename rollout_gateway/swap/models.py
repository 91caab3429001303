"""Hot-swap requests and results."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_gateway.core.swap_mode import SwapMode


class DiskSource(BaseModel):
    """A checkpoint directory every engine can read (shared storage)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["disk"] = "disk"
    path: str = Field(min_length=1, max_length=4096, description="Checkpoint directory.")
    load_format: str | None = Field(default=None, max_length=64, description="SGLang load_format.")


class DistributedSource(BaseModel):
    """A torch.distributed group the learner broadcasts the named tensors into (rank 0)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["distributed"] = "distributed"
    master_address: str = Field(min_length=1, description="Rendezvous host (the learner).")
    master_port: int = Field(ge=1, le=65535, description="Rendezvous port.")
    group_name: str = Field(default="weight_update", min_length=1, description="Group name.")
    backend: str = Field(default="nccl", description="nccl (GPU) or gloo (CPU).")
    world_size: int = Field(ge=2, le=65536, description="1 learner rank + all engine ranks.")
    rank_offsets: dict[str, int] | None = Field(
        default=None, description="engine id -> first rank; default 1, 2, ... in pool order.")
    names: list[str] = Field(min_length=1, description="Tensor names, in broadcast order.")
    dtypes: list[str] = Field(min_length=1, description="Their dtypes (e.g. bfloat16).")
    shapes: list[list[int]] = Field(min_length=1, description="Their shapes.")
    init_group: bool = Field(default=True, description="Call /init_weights_update_group first.")

    @model_validator(mode="after")
    def _lengths(self) -> DistributedSource:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class StaleDrop(BaseModel):
    """A refit option: requests in flight whose sample started below a version are broken
    off during the pause, on purpose, instead of resuming on the new weights and being
    thrown away later (by ``admission.max_staleness`` or a learner's ``max_lag``)."""

    model_config = ConfigDict(extra="forbid")
    below_version: int = Field(
        ge=0, le=2**31 - 1, description="A sample whose first token was sampled under a "
        "version below this (or, with no token yet, whose request went to an engine below "
        "it) is stale: its engine request is aborted while the engine is paused.")
    then: Literal["publish", "requeue"] = Field(
        default="publish", description="publish: the sample ends with its output so far "
        "(finish_reason abort, message 'dropped as stale by a refit'; judged and published "
        "like any sample); requeue: its output is discarded and it starts again from the "
        "prompt under the new weights. A stale sample with no output yet is requeued.")


class SwapRequest(BaseModel):
    """``POST /v1/weights``: the learner announces ``version`` with a weight source."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0, le=2**31 - 1, description="New weight version (must increase).")
    source: DiskSource | DistributedSource | None = Field(
        default=None, description="Where the weights are; None only announces the learner's "
        "version (engines keep theirs).")
    mode: SwapMode = Field(default=SwapMode.ABORT_RESUME, description="Interruption mode.")
    rolling: bool = Field(default=False,
                          description="Update engines one at a time while the rest keep serving.")
    engines: list[str] | None = Field(default=None, description="Subset of engines (default all).")
    drop_stale: StaleDrop | None = Field(
        default=None, description="Break off stale requests during the pause (default: none; "
        "every request resumes).")

    @model_validator(mode="after")
    def _rolling_needs_per_engine_source(self) -> SwapRequest:
        if self.rolling and isinstance(self.source, DistributedSource):
            raise ValueError("a distributed source updates every engine in one collective; "
                             "rolling needs a disk source")
        return self
