"""Rules that need only the config (no model, no torch): `train` runs them before it launches ranks or loads
anything, and the preflight reports them with the others."""

from __future__ import annotations

from shardfit import method as methods
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.strategy import Strategy


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
