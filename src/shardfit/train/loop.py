"""The training recipe, top to bottom: config -> data -> model -> strategy -> loop -> outputs.

One function, `train`, readable in order. The distributed parts (process group, wrapping, checkpoint shards)
come from `shardfit.parallel` and `train.checkpoint`; with world size 1 they reduce to plain PyTorch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from shardfit.check.findings import is_ok
from shardfit.check.rules import old_gc_api, placement_rules, quantized_placement_rules
from shardfit.check.run import preflight
from shardfit.config import Config
from shardfit.data.dataset import build_datasets
from shardfit.data.loader import Schedule, collate
from shardfit.data.packing import PackedRow, no_pack, pack
from shardfit.errors import UserError
from shardfit.models.adapters import setup_trainable
from shardfit.models.checkpointing import enable_hf_checkpointing, selective_context
from shardfit.models.load import load_for_training, require_method_support
from shardfit.models.placement import input_device
from shardfit.parallel.env import DistEnv, barrier
from shardfit.parallel.wrap import SHARDED, set_grad_sync, transformer_blocks, wrap_model
from shardfit.plan.choose import auto_strategy, plan_for_run, refuse_if_oom
from shardfit.train import checkpoint as ckpt
from shardfit.train.compile import compile_blocks, require_compiler
from shardfit.train.export import save_final
from shardfit.train.loss import CausalLMLoss
from shardfit.train.metrics import MetricsLog, gather_floats, peak_mem_gib, progress, truncate_after
from shardfit.train.optim import build_optimizer, cosine_with_warmup

log = logging.getLogger("shardfit")

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What a finished run leaves in memory (the files are in `run_dir`)."""

    run_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    summary: dict[str, Any]


def resolve_strategy(cfg: Config, env: DistEnv, plan: dict[str, Any] | None = None) -> str:
    """The strategy actually used. `auto` asks the planner; a multi-rank strategy in one process runs as single."""
    strategy = cfg.strategy
    if strategy == "auto":
        strategy = auto_strategy(cfg, env, plan)
    if strategy == "model_parallel" and env.distributed:
        raise UserError("'strategy': model_parallel splits one process's model over its local GPUs and cannot run "
                        "under a multi-rank launch. Use zero3 (sharded) with --nproc, or model_parallel without it.")
    if strategy not in ("single", "model_parallel") and not env.distributed:
        if strategy != "ddp":
            log.warning("strategy %s needs several ranks; one process runs it as 'single' (use --nproc N)", strategy)
        strategy = "single"
    return strategy


def check_device_map(cfg: Config, strategy: str) -> None:
    """A user `device_map` never reaches from_pretrained outside model_parallel: warn, or refuse when strict."""
    if cfg.device_map is None or strategy == "model_parallel":
        return
    why = (f"'device_map: {cfg.device_map}' splits one process's model over several GPUs (an inference feature); "
           f"under strategy {strategy} every rank must hold its own replica or shard, so shardfit loads without it")
    if cfg.strict:
        raise UserError(f"{why}. Remove device_map, or use strategy: model_parallel in one process.")
    log.warning("%s (ignored; set strict: true to make this an error).", why)


def _autocast(cfg: Config, env: DistEnv, strategy: str) -> Any:
    dtype = AUTOCAST.get(cfg.precision)
    if dtype is None or strategy in SHARDED:  # FSDP2's MixedPrecisionPolicy already computes in low precision
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=dtype)


def enable_checkpointing(model: torch.nn.Module, selective: bool = False) -> None:
    """Non-reentrant activation checkpointing of every decoder block, full or `selective`.

    transformers' own switch is used when the model supports it; remote code that still implements the pre-4.35
    `_set_gradient_checkpointing(module, value)` gets torch's checkpoint wrapper around its blocks instead."""
    if not old_gc_api(model):
        enable_hf_checkpointing(model, selective)
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = set(map(id, transformer_blocks(model)))
    # The wrapper is non-reentrant by default and sets use_reentrant itself: only the policy is passed on.
    wrapper = functools.partial(checkpoint_wrapper, context_fn=selective_context) if selective else checkpoint_wrapper
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in blocks)


