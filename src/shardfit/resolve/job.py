"""The resolved job: frozen dataclasses, with JSON only at the edge (the ranks' environment, summary.json)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from shardfit.plan.hardware import Hardware
from shardfit.resolve.dims import ParallelDims

# The environment variable through which `train` hands the resolved job to the ranks it launches.
ENV = "SHARDFIT_RESOLVED"


@dataclass(frozen=True)
class DeviceFacts:
    """What the precision rule needs to know of the device that trains: its type and whether 16-bit brain floats
    are fast on it (measured by parallel/env.py; for planned GPUs, assumed)."""

    type: str  # cuda | cpu
    bf16_fast: bool


@dataclass(frozen=True)
class RowShape:
    """How micro-batches become tensors, for training and evaluation alike: rows are right-padded to the longest
    (or to `width`), empty rows added up to `height`, the width rounded up to a multiple of `multiple`, never past
    `limit`."""

    limit: int
    micro_batch: int
    width: int | None = None
    height: int | None = None
    multiple: int = 1


@dataclass(frozen=True)
class Resolved:
    """One job, decided: every rank of it reads this object, and nothing here is `auto`."""

    strategy: str
    method: str
    nproc_per_node: int
    nnodes: int
    device: str  # cuda | cpu
    precision: str  # bf16 | fp16 | fp32
    autocast: str | None  # the dtype torch.autocast computes in, or None (fp32, FSDP2 casts the parameters, or
    # bf16 adapters)
    compile: bool
    attention: str  # the attention implementation the model is set to (`auto`: transformers' default)
    eager_max_width: int  # under `auto`: micro-batches at most this wide run eager attention (0: never)
    rows: RowShape
    loss_chunk: int | None  # rows per chunk of the loss; None: decided from the built model's vocabulary
    hardware: Hardware
    why: tuple[str, ...] = ()  # for each setting that was `auto` (or changed), what decided it
    objective: str = "sft"  # objective.py's row
    reference: str | None = None  # a preference run's reference: precomputed | adapters_off | None (none needed)
    # How a mixture of experts' routed experts compute (transformers' experts_implementation); dense models ignore it
    experts: str = "grouped_mm"
    # Ranks that split every row (sequence parallelism); the data is split over world / sequence_parallel groups.
    sequence_parallel: int = 1
    # Every training micro-batch one row of micro_batch x max_seq_len tokens (resolve/defaults.py
    # `resolve_static_shape`; data/static_shape.py).
    static_shape: bool = False
    # Ranks that share each mixture-of-experts block's routed experts (parallel/experts.py), out of the data ranks.
    expert_parallel: int = 1
    # Pipeline stages the decoder blocks are cut into (parallel/pipeline.py); 1: none.
    pipeline_parallel: int = 1
    # The decoder blocks of each stage, first to last, as the plan balances their memory (plan/pipeline.py
    # `stage_cut`); empty: an even cut (no pipeline, or a shape the planner could not read).
    stage_layers: tuple[int, ...] = ()
    # The dtype LoRA's adapters are stored and computed in (`lora.dtype`, resolve/decide.py `adapter_dtype_for`):
    # bf16 runs without autocast, the optimizer keeping fp32 master copies (train/optim.py).
    adapter_dtype: str = "fp32"
    # The pipeline's schedule (`pipeline_schedule`): the config's, or 1f1b where `pipeline_parallel: auto` turned
    # the pipeline on (the schedule the plan ranks).
    pipeline_schedule: str = "1f1b"
    # The job the run directory recorded, kept so that a run that resumes trains its global batch (resolve/resume.py
    # `resumed_job`); False: resolved anew from the config.
    kept_as_recorded: bool = False

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def dims(self) -> ParallelDims:
        """How the ranks divide (resolve/dims.py): every rank reads the same answer."""
        return ParallelDims(world=self.world, pp=self.pipeline_parallel, sp=self.sequence_parallel,
                            ep=self.expert_parallel)

    def describe(self) -> str:
        """One line: the job as it will run (check prints it, train logs it before it launches the ranks)."""
        ranks = f"{self.nproc_per_node} process{'es' if self.nproc_per_node > 1 else ''}" + (
            f" x {self.nnodes} nodes, {self.world} ranks" if self.nnodes > 1 else "")
        chunk = f", loss chunk {self.loss_chunk} rows" if self.loss_chunk else ""
        ref = f" (reference: {self.reference.replace('_', ' ')})" if self.reference else ""
        objective = f"objective {self.objective}{ref}, " if self.objective != "sft" else ""
        adapters = f" ({self.adapter_dtype} adapters, no autocast)" if self.adapter_dtype != "fp32" else ""
        if not self.dims.trivial:
            ranks += f" ({self.dims.describe()})"
        return (f"job: {objective}strategy {self.strategy}, method {self.method}, {ranks} on {self.device}, "
                f"{self.precision}{' (autocast)' if self.autocast else ''}{adapters}, "
                f"compile {'on' if self.compile else 'off'}, attention {self.attention}{chunk}, micro-batch "
                f"{self.rows.micro_batch}")

    def decisions(self) -> dict[str, Any]:
        """What was decided, without the CPU's matmul rates (a measurement each node makes for itself)."""
        out = {k: v for k, v in self.to_json().items() if k not in ("hardware", "why")}
        hw = self.hardware
        return {**out, "hardware": (hw.nodes, hw.gpus_per_node, round(hw.gpu_mem_gib, 1), hw.name)}

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["why"] = list(self.why)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Resolved:
        d = dict(d)
        d["rows"] = RowShape(**d["rows"])
        d["hardware"] = Hardware(**d["hardware"])
        d["why"] = tuple(d.get("why", ()))
        d["stage_layers"] = tuple(d.get("stage_layers", ()))
        return cls(**d)

    def to_env(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_env(cls, value: str) -> Resolved:
        return cls.from_json(json.loads(value))
