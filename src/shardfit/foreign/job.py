"""Another tool's training job as shardfit reads it: the model, the workload in the planner's terms, how it is
launched and sharded, and how to say each setting back in that tool's own keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfit import objective as objectives
from shardfit.errors import UserError
from shardfit.plan.deepspeed import ZeroSettings
from shardfit.plan.workload import Workload

TOOLS = ("llamafactory", "swift", "axolotl", "deepspeed", "hf")
TOOL_NAMES = {"llamafactory": "LLaMA-Factory", "swift": "ms-swift", "axolotl": "axolotl", "deepspeed": "DeepSpeed",
              "hf": "the HF Trainer"}

# What a job's engine means in shardfit's strategy table (the plan's row for the same sharding).
ENGINE_STRATEGY = {"single": "single", "ddp": "ddp", "device_map": "model_parallel", "fsdp_full_shard": "zero3",
                   "fsdp_shard_grad_op": "zero2", "fsdp_offload": "zero3_offload"}


@dataclass
class Words:
    """How the job's tool spells each change the planner may suggest, keyed by shardfit concept. A missing
    concept falls back to shardfit's own words."""

    zero: dict[str, str] = field(default_factory=dict)  # zero2 | zero3 | zero3_offload | ... -> the tool's setting
    keys: dict[str, str] = field(default_factory=dict)  # grad_ckpt | micro_batch | seq | qlora | lora | ...

    def say(self, concept: str, default: str) -> str:
        return self.keys.get(concept) or self.zero.get(concept) or default

    def setting(self, concept: str, value: object = None, per_node: int | None = None) -> str | None:
        """The tool's setting for `concept` at `value`: its words with `value` in place of `{}`, or after them
        (`cutoff_len 2048`); the words alone without a value. A launch on `value` nodes of `per_node` GPUs each
        also says `{per_node}` and `{ranks}` (every node's processes together), in words where `per_node` is not
        known. None where the tool has no words for it."""
        said = self.keys.get(concept) or self.zero.get(concept)
        if not said or value is None:
            return said or None
        said = said.replace("{per_node}", str(per_node) if per_node else "<GPUs of a node>").replace(
            "{ranks}", str(value * per_node) if per_node and isinstance(value, int) else
            f"<{value} x the GPUs of a node>")
        return said.format(value) if "{}" in said else f"{said} {value}"


@dataclass(frozen=True)
class ReferenceCopy:
    """The second model a tool loads as the DPO/KTO reference (shardfit never does: docs/preference.md). Set by
    the reader when the tool, as configured, would load one for a method without adapters; the plan counts it
    (asplanned.py `reference_bytes`) as that tool holds it."""

    why: str  # in the tool's words: what makes it load the copy
    with_adapters: bool = False  # loaded even when adapters train (a ref_model of its own, rl_adapter_ref_model)
    bits: int | None = None  # stored quantized (LLaMA-Factory's ref_model_quantization_bit): never sharded
    model: str | None = None  # another checkpoint than the policy's (planned with the policy's shape)