def _report(findings: list, env: DistEnv) -> None:
    """Log what the preflight fixed or warns about; refuse to start on an error it could not fix."""
    for f in findings:
        if env.is_main and f.severity != "info":
            log.warning("%s: %s (%s)%s", f.rule, f.message, f.fix, " [fixed]" if f.auto_fixed else "")
    if not is_ok(findings):
        bad = [f for f in findings if f.severity == "error" and not f.auto_fixed]
        raise UserError("preflight found errors it cannot fix:\n" + "\n".join(
            f"  {f.rule} at {f.where}: {f.message}\n    fix: {f.fix}" for f in bad))


def _rows(examples: list, cfg: Config) -> list[PackedRow]:
    return pack(examples, cfg.max_seq_len) if cfg.packing else no_pack(examples)


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: list[PackedRow], micro_batch: int, pad_id: int, env: DistEnv,
             amp: Any, device: torch.device | None = None, width: int | None = None) -> float | None:
    """Mean token loss over `rows`; every rank runs the same number of forwards (FSDP needs that)."""
    if not rows:
        return None
    model.eval()
    batches = [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]
    per_rank = math.ceil(len(batches) / env.world)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for k in range(per_rank):
        idx = k * env.world + env.rank
        real = idx < len(batches)
        batch = collate(batches[idx if real else 0], pad_id, width).to(device or env.device)
        with amp:
            loss_sum, n = model(batch.input_ids, batch.position_ids, batch.targets)
        if real:
            total += torch.tensor([float(loss_sum), n], dtype=torch.float64, device=env.device)
    if env.distributed:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / max(total[1], 1))


def _write_run_files(run_dir: Path, cfg: Config, plan: dict[str, Any] | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))


