"""`expert_parallel: N`: what this increment runs, decided once before the launch (and again on the built model,
whose config is the ground truth where the planner did not know the shape). Torch-free.

What runs: a mixture-of-experts text decoder whose routed experts transformers 5 fuses into one `experts` module
per block (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5, ...), full fine-tune or LoRA on the attention and
shared experts, under DDP or FSDP2 (zero2, zero3) over the data-parallel ranks with the experts left out of it (their
gradients averaged over the ranks holding the same share). Everything else is refused with exit 2 and the reason.
"""

from __future__ import annotations

from typing import Any

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.plan.media import has_tower
from shardfit.resolve.dims import ParallelDims

FIX = "or set expert_parallel: 1"
# The strategies the non-expert weights run under; the experts stay whole on their ranks, outside DDP or FSDP2.
EP_STRATEGIES = ("ddp", "zero2", "zero3")


def _prefix(n: int) -> str:
    return f"expert_parallel: {n}"


def check_ep_layout(cfg: Config, strategy: str, world: int) -> None:
    """The config's expert_parallel against the job's ranks, strategy and settings (UserError when refused)."""
    n = cfg.expert_parallel
    if n == 1:
        return
    if not strategies.get(strategy).multi_rank:
        raise UserError(f"{_prefix(n)} shares each block's experts over {n} ranks and runs under a multi-rank "
                        f"strategy (ddp, zero2, zero3), not {strategy}: launch {n} or more ranks (--nproc {n}), "
                        f"{FIX}.")
    ParallelDims(world=world, sp=cfg.sequence_parallel, ep=n).check()
    if strategy not in EP_STRATEGIES:
        raise UserError(f"{_prefix(n)} runs under strategy ddp, zero2 or zero3 in this version, not {strategy} "
                        f"(its host-memory shards are untested with the experts kept on each rank): use "
                        f"--set strategy=zero3, {FIX}.")
    if cfg.sequence_parallel > 1:
        raise UserError(f"{_prefix(n)} with sequence_parallel: {cfg.sequence_parallel}: this version does "
                        f"not combine the two (the tokens a rank sends to the experts' ranks would be its slice's, "
                        f"untested here); set sequence_parallel: 1, {FIX}.")
    check_ep_method(n, cfg.method)
    check_ep_objective(n, cfg.objective)
    if cfg.compile is True:
        raise UserError(f"{_prefix(n)} does not run compiled blocks (the token exchange has data-dependent "
                        f"sizes, which break the compiled graph): set compile: false (or auto), {FIX}.")
    if cfg.eval_metrics:
        raise UserError(f"{_prefix(n)} does not generate for eval_metrics in this version (each rank generates "
                        f"its own answers, a different number of forwards, while every forward needs all ranks of "
                        f"the expert group): drop eval_metrics, {FIX}.")


def check_ep_objective(n: int, objective: str) -> None:
    """The objective against expert_parallel `n` (UserError when refused): what `plan` checks too."""
    if n > 1 and objectives.get(objective).preference:
        raise UserError(f"{_prefix(n)} trains objective sft only in this version: use objective: sft, {FIX}.")


def check_ep_method(n: int, name: str) -> None:
    """The method `name` against expert_parallel `n` (UserError when refused): what `plan` checks too, whose
    per-rank bytes of the experts assume their bf16 storage."""
    if n == 1:
        return
    method = methods.get(name)
    if method.quantized:
        raise UserError(f"{_prefix(n)} does not train {method.name} in this version (the experts' 4-bit weights "
                        f"are not sliced per rank): use method: lora or full, {FIX}.")
    if not method.adapters and not method.trains_base:
        raise UserError(f"{_prefix(n)} trains method lora or full in this version, not {method.name}: {FIX}.")


def check_ep_model(n: int, experts: int, model: str, *, every_expert: bool = False,
                   multimodal: bool = False) -> None:
    """The model's routed experts per block (`experts`; 1 or 0: a dense model) against expert_parallel `n`."""
    if n == 1:
        return
    if experts <= 1:
        raise UserError(f"{_prefix(n)}: {model} is a dense model (no routed experts to share out): set "
                        "expert_parallel: 1.")
    if every_expert:
        raise UserError(f"{_prefix(n)}: {model} runs every token through every expert (Llama 4's experts), which "
                        f"expert parallelism would turn into sending every token everywhere: {FIX}.")
    if multimodal:
        raise UserError(f"{_prefix(n)}: {model} has a vision or audio tower; this version shares out the experts "
                        f"of text decoders only: {FIX}.")
    if n > experts or experts % n:
        fits = [d for d in range(2, experts + 1) if experts % d == 0]
        raise UserError(f"{_prefix(n)}: {model} has {experts} routed experts per block, which {n} ranks cannot "
                        f"share out evenly (each holds experts/{n}): use an expert_parallel that divides {experts} "
                        f"({', '.join(map(str, fits[:8]))}), {FIX}.")


def check_ep_config(n: int, config: Any, model: str) -> None:
    """A built model's (transformers) config against expert_parallel `n`: the ground truth where the planner did
    not know the shape."""
    if n == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = max(int(getattr(text, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    check_ep_model(n, experts, model, every_expert=str(getattr(text, "model_type", "")).startswith("llama4"),
                   multimodal=has_tower(config))