@dataclass
class ForeignJob:
    """A training job of another tool. `engine` is how its ranks share the model: single, ddp, deepspeed (see
    `zero`), fsdp_full_shard, fsdp_shard_grad_op, fsdp_offload, or device_map (one process split over its GPUs)."""

    tool: str
    source: str
    model: str
    workload: Workload
    engine: str = "single"
    zero: ZeroSettings | None = None
    nproc: int | None = None  # ranks per node as launched (None: the launch does not say)
    every_gpu: bool = False  # ... but it starts one rank per GPU the machine shows (read.launch_on counts them)
    gpus: int | None = None  # GPUs one process spans (a device-map job)
    nnodes: int = 1
    shard_ranks: int | None = None  # FSDP shards over groups of this many ranks, replicated across groups (HSDP)
    replicas: int | None = None  # ... or over world/replicas ranks, when only the replica count is given
    launcher: str | None = None
    device_map: str | None = None  # a device map the job loads with ("auto", "balanced", a dict as text)
    speech_outputs: bool = False  # the model's speech modules (an Omni talker) are loaded with it
    quant_storage: bool = False  # 4-bit weights stored in a float dtype (bnb_4bit_quant_storage), as FSDP/ZeRO-3 need
    reentrant_ckpt: bool = False  # gradient checkpointing runs reentrant (torch's old default)
    find_unused: bool = False  # DDP looks for unused parameters (the HF Trainer's default for PEFT models)
    # the job names no attention kernel: transformers' default for its version and model decides (read.py)
    attention_unset: bool = False
    # what was read and modelled: tool key -> value as given; and what was read but is not modelled
    keys: dict[str, str] = field(default_factory=dict)
    not_modelled: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # assumptions made while reading
    words: Words = field(default_factory=Words)
    # shardfit config keys the same job needs (convert), beyond what `workload` and `engine` say
    convert: dict = field(default_factory=dict)
    data: list[str] = field(default_factory=list)
    data_missing: list[str] = field(default_factory=list)  # data the job names that is not a local file here
    # Preference jobs: the reference model the tool keeps beside the policy (None: none, or the adapters switched
    # off, or log-probabilities precomputed); what convert cannot carry (said at the top of the file); and why the
    # job cannot be converted at all (convert exits 2 with it; plan and check still read the job).
    reference: ReferenceCopy | None = None
    not_carried: list[str] = field(default_factory=list)
    unconvertible: str | None = None

    def keeps_reference(self, w: Workload | None = None) -> bool:
        """Whether the tool loads its reference copy for workload `w` (the job's own by default): a DPO/KTO
        objective, and no adapters to switch off unless the copy is loaded with them too."""
        w = w or self.workload
        ref = self.reference
        return ref is not None and objectives.get(w.objective).reference and (
            not w.trains_adapters or ref.with_adapters)

    def shard_group(self, world: int) -> int | None:
        """The ranks FSDP shards the model over on `world` ranks, when fewer than all of them (None: all), as
        accelerate's ParallelismConfig sizes it; a UserError for sizes whose product is not the world, which
        accelerate refuses ("total_size ... does not match num_processes")."""
        if not (self.shard_ranks or self.replicas):
            return None
        replicas = self.replicas or 1
        group = self.shard_ranks or world // replicas
        if group * replicas != world if self.replicas else world % group:
            raise UserError(f"{self.source}: FSDP shard groups of {group} rank(s) x {replicas} replica(s) do not "
                            f"make the {world} ranks planned; accelerate refuses that (ParallelismConfig's total "
                            f"size must equal the number of processes): size dp_shard_size x context_parallel_size "
                            f"x dp_replicate_size to the ranks, or plan on other --gpus/--nproc.")
        return group if group < world else None

    @property
    def distributed(self) -> bool:
        """Launched as several processes (torchrun, deepspeed, accelerate, NPROC_PER_NODE)."""
        return (self.nproc or 1) * self.nnodes > 1

    @property
    def strategy(self) -> str:
        """shardfit's strategy with the same sharding (DeepSpeed ZeRO stages by what they shard)."""
        if self.engine == "deepspeed" and self.zero is not None:
            return self.zero.strategy
        return ENGINE_STRATEGY.get(self.engine, "single")

    def describe_engine(self) -> str:
        """The job's sharding in words, e.g. 'DeepSpeed ZeRO-3 (offload optimizer)'."""
        if self.engine == "deepspeed" and self.zero is not None:
            return self.zero.describe()
        return {"single": "one process, one GPU", "ddp": "DDP (full replica per rank)",
                "device_map": f"one process, device_map={self.device_map or 'auto'} over the node's GPUs",
                "fsdp_full_shard": "FSDP full_shard", "fsdp_shard_grad_op": "FSDP shard_grad_op",
                "fsdp_offload": "FSDP full_shard with CPU offload"}.get(self.engine, self.engine)