def train(cfg: Config, env: DistEnv, model: torch.nn.Module | None = None, tokenizer: Any = None,
          plan: dict[str, Any] | None = None, quiet: bool = False) -> TrainResult:
    """Run a fine-tune described by `cfg` on this process's share of the work; returns the trained model."""
    t_start = time.perf_counter()
    require_method_support(cfg)
    if cfg.compile:
        require_compiler(env.device)
    run_dir = Path(cfg.output_dir)
    torch.manual_seed(cfg.seed)
    plan = plan if plan is not None else plan_for_run(cfg, env)
    strategy = resolve_strategy(cfg, env, plan)
    check_device_map(cfg, strategy)
    refuse_if_oom(plan, strategy, cfg.force)

    # Data first: a bad row should fail in seconds, before a long model load.
    if model is None or tokenizer is None:
        model, tokenizer = load_for_training(cfg, strategy)
    train_ex, eval_ex, stats = build_datasets(cfg, tokenizer)
    rows, eval_rows = _rows(train_ex, cfg), _rows(eval_ex, cfg)
    pad_id = tokenizer.pad_token_id

    model = setup_trainable(model, cfg)
    findings = preflight(model, cfg, strategy, env.world, None, fix=True)
    quantized = quantized_placement_rules(model, env.device, env.world)
    _report(quantized, env)  # before anything below tries to move weights that cannot move
    if cfg.grad_ckpt != "none":
        enable_checkpointing(model, selective=cfg.grad_ckpt == "selective")
    if cfg.compile:
        compile_blocks(model)  # after checkpointing and before FSDP2, as torchtitan orders them
    width = cfg.max_seq_len if cfg.compile else None
    module = CausalLMLoss(model, cfg.loss_chunk)
    wrapped = wrap_model(module, strategy, env, cfg.precision)
    if strategy not in ("model_parallel", "zero3_offload"):
        findings += placement_rules(module, env.device, fix=True)
    _report(findings, env)
    in_device = input_device(module) if strategy == "model_parallel" else env.device
    params = [p for p in wrapped.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params) * (env.world if strategy in SHARDED else 1)
    optimizer = build_optimizer(params, cfg.lr, cfg.weight_decay)

    schedule = Schedule(rows, cfg.micro_batch, cfg.grad_accum, env.world, env.rank, cfg.seed)
    total_steps = cfg.max_steps or cfg.epochs * schedule.steps_per_epoch
    scheduler = cosine_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)

    start_step, tokens = 0, 0
    ckpt.require_shared_dir(run_dir, env)
    resume_from = ckpt.find_resume(run_dir, cfg.resume)
    if resume_from is not None:
        r = ckpt.load_checkpoint(resume_from, wrapped, optimizer, scheduler, env)
        start_step, tokens = r.step, r.tokens
        if env.is_main:
            truncate_after(run_dir / "metrics.jsonl", start_step)
            log.info("resumed from %s (step %d)", resume_from, start_step)
    elif env.is_main and (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    if env.is_main:
        _write_run_files(run_dir, cfg, plan)
        if not quiet:
            print(f"shardfit: {len(train_ex)} examples -> {len(rows)} rows of <= {cfg.max_seq_len} tokens "
                  f"({'packed' if cfg.packing else 'unpacked'}), {len(eval_ex)} eval; strategy {strategy} on "
                  f"{env.world} x {env.device.type}; {n_trainable:,} trainable params; {total_steps} steps"
                  + (f"; skipped {stats.skipped} bad rows" if stats.skipped else ""))
    barrier(env)

    amp = _autocast(cfg, env, strategy)
    metrics = MetricsLog(run_dir, env)
    bar = progress(total_steps, start_step, env.is_main and not quiet)
    window_loss = torch.zeros((), dtype=torch.float64, device=env.device)
    window_steps, window_tokens, window_t0 = 0, 0, time.perf_counter()
    eval_loss = None
    losses: list[float] = []
    wrapped.train()
    for step in range(start_step, total_steps):
        plan_step = schedule.step(step)
        # Normalise by the global batch's target count: the same loss at any world size and accumulation.
        scale = env.world / max(plan_step.global_targets, 1)
        for m, micro in enumerate(plan_step.micro_batches):
            last = m == len(plan_step.micro_batches) - 1
            batch = collate(micro, pad_id, width).to(in_device)
            with set_grad_sync(wrapped, last), amp:
                loss_sum, _ = wrapped(batch.input_ids, batch.position_ids, batch.targets)
            (loss_sum * scale).backward()
            window_loss += loss_sum.detach().double() / max(plan_step.global_targets, 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += plan_step.global_tokens
        window_steps += 1
        window_tokens += plan_step.global_tokens
        done = step + 1
        bar.update(1)

        if done % cfg.log_steps == 0 or done == total_steps:
            if env.distributed:
                dist.all_reduce(window_loss)
            loss = float(window_loss) / window_steps
            losses.append(loss)
            elapsed = time.perf_counter() - window_t0
            tps = window_tokens / max(elapsed, 1e-9)
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            record = {"step": done, "epoch": round(schedule.epoch_of(done), 4), "loss": round(loss, 6),
                      "lr": scheduler.get_last_lr()[0], "grad_norm": round(float(gn), 6), "tokens": tokens,
                      "tokens_per_s": round(tps, 2),
                      "mem_gib": [round(x, 4) for x in gather_floats(peak_mem_gib(env.device), env)],
                      "wall_s": round(time.perf_counter() - t_start, 3)}
            metrics.write(record)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:.0f}")
            window_loss.zero_()
            window_steps, window_tokens, window_t0 = 0, 0, time.perf_counter()
        if eval_rows and (done % cfg.eval_steps == 0 and done != total_steps):
            eval_loss = evaluate(wrapped, eval_rows, cfg.micro_batch, pad_id, env, amp, in_device, width)
            metrics.write({"step": done, "eval_loss": eval_loss})
        if done % cfg.save_steps == 0 and done != total_steps:
            ckpt.save_checkpoint(run_dir, done, tokens, wrapped, optimizer, scheduler, env, cfg.save_limit)
    bar.close()

    if eval_rows:
        eval_loss = evaluate(wrapped, eval_rows, cfg.micro_batch, pad_id, env, amp, in_device, width)
        metrics.write({"step": total_steps, "eval_loss": eval_loss})
    ckpt.save_checkpoint(run_dir, total_steps, tokens, wrapped, optimizer, scheduler, env, cfg.save_limit)
    is_lora = cfg.method in ("lora", "qlora")
    save_final(wrapped, model, tokenizer, run_dir, env, is_lora)
    wall = time.perf_counter() - t_start
    peaks = gather_floats(peak_mem_gib(env.device), env)
    summary = {"steps": total_steps, "train_loss": losses[-1] if losses else None, "eval_loss": eval_loss,
               "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None, "peak_mem_gib": peaks,
               "wall_s": round(wall, 3), "strategy": strategy, "world_size": env.world,
               "resumed_from_step": start_step or None, "trainable_params": n_trainable, "tokens": tokens,
               "skipped_rows": stats.skipped}
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics.close()
    barrier(env)
    return TrainResult(run_dir, model, tokenizer, summary)
