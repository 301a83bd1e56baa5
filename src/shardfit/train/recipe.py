"""The fine-tuning recipe: `setup` (plan, data, model, preflight, parallelize, optimizer, resume) -> `fit` (the
loop) -> `finish` (final evaluation, checkpoint, adapter or model, summary).

The loop is one optimizer step per iteration; the components (`StepLogger`, `Evaluator`, `Checkpointer`) decide
their own cadence. With world size 1 the distributed parts reduce to plain PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from shardfit.check.findings import Finding, is_ok
from shardfit.check.rules import device_map_rules, placement_rules, quantized_placement_rules
from shardfit.check.run import preflight
from shardfit.config import Config
from shardfit.data.dataset import DataStats, build_datasets, split_conversations
from shardfit.data.loader import BatchSchedule, StepRows, collate
from shardfit.data.packing import PackedRow, no_pack, pack
from shardfit.errors import UserError
from shardfit.evals.scorers import parse_metrics
from shardfit.infer.generate import Sampling
from shardfit.infer.prompts import requests_from_conversations
from shardfit.models.anatomy import input_device
from shardfit.models.build import build_model, load_tokenizer, require_method_support
from shardfit.models.source import resolve_model
from shardfit.parallel.compile import require_compiler
from shardfit.parallel.env import DistEnv, barrier, cpu_matmul_gflops, fast_cpu_bf16, resolve_precision
from shardfit.parallel.parallelize import parallelize, set_grad_sync
from shardfit.plan.choose import auto_strategy, plan_for_config, refuse_if_oom
from shardfit.plan.hardware import job_hardware
from shardfit.plan.plan import Plan
from shardfit.strategy import Strategy
from shardfit.strategy import get as get_strategy
from shardfit.train.checkpoint import Checkpointer
from shardfit.train.evaluate import Evaluator, GenerationEval
from shardfit.train.export import save_final
from shardfit.train.loss import CausalLMLoss
from shardfit.train.metrics import SAMPLES_FILE, MetricsLog, StepLogger, gather_floats, peak_mem_gib, truncate_after
from shardfit.train.optim import build_optimizer, cosine_with_warmup
from shardfit.train.trackers import open_trackers, resolve_report_to

log = logging.getLogger("shardfit")

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    """What a finished run leaves in memory (the files are in `run_dir`)."""

    run_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    summary: dict[str, Any]


def resolve_strategy(cfg: Config, env: DistEnv, plan: Plan | None) -> Strategy:
    """The strategy actually used. `auto` asks the planner; a multi-rank strategy in one process runs as single."""
    name = auto_strategy(plan, env.world) if cfg.strategy == "auto" else cfg.strategy
    s = get_strategy(name)
    if s.engine == "device_map" and env.distributed:
        raise UserError("'strategy': model_parallel splits one process's model over its local GPUs and cannot run "
                        "under a multi-rank launch. Use zero3 (sharded) with --nproc, or model_parallel without it.")
    if s.multi_rank and not env.distributed:
        if s.sharded:
            log.warning("strategy %s needs several ranks; one process runs it as 'single' (use --nproc N)", name)
        s = get_strategy("single")
    return s


def report_findings(findings: list[Finding], env: DistEnv) -> None:
    """Log what the preflight fixed or warns about; refuse to start on an error it could not fix."""
    for f in findings:
        if env.is_main and f.severity != "info":
            log.warning("%s: %s (%s)%s", f.rule, f.message, f.fix, " [fixed]" if f.auto_fixed else "")
    refuse_unfixable(findings)


def refuse_unfixable(findings: list[Finding]) -> None:
    """A UserError listing the errors the preflight could not fix, if any."""
    if not is_ok(findings):
        bad = [f for f in findings if f.severity == "error" and not f.auto_fixed]
        raise UserError("preflight found errors it cannot fix:\n" + "\n".join(
            f"  {f.rule} at {f.where}: {f.message}\n    fix: {f.fix}" for f in bad))


def rows_of(examples: list, cfg: Config) -> list[PackedRow]:
    """Training rows: packed several examples to a row, or one example per row."""
    return pack(examples, cfg.max_seq_len) if cfg.packing else no_pack(examples)


class FineTune:
    """One fine-tune of `cfg` on this process's share of the work. `model`/`tokenizer`, when given, are the
    config's model as `build_model` made it (the demo evaluates the base model before training)."""

    def __init__(self, cfg: Config, env: DistEnv, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 plan: Plan | None = None, quiet: bool = False):
        self.cfg, self.env, self.model, self.tokenizer, self.plan, self.quiet = cfg, env, model, tokenizer, plan, quiet
        self.run_dir = Path(cfg.output_dir)
        self.t_start = time.perf_counter()

    # -- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        env = self.env
        self.cfg = cfg = dataclasses.replace(self.cfg, precision=resolve_precision(self.cfg.precision,
                                                                                  env.device.type))
        if cfg.precision == "bf16" and env.device.type == "cpu" and env.is_main and not fast_cpu_bf16():
            log.warning("precision bf16 on this CPU: its bf16 matmuls run at %.1f GFLOP/s against %.1f for fp32; "
                        "precision: fp32 (or auto) trains several times faster here",
                        cpu_matmul_gflops(torch.bfloat16), cpu_matmul_gflops(torch.float32))
        require_method_support(cfg)
        resolve_report_to(cfg.report_to)  # a tracker that is not installed stops the run now, not after the load
        if cfg.compile:
            require_compiler(env.device)
        torch.manual_seed(cfg.seed)
        if self.plan is None:
            self.plan = plan_for_config(cfg, job_hardware(env.device.type, env.world))
        self.strategy = resolve_strategy(cfg, env, self.plan)
        refuse_if_oom(self.plan, self.strategy.name, cfg.force)
        # Stop on a config the preflight will refuse before loading anything (the preflight reports it later).
        refuse_unfixable(device_map_rules(cfg, self.strategy, env.world))
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self._resume()
        self._write_run_files()
        barrier(env)

    def _setup_data(self) -> None:
        """Data before the model: a bad row stops the run in seconds, before a long model load."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(resolve_model(self.cfg.model), self.cfg.trust_remote_code)
        stats = DataStats()
        train_conv, eval_conv = split_conversations(self.cfg, stats)
        train_ex, eval_ex, self.data_stats = build_datasets(self.cfg, self.tokenizer, (train_conv, eval_conv), stats)
        self.scorers = parse_metrics(self.cfg.eval_metrics)  # a bad py: scorer stops the run before the model loads
        self.eval_requests = requests_from_conversations(eval_conv, self.cfg.eval_samples) if self.scorers else []
        if self.scorers and not self.eval_requests and self.env.is_main:
            log.warning("eval_metrics %s: no held-out data to generate for; set eval_data or eval_split",
                        self.cfg.eval_metrics)
        if self.eval_requests and self.cfg.compile and self.env.is_main:
            log.warning("eval_metrics with compile: true: generation runs through the compiled blocks, which are "
                        "compiled for one shape and recompile for others (slow evaluations); compile: false avoids it")
        self.n_examples, self.n_eval = len(train_ex), len(eval_ex)
        self.rows, self.eval_rows = rows_of(train_ex, self.cfg), rows_of(eval_ex, self.cfg)
        self.pad_id = self.tokenizer.pad_token_id

    def _setup_model(self) -> None:
        """Build, preflight (fixes applied), then parallelize: checkpointing, compiled blocks, DDP or FSDP2."""
        cfg, env, s = self.cfg, self.env, self.strategy
        if self.model is None:
            self.model = build_model(cfg, s, weights=True)
        findings = preflight(self.model, cfg, s, env.world, self.plan)
        quantized = quantized_placement_rules(self.model, env.device, env.world)
        report_findings(quantized, env)  # before anything below tries to move weights that cannot move
        loss_module = CausalLMLoss(self.model, cfg.loss_chunk)
        self.loss_module = parallelize(loss_module, s, device=env.device, world=env.world, precision=cfg.precision,
                                       grad_ckpt=cfg.grad_ckpt, compile=cfg.compile)
        if s.engine != "device_map" and not s.offload:
            findings += placement_rules(loss_module, env.device, fix=True)
        self.findings = quantized + findings
        report_findings(findings, env)
        self.in_device = input_device(self.model) if s.engine == "device_map" else env.device
        self.width = cfg.max_seq_len if cfg.compile else None  # compiled blocks want one static shape
        dtype = AUTOCAST.get(cfg.precision)
        # FSDP2's MixedPrecisionPolicy already computes in low precision; the other engines use autocast.
        self.amp = torch.autocast(env.device.type, dtype=dtype) if dtype is not None and s.autocast \
            else contextlib.nullcontext()

    def _setup_optimizer(self) -> None:
        cfg, env = self.cfg, self.env
        self.params = [p for p in self.loss_module.parameters() if p.requires_grad]
        # Sharded parameters are a 1/world slice on each rank: count the whole.
        self.n_trainable = sum(p.numel() for p in self.params) * (env.world if self.strategy.sharded else 1)
        self.optimizer = build_optimizer(self.params, cfg.lr, cfg.weight_decay)
        self.batches = BatchSchedule(self.rows, cfg.micro_batch, cfg.grad_accum, env.world, env.rank, cfg.seed)
        self.total_steps = cfg.max_steps or cfg.epochs * self.batches.steps_per_epoch
        self.lr_schedule = cosine_with_warmup(self.optimizer, int(cfg.warmup_ratio * self.total_steps),
                                              self.total_steps)

    def _resume(self) -> None:
        cfg, env = self.cfg, self.env
        self.checkpointer = Checkpointer(self.run_dir, env, every=cfg.save_steps, keep=cfg.save_limit,
                                         total_steps=self.total_steps)
        resumed = self.checkpointer.resume(cfg.resume, self.loss_module, self.optimizer, self.lr_schedule)
        self.start_step, self.tokens = (resumed.step, resumed.tokens) if resumed else (0, 0)
        logs = [self.run_dir / "metrics.jsonl", self.run_dir / SAMPLES_FILE]
        if env.is_main and resumed is not None:
            for f in logs:
                truncate_after(f, self.start_step)
            log.info("resumed from %s (step %d)", resumed.path, self.start_step)
        elif env.is_main:
            for f in logs:
                f.unlink(missing_ok=True)

    def _write_run_files(self) -> None:
        if not self.env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        if self.plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(self.plan.to_json(), indent=2))
        (self.run_dir / "preflight.json").write_text(json.dumps(
            {"strategy": self.strategy.name, "ok": is_ok(self.findings),
             "findings": [f.to_json() for f in self.findings]}, indent=2))
        if not self.quiet:
            cfg, stats = self.cfg, self.data_stats
            print(f"shardfit: {self.n_examples} examples -> {len(self.rows)} rows of <= {cfg.max_seq_len} tokens "
                  f"({'packed' if cfg.packing else 'unpacked'}), {self.n_eval} eval; strategy {self.strategy.name} "
                  f"on {self.env.world} x {self.env.device.type}; {self.n_trainable:,} trainable params; "
                  f"{self.total_steps} steps" + (f"; skipped {stats.skipped} bad rows" if stats.skipped else ""))

    # -- fit -----------------------------------------------------------------------------------------------------
    def fit(self) -> None:
        """One optimizer step per iteration; logging, evaluation and checkpoints keep their own cadence."""
        cfg, env = self.cfg, self.env
        trackers = open_trackers(cfg.report_to, self.run_dir, cfg.run_name or self.run_dir.resolve().name,
                                 cfg.to_dict()) if env.is_main else []
        self.metrics = MetricsLog(self.run_dir, env, trackers)
        self.logger = StepLogger(self.metrics, env, cfg.log_steps, self.total_steps, self.start_step,
                                 self.batches.epoch_of, self.t_start, show=env.is_main and not self.quiet)
        self.evaluator = Evaluator(self.loss_module, self.eval_rows, self.metrics, env, micro_batch=cfg.micro_batch,
                                   pad_id=self.pad_id, amp=self.amp, device=self.in_device, width=self.width,
                                   every=cfg.eval_steps, total_steps=self.total_steps,
                                   generation=self._generation_eval(), show=env.is_main and not self.quiet)
        self.loss_module.train()
        for step in range(self.start_step, self.total_steps):
            rows = self.batches.step(step)
            grad_norm = self.train_step(rows)
            self.tokens += rows.global_tokens
            done = step + 1
            self.logger.end_step(done, self.tokens, rows.global_tokens, grad_norm,
                                 self.lr_schedule.get_last_lr()[0])
            t_aside = time.perf_counter()
            self.evaluator.maybe_run(done)
            self.checkpointer.maybe_save(done, self.tokens, self.loss_module, self.optimizer, self.lr_schedule)
            self.logger.exclude(time.perf_counter() - t_aside)
        self.logger.close()

    def _generation_eval(self) -> GenerationEval | None:
        if not self.eval_requests:
            return None
        sampling = Sampling(max_new_tokens=self.cfg.eval_max_new_tokens)
        return GenerationEval(self.model, self.loss_module, self.tokenizer, self.eval_requests, self.scorers, sampling,
                              self.env, self.amp)

    def train_step(self, rows: StepRows) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then clip and step; returns the gradient norm."""
        # Normalise by the global batch's target count: the same loss at any world size and accumulation.
        scale = self.env.world / max(rows.global_targets, 1)
        for m, micro in enumerate(rows.micro_batches):
            last = m == len(rows.micro_batches) - 1
            batch = collate(micro, self.pad_id, self.width).to(self.in_device)
            with set_grad_sync(self.loss_module, last), self.amp:
                loss_sum, _ = self.loss_module(batch.input_ids, batch.position_ids, batch.targets)
            (loss_sum * scale).backward()
            self.logger.add_loss(loss_sum, rows.global_targets)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # -- finish --------------------------------------------------------------------------------------------------
    def finish(self) -> TrainResult:
        """Final evaluation and checkpoint, the adapter or model folder, and summary.json."""
        env = self.env
        eval_loss = self.evaluator.run(self.total_steps) if self.eval_rows else self.evaluator.last
        self.checkpointer.save(self.total_steps, self.tokens, self.loss_module, self.optimizer, self.lr_schedule)
        save_final(self.loss_module, self.model, self.tokenizer, self.run_dir, env,
                   is_lora=self.cfg.method in ("lora", "qlora"))
        wall = time.perf_counter() - self.t_start
        summary = {"steps": self.total_steps, "train_loss": self.logger.losses[-1] if self.logger.losses else None,
                   "eval_loss": eval_loss, "tokens_per_s": round(self.tokens / wall, 2) if wall > 0 else None,
                   "peak_mem_gib": gather_floats(peak_mem_gib(env.device), env), "wall_s": round(wall, 3),
                   "strategy": self.strategy.name, "world_size": env.world,
                   "resumed_from_step": self.start_step or None, "trainable_params": self.n_trainable,
                   "tokens": self.tokens, "skipped_rows": self.data_stats.skipped,
                   **self.evaluator.last_generation}
        if env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics.close()
        barrier(env)
        return TrainResult(self.run_dir, self.model, self.tokenizer, summary)


def train(cfg: Config, env: DistEnv, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
          plan: Plan | None = None, quiet: bool = False) -> TrainResult:
    """Run the fine-tune `cfg` describes on this process's share of the work; returns the trained model."""
    recipe = FineTune(cfg, env, model=model, tokenizer=tokenizer, plan=plan, quiet=quiet)
    recipe.setup()
    recipe.fit()
    return recipe.finish()

