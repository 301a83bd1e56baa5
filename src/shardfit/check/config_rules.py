"""Rules that need only the config (no model, no torch): `train` runs them before it launches ranks or loads
anything, and the preflight reports them with the others."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Sequence

from shardfit import method as methods
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.config.load import NotHere
from shardfit.config.support import TORCHAO_HINT
from shardfit.evals.scorers import check_metrics
from shardfit.models.source import absent_here as model_absent_here
from shardfit.models.source import near_model, resolve_model
from shardfit.plan.cards import card_of, no_fp8_reason
from shardfit.resolve import Resolved
from shardfit.resolve.checkpoint_files import absent_here, named_checkpoint
from shardfit.strategy import Strategy

FLOAT8_OFF = "or float8: false (bf16 matmuls)"


def refuse_missing_inputs(cfg: Config, elsewhere_ok: bool = False) -> None:
    """The files the config names that a rank opens as it starts, refused as the rank refuses them (UserError,
    exit 2, naming the key): a local model path (models/source.py `resolve_model`), the checkpoint a `resume:`
    path names (train/checkpoint.py `find_resume`) and the `py:` scorers of eval_metrics (train/recipe.py
    `parse_metrics`, whose refusals `check_metrics` gives without importing the file: nothing a config names runs
    at check). Before the job is resolved (the planner reads a local model's config.json), so `check` and `train`
    give the same refusal. `elsewhere_ok` (check): a model or `resume:` path with nothing at it on this machine is
    left to `elsewhere_rules`, since the run may train where it is; a path that can be none is refused still."""
    if not (elsewhere_ok and model_absent_here(cfg.model)):
        resolve_model(cfg.model)
    if not (elsewhere_ok and absent_here(cfg.resume)):
        named_checkpoint(cfg.resume, cfg.output_dir)
    check_metrics(cfg.eval_metrics)


ELSEWHERE_FIX = ("run check where the run trains, e.g. `srun -N1 shardfit check CONFIG` on a node that mounts it, "
                 "or correct the path")


def not_here(rule: str, key: str, value: str, unchecked: str, needed: str) -> Finding:
    """A path the config names with nothing at it where `check` runs (a login node that does not mount the
    cluster's storage, or a file a job still queued will write): check cannot read it and says so (a warning: the
    other rules still run), while `train` refuses it (exit 2) if it is not there either when the run starts. One
    rule for every such path: nothing at it on this machine, whatever the machine is."""
    return Finding(rule, "warning", f"config: {key}",
                   f"'{key}': {value} does not exist on {socket.gethostname()}, the machine check ran on, so "
                   f"{unchecked}; train refuses the run (exit 2) unless {needed} on the machine that trains when "
                   "the run starts", ELSEWHERE_FIX)


def elsewhere_rules(cfg: Config, absent_data: Sequence[NotHere] = ()) -> list[Finding]:
    """The paths check could not read on this machine (`not_here`): a `resume:` checkpoint, data files (listed by
    `load_config(absent=...)`), a local model folder or .gguf file."""
    out = []
    if absent_here(cfg.resume):
        out.append(not_here("resume_not_here", "resume", cfg.resume, "the checkpoint was not checked",
                            "the path holds a whole checkpoint"))
    for gone in absent_data:
        found = not_here("data_not_here", gone.key, gone.describe(), "this file was not read (its rows' format, "
                         "bad rows, the chat template and max_seq_len were not checked; the data files that are here "
                         "were)", "the file is there")
        found.message += f".{gone.hint()}" if gone.near else ""
        out.append(found)
    if model_absent_here(cfg.model):
        found = not_here("model_not_here", "model", cfg.model, "the model was not built: the rules that read its "
                         "modules did not run, and the plan, without its shape, resolved the job as for an unknown "
                         "model", "the path holds the model")
        found.message += f".{hint}" if (hint := near_model(cfg.model)) else ""
        out.append(found)
    return out


def device_map_rules(cfg: Config, s: Strategy, world: int) -> list[Finding]:
    """A device map under a distributed launch, or together with ZeRO-3. shardfit never passes it outside
    model_parallel, so it is fixed by ignoring it, unless `strict` makes that an error."""
    if cfg.device_map is None or s.engine == "device_map":
        return []
    out = []
    fixed = not cfg.strict
    strategy = s.name
    if world > 1 or s.multi_rank:
        out.append(Finding(
            "device_map_in_distributed", "error", "config: device_map",
            f"device_map={cfg.device_map!r} splits one process's model over several GPUs; under strategy {strategy} "
            f"each rank needs its own replica or shard, and accelerate refuses to train such a model "
            f"(\"You can't train a model that has been loaded with device_map='auto' in any distributed mode\").",
            "remove device_map (shardfit ignores it under a launcher unless strict: true), or use strategy: "
            "model_parallel in one process", fixed))
    if s.shards_params:
        out.append(Finding(
            "device_map_with_zero3", "error", "config: device_map",
            "a device map places whole layers itself, while ZeRO-3 shards every parameter across ranks; the two "
            "placements conflict (DeepSpeed: 'Zero-3 is not compatible with low_cpu_mem_usage=True or with passing "
            "a device_map').", "remove device_map; zero3 loads on each rank and shards with fully_shard", fixed))
    return out


def qlora_rules(cfg: Config, s: Strategy) -> list[Finding]:
    """QLoRA combinations that cannot train, caught before anything loads: 4-bit weights split over GPUs by a
    device map, and a dequantization dtype that differs from the 16-bit precision the rest of the model computes in
    (bitsandbytes' "fp16 compute dtype with bf16 weights" trap)."""
    method = methods.get(cfg.method)
    if not method.quantized:
        return []
    out = []
    if not method.allows(s.engine):
        out.append(Finding(
            "qlora_split_over_devices", "error", "config: strategy",
            "strategy model_parallel splits the model over GPUs with a device map, but QLoRA's 4-bit weights are "
            "quantized where they are loaded and are not trained split over devices (accelerate refuses the same "
            "for bitsandbytes: \"You can't train a model that has been loaded in 8-bit or 4-bit precision on a "
            "different device than the one you're training on\").",
            "strategy: zero3 with --nproc N (every rank holds 1/N of the 4-bit weights), or single / ddp"))
    compute = cfg.qlora.compute_dtype
    if compute in ("bf16", "fp16") and cfg.precision in ("bf16", "fp16") and compute != cfg.precision:
        risk = "fp16 overflows past 65504 where bf16 does not" if compute == "fp16" else \
            "bf16 keeps 3 fewer mantissa bits than the fp16 run's loss scaling expects"
        out.append(Finding(
            "qlora_compute_dtype_mismatch", "error", "config: qlora.compute_dtype",
            f"the 4-bit weights dequantize to {compute} while the model computes in {cfg.precision}: every matmul "
            f"rounds the weights twice, and {risk}", f"qlora.compute_dtype: auto (= precision {cfg.precision})"))
    return out


def float8_rules(cfg: Config, job: Resolved) -> list[Finding]:
    """`float8: true` where it cannot train: 4-bit weights (torchao's Float8Linear takes a plain nn.Linear), a
    precision other than bf16 (its casts start from and return to bf16), pipeline stages (not carried through the
    stage split), a GPU without FP8 tensor cores (compute capability below 8.9: the card's row in plan/cards.yaml
    has no `fp8` rate), torchao missing; a warning when the blocks run uncompiled on a GPU (the casts then cost
    more than FP8 saves). On a CPU a note: emulated, only a test of the numerics."""
    if not cfg.float8:
        return []
    where = "config: float8"
    out = []
    if methods.get(cfg.method).quantized:
        out.append(Finding(
            "float8_with_4bit_weights", "error", where,
            f"float8: true with method {cfg.method}: FP8 matmuls cast 16-bit weights, but QLoRA stores the decoder's "
            "weights in 4 bits (NF4), which torchao's Float8Linear cannot take",
            f"method: lora (16-bit frozen weights, their matmuls in FP8), {FLOAT8_OFF}"))
    if job.precision != "bf16":
        out.append(Finding(
            "float8_needs_bf16", "error", where,
            f"float8: true with precision {job.precision}: torchao's FP8 training scales from bf16 activations and "
            "returns bf16 outputs; other precisions are not supported", f"precision: bf16, {FLOAT8_OFF}"))
    if job.pipeline_parallel > 1:
        out.append(Finding(
            "float8_with_pipeline", "error", where,
            f"float8: true with {job.pipeline_parallel} pipeline stages: the FP8 conversion is not carried into the "
            "stages' copies of the blocks", f"pipeline_parallel: 1, {FLOAT8_OFF}"))
    if job.device == "cpu":
        out.append(Finding(
            "float8_emulated", "info", where,
            "float8 on a CPU is emulated: the FP8 casts and scales run, the matmuls stay in high precision, so the "
            "run is slower, not faster; FP8 speeds up GPUs of compute capability 8.9+ (sm_89: L4, L40S, RTX 4090, "
            "H100 and newer) only", "float8: false outside tests of the FP8 numerics"))
    else:
        card = card_of(job.hardware)
        name = job.hardware.name or card.key.upper()
        if card.fp8_flops is None and card.assumed is None:
            out.append(Finding(
                "float8_unsupported_gpu", "error", where,
                f"float8: true on {name}: {no_fp8_reason(card.key)}",
                f"train on an Ada, Hopper or Blackwell GPU (L40S, RTX 4090, H100, H200, B200), {FLOAT8_OFF}"))
        elif card.fp8_flops is None:
            out.append(Finding(
                "float8_card_unknown", "warning", where,
                f"float8: true on an unnamed card planned as {card.key.upper()}, which has no FP8 tensor cores: "
                "the run refuses on a GPU of compute capability below 8.9",
                "check names the card with --gpus (e.g. --gpus 8xH100); train checks the device's compute capability "
                "itself when the run starts; " + FLOAT8_OFF))
        elif not job.compile:
            out.append(Finding(
                "float8_uncompiled", "warning", where,
                "float8: true with the decoder blocks uncompiled: torchao's casts to FP8 then run as separate "
                "kernels (about 33 bytes moved per element instead of 5 fused), which costs more than the FP8 "
                "matmuls save: the plan predicts it slower than bf16 (shardfit plan --float8 without --compile)",
                # sequence parallelism compiles nothing (resolve/sequence.py refuses compile: true)
                FLOAT8_OFF.removeprefix("or ") if job.sequence_parallel > 1 else
                f"compile: true with packing off or static_shape: true (one input shape for the compiled blocks; "
                f"packed rows compiled without it are padded to micro_batch x max_seq_len), {FLOAT8_OFF}"))
    if importlib.util.find_spec("torchao") is None:
        out.append(Finding("float8_needs_torchao", "error", where,
                           "float8: true needs torchao for its FP8 linear layers, and it is not installed",
                           f"{TORCHAO_HINT}, {FLOAT8_OFF}"))
    return out
