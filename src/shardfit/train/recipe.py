"""The fine-tuning recipe: `setup` (plan, data, model, preflight, parallelize, optimizer, resume) -> `fit` (the
loop) -> `finish` (final evaluation, checkpoint, adapter or model, summary).

The loop is one optimizer step per iteration; the components (`StepLogger`, `Evaluator`, `Checkpointer`) decide
their own cadence. With world size 1 the distributed parts reduce to plain PyTorch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.check.config_rules import device_map_rules, float8_rules, qlora_rules
from shardfit.check.findings import refuse_unfixable
from shardfit.check.pipeline_rules import pipeline_plan_rules, refuse_stage_oom
from shardfit.config import Config
from shardfit.data.loader import Batch, StepRows, collate
from shardfit.data.packing import PackedRow
from shardfit.data.static_shape import stream_shape
from shardfit.dtypes import DTYPES
from shardfit.errors import JobFailed, UserError
from shardfit.gc_policy import end_of_startup
from shardfit.infer.generate import Sampling
from shardfit.models.attention_by_width import AttentionByWidth
from shardfit.models.build import attention_kernels
from shardfit.models.gguf_reads import GGUFReads
from shardfit.models.processor import save_processor
from shardfit.parallel import allocator, faults
from shardfit.parallel.compile import require_compiler
from shardfit.parallel.env import DistEnv, barrier, cpu_matmul_gflops, fast_cpu_bf16, fast_fp32_matmuls
from shardfit.parallel.expert_grads import step_grad_norm
from shardfit.parallel.experts import gather_experts
from shardfit.parallel.job import agreed_job
from shardfit.parallel.layout import layout_of
from shardfit.parallel.parallelize import micro_batch_sync
from shardfit.parallel.sequence import shard_batch
from shardfit.parallel.watchdog import Watchdog, WatchdogSettings
from shardfit.plan.choose import tokens_per_s_at
from shardfit.plan.plan import Plan
from shardfit.resolve import Resolved
from shardfit.resolve.decide import settled
from shardfit.resolve.defaults import CUDNN_PLAN_S, CUDNN_PLAN_SHARE, cudnn_attention_allowed
from shardfit.resolve.fits import refuse_if_oom
from shardfit.strategy import get as get_strategy
from shardfit.train.base_ref import BaseRef
from shardfit.train.checkpoint import list_checkpoints
from shardfit.train.diverge import Diverged
from shardfit.train.evaluate import Evaluator, GenerationEval
from shardfit.train.export import export_base, save_final
from shardfit.train.metrics import MetricsLog, StepLogger, gather_floats, peak_mem_gib
from shardfit.train.oom import Where, out_of_memory, ran_out
from shardfit.train.pipeline import PipelineEvalModule, PipelineRun, clip_global_norm, gather_stages
from shardfit.train.preference import PreferenceLoss
from shardfit.train.profiling import StepProfiler
from shardfit.train.recipe_setup import RunSetup, micro_batch_former
from shardfit.train.rundir import RunLock
from shardfit.train.startup import StartupTimer
from shardfit.train.trackers import open_trackers, resolve_report_to

log = logging.getLogger("shardfit")


@dataclass
class TrainResult:
    """What a finished run leaves in memory (the files are in `run_dir`)."""

    run_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    summary: dict[str, Any]


class FineTune(RunSetup):
    """One fine-tune of `cfg` on this process's share of the work. `model`/`tokenizer`, when given, are the
    config's model as `build_model` made it (the demo evaluates the base model before training). `watchdog`, when
    given, is the rank's running watchdog (train_cmd starts it); without one the phases are only recorded.
    Its setup stages are `RunSetup`'s (train/recipe_setup.py)."""

    def __init__(self, cfg: Config, env: DistEnv, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 job: Resolved | None = None, quiet: bool = False, watchdog: Watchdog | None = None):
        self.cfg, self.env, self.model, self.tokenizer, self.job, self.quiet = cfg, env, model, tokenizer, job, quiet
        self.plan: Plan | None = None
        self.carries_state = False  # recurrent blocks: rows stay unpacked (row_cfg); set with the data
        self.run_dir = Path(cfg.output_dir)
        self.t_start = time.perf_counter()
        self.startup = StartupTimer()
        self.lock: RunLock | None = None
        self.profiler: StepProfiler | None = None
        self.cudnn_attention: bool | None = None  # whether SDPA could pick cuDNN's kernel (GPU runs decide)
        self.attention: AttentionByWidth | None = None  # `auto` attention chosen per micro-batch width
        self.loss_chunk: int | None = None  # rows per chunk of the loss (setup decides `auto`)
        self.finished = False
        self.longer: str | None = None  # the words for a longer schedule of a run in output_dir (rundir.claim)
        self.fit_s, self.fit_tokens, self.train_s = 0.0, 0, 0.0
        self.model_cache_hit: bool | None = None  # None: built by the caller, not GGUF, or the model cache is off
        self.gguf = GGUFReads()  # a .gguf model parsed once for its tokenizer, config, weights and base's name
        self.adapter_base: BaseRef | None = None  # the base an adapter names (set with the model)
        self.wd = watchdog or Watchdog(env, None)
        self.fault = faults.from_env()
        # The malloc this process runs on, fixed at its start (LD_PRELOAD): read from /proc once.
        self.malloc = allocator.active()

    # -- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        env = self.env
        # Every `auto` of the job was decided before the launch (resolve/); a rank reads the decisions.
        self.job, self.plan = agreed_job(self.cfg, env, self.job)  # every node's the same, or refused
        self.cfg = cfg = settled(self.cfg, self.job)
        fast_fp32_matmuls(env.device, cfg.precision)
        if cfg.precision == "bf16" and env.device.type == "cpu" and env.is_main and not fast_cpu_bf16():
            log.warning("precision bf16 on this CPU: its bf16 matmuls run at %.1f GFLOP/s against %.1f for fp32; "
                        "precision: fp32 (or auto) trains several times faster here",
                        cpu_matmul_gflops(torch.bfloat16), cpu_matmul_gflops(torch.float32))
        resolve_report_to(cfg.report_to)  # a tracker that is not installed stops the run now, not after the load
        if cfg.compile:
            require_compiler(env.device)
        self._claim_run_dir()
        torch.manual_seed(cfg.seed)
        self.strategy = get_strategy(self.job.strategy)
        # The ranks' data and sequence split: sequence_parallel ranks share each row (parallel/sequence.py).
        self.layout = layout_of(env, self.job.dims)
        self.pipe: PipelineRun | None = None  # this rank's pipeline stage and its schedules (pipeline_parallel)
        if self.strategy.engine == "device_map" and env.distributed:  # a torchrun launch that bypassed resolve
            raise UserError("strategy: model_parallel splits one process's model over its local GPUs and cannot run "
                            "under a multi-rank launch. Use zero3 (sharded) with --nproc, or model_parallel without "
                            "it.")
        if self.job.pipeline_parallel == 1:
            refuse_if_oom(self.plan, self.strategy.name, cfg.force)
        # Stop on a config the preflight will refuse before loading anything (the preflight reports it later); a
        # pipeline's memory verdict is its stages', no rank of it holding the whole model. Under an external launcher
        # (torchrun, srun) this is the only place the refusals run: `train` checks them only when it launches.
        refuse_unfixable(device_map_rules(cfg, self.strategy, env.world) + qlora_rules(cfg, self.strategy) +
                         float8_rules(cfg, self.job))
        refuse_stage_oom(pipeline_plan_rules(cfg, self.plan, self.strategy.name))  # exit 3, as refuse_if_oom
        self.startup.mark("plan")
        self._setup_data()
        self._setup_model()
        self.startup.mark("model (cached)" if self.model_cache_hit else "model")
        self._setup_optimizer()
        if self.reference == "precomputed":
            self._precompute_reference()
            self.startup.mark("reference log-probabilities")
        self._resume()
        self._write_run_files()
        barrier(env)
        self.startup.mark("setup")
        end_of_startup()  # the model, the data and the imports live until the end: out of every later collection

    def release(self) -> None:
        """Stop a profile left running and give the run directory back (rank 0's lock); safe to call more than
        once."""
        if self.profiler is not None:
            self.profiler.close()
        if self.lock is not None:
            self.lock.release()
    # -- fit -----------------------------------------------------------------------------------------------------
    def fit(self) -> None:
        """One optimizer step per iteration; logging, evaluation and checkpoints keep their own cadence."""
        cfg, env, wd = self.cfg, self.env, self.wd
        if self.finished:
            return
        wd.configure(self.run_dir, WatchdogSettings(cfg.watchdog_factor, cfg.watchdog_min_s, cfg.watchdog_action))
        trackers = open_trackers(cfg.report_to, self.run_dir, cfg.run_name or self.run_dir.resolve().name,
                                 cfg.to_dict()) if env.is_main else []
        self.metrics = MetricsLog(self.run_dir, env, trackers)
        self.logger = StepLogger(self.metrics, env, cfg.log_steps, self.total_steps, self.start_step,
                                 self.batches.epoch_of, self.t_start, show=env.is_main and not self.quiet)
        eval_module = PipelineEvalModule(self.pipe, self.job.rows.height, self.job.rows.width) if self.pipe \
            else self.loss_module
        self.evaluator = Evaluator(eval_module, self.eval_rows, self.metrics, env, shape=self.job.rows,
                                   pad_id=self.pad_id, amp=self.amp, device=self.in_device, attention=self.attention,
                                   every=cfg.eval_steps, total_steps=self.total_steps,
                                   generation=self._generation_eval(), show=env.is_main and not self.quiet,
                                   batches=self._eval_pair_batches(),
                                   stats_of=self.routing if isinstance(self.routing, PreferenceLoss) else None,
                                   layout=self.layout)
        self.profiler = StepProfiler(self.run_dir, cfg.profile_steps, self.start_step, env.rank, env.device.type)
        self.loss_module.train()
        t_fit, tokens_before = time.perf_counter(), self.tokens
        t_all = t_fit  # every step, the first included: what a peer's training time counts
        for step in range(self.start_step, self.total_steps):
            done = step + 1
            self.profiler.before(done)
            with wd.phase(f"step {done}", step=True):
                wd.at("data loader")
                faults.inject(self.fault, env.rank, done)
                rows = self.batches.step(step)
                grad_norm = self.train_step(step, rows)
                if step == self.start_step:
                    self.startup.mark("first step")
                self.tokens += rows.global_tokens
                if self._reads_device(done):  # the host waits for the device here anyway, or must
                    self._raise_if_diverged(self.stop.check())
                wd.at("metrics (loss all-reduce)")
                self.logger.end_step(done, self.tokens, rows.global_tokens, grad_norm,
                                     self.lr_schedule.get_last_lr()[0])
                if step == self.start_step and done < self.total_steps:
                    # The first step's compile and kernel choice are start-up (startup_s says so); on an H200 a
                    # compiled 30-step run read 3.4k tokens/s with it counted and 71k without.
                    t_fit, tokens_before = time.perf_counter(), self.tokens
            t_aside = time.perf_counter()
            with wd.phase(f"profile written after step {done}", where="profile export"):
                self.profiler.after(done, last=done == self.total_steps)
            with wd.phase(f"evaluation after step {done}", where="evaluation"):
                self.evaluator.maybe_run(done)
            with wd.phase(f"checkpoint save at step {done}", where="checkpoint save"):
                self.checkpointer.maybe_save(done, self.tokens, self.loss_module, self.optimizer, self.lr_schedule)
            aside = time.perf_counter() - t_aside
            self.logger.exclude(aside)
            t_fit += aside  # tokens_per_s in summary.json counts training steps only, as the progress bar does
            t_all += aside
        self.logger.close()
        self.fit_s, self.fit_tokens = time.perf_counter() - t_fit, self.tokens - tokens_before
        self.train_s = time.perf_counter() - t_all

    def _eval_pair_batches(self) -> list[list[PackedRow]] | None:
        """The held-out pairs' micro-batches (None for SFT, whose evaluation rows are `eval_rows`)."""
        if not objectives.get(self.cfg.objective).preference:
            return None
        form, mb = micro_batch_former(self.row_cfg), self.cfg.micro_batch
        return [form(self.eval_pairs[i:i + mb]) for i in range(0, len(self.eval_pairs), mb)]

    def _generation_eval(self) -> GenerationEval | None:
        if not self.eval_requests:
            return None
        sampling = Sampling(max_new_tokens=self.cfg.eval_max_new_tokens)
        return GenerationEval(self.model, self.loss_module, self.tokenizer, self.eval_requests, self.scorers, sampling,
                              self.env, self.amp)

    def train_step(self, step: int, rows: StepRows) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then clip and step; returns the gradient norm."""
        if self.pipe is not None:
            return self._pipeline_step(step, rows)
        # Normalise by the global batch's target count: the same loss at any world size and accumulation.
        scale = self.env.world / max(rows.global_targets, 1)
        wd = self.wd
        wd.at("data loader")
        for m, batch in enumerate(self.feed(rows.micro_batches)):  # the next micro-batch's copy already issued
            last = m == len(rows.micro_batches) - 1
            if self.attention is not None:  # `auto` attention: the kernel for this micro-batch's width
                self.attention.before(batch.input_ids.shape[-1])
            wd.at("forward")
            with micro_batch_sync(self.loss_module, last), self.amp:
                loss_sum, _ = self.loss_module(batch.input_ids, batch.position_ids, batch.targets, **batch.media,
                                                **batch.host_facts)
            wd.at("backward")
            (loss_sum * scale).backward()
            if isinstance(self.routing, PreferenceLoss) and self.routing.last_stats is not None:
                self.logger.add_preference(self.routing.last_stats)
            moe = self.routing.last_moe
            if moe is not None:  # the LM loss is logged apart from the load-balancing loss the step trained on
                loss_sum = loss_sum.detach() - moe.aux_sum
                self.logger.add_routing(moe.aux_sum, rows.global_targets, moe.load)
            self.logger.add_loss(loss_sum, rows.global_targets)
        wd.at("optimizer step")
        grad_norm = step_grad_norm(self.params, self.experts_shard, self.cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()  # FSDP2: the norm over every rank's shard, the same on all ranks
        return self._optimizer_step(step, grad_norm)

    def _optimizer_step(self, step: int, grad_norm: torch.Tensor) -> torch.Tensor:
        """Stop on a non-finite norm, else step the optimizer and the schedule; returns the norm."""
        # Every rank sees the same norm, so all stop at the same step (train/diverge.py: read now or later).
        self._raise_if_diverged(self.stop.observe(step + 1, grad_norm))
        self.optimizer.step()
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _collate(self, rows: list[PackedRow]) -> Batch:
        """One micro-batch's rows as a host batch, this rank's slice of them under sequence parallelism."""
        shape = stream_shape(self.job.rows) if self.static_shape else self.job.rows
        return shard_batch(collate(rows, self.pad_id, shape), self.layout)

    def _pipeline_step(self, step: int, rows: StepRows) -> torch.Tensor:
        """`train_step` through the pipeline's 1F1B schedule (train/pipeline.py): the step's micro-batches are the
        schedule's, the loss is normalised by the global batch's target count, clipped by the norm over every
        stage."""
        self.wd.at("data loader")
        batches = [collate(micro, self.pad_id, self.job.rows) for micro in rows.micro_batches]
        self.wd.at("forward and backward (pipeline schedule)")
        sums = self.pipe.train_step(batches, self.layout.dp / max(rows.global_targets, 1))
        for loss_sum in sums:  # the last stage's; the logger's sum over the ranks adds nothing from the others
            self.logger.add_loss(loss_sum, rows.global_targets)
        self.wd.at("optimizer step")
        return self._optimizer_step(step, clip_global_norm(self.params, self.cfg.max_grad_norm, self.layout))

    def _reads_device(self, step: int) -> bool:
        """Whether the host reads the device after optimizer step `step` anyway (a logged step), or must not go on
        without knowing the run is sound (before an evaluation or a checkpoint, at the last step)."""
        return self.logger.writes_at(step) or self.evaluator.due(step) or self.checkpointer.due(step) \
            or step == self.total_steps

    def _raise_if_diverged(self, diverged: Diverged | None) -> None:
        """Stop at the first non-finite gradient, with no update applied from it on: the checkpoints on disk stay
        good ones."""
        if diverged is None:
            return
        saved = list_checkpoints(self.run_dir)
        last = f"{saved[-1][1]}" if saved else "none yet"
        raise JobFailed(f"training diverged at step {diverged.step}: the gradient norm is {diverged.grad_norm} (the "
                        f"loss became nan or inf). No update was applied from that step on; the last good checkpoint "
                        f"is {last}. Lower lr, train in bf16 or fp32 instead of fp16, or look for broken rows; resume: "
                        "auto continues from that checkpoint.")

    # -- finish --------------------------------------------------------------------------------------------------
    def finish(self) -> TrainResult:
        """Final evaluation and checkpoint, the adapter or model folder, and summary.json."""
        env, wd = self.env, self.wd
        if self.finished:
            if env.is_main and not self.quiet:
                print(f"shardfit: {self.run_dir} already finished this run (step {self.start_step}); nothing to do. "
                      "Raise max_steps or epochs to train it longer, use a new output_dir, or --set resume=never to "
                      "train it again.")
            summary = json.loads((self.run_dir / "summary.json").read_text())
            return TrainResult(self.run_dir, self.model, self.tokenizer, summary)
        with wd.phase("final evaluation", where="evaluation"):
            eval_loss = self.evaluator.run(self.total_steps) if self.evaluator.rows else self.evaluator.last
        with wd.phase("final checkpoint save", where="checkpoint save"):
            self.checkpointer.save(self.total_steps, self.tokens, self.loss_module, self.optimizer, self.lr_schedule)
        # The checkpoint holds the optimizer's state now and nothing else reads it: freed, with its pages handed back,
        # the save below runs in that room instead of above the training peak (transformers' save_pretrained
        # imports DeepSpeed where it is installed, 0.1 GiB, to check the model is not its engine).
        self.optimizer.state.clear()
        allocator.release_free_memory()
        with wd.phase("saving the adapter or model", where="final save"):
            base = self._save_outputs()
        wall = time.perf_counter() - self.t_start
        summary = {"steps": self.total_steps, "train_loss": self.logger.losses[-1] if self.logger.losses else None,
                   "eval_loss": eval_loss,
                   # Training steps after the first (when more ran), the whole process (loading included) beside.
                   "tokens_per_s": round(self.fit_tokens / self.fit_s, 2) if self.fit_s > 0 else None,
                   "process_tokens_per_s": round(self.fit_tokens / wall, 2) if wall > 0 else None,
                   "train_s": round(self.train_s, 3),
                   "peak_mem_gib": gather_floats(peak_mem_gib(env.device), env), "wall_s": round(wall, 3),
                   "strategy": self.strategy.name, "world_size": env.world, "allocator": self.malloc,
                   "resolved": self.job.to_json(),
                   "cudnn_attention": self.cudnn_attention if env.device.type == "cuda" else None,
                   "loss_chunk": self.loss_chunk,
                   "attention_by_width": dict(self.attention.used) if self.attention else None,
                   "examples_per_step": self.batches.global_examples,
                   "steps_per_epoch": self.batches.steps_per_epoch, "packing": self.row_cfg.packing,
                   "resumed_from_step": self.start_step or None, "trainable_params": self.n_trainable,
                   "predicted_tokens_per_s": self.predicted_tokens_per_s(),
                   "startup_s": self.startup.phases, "data_cache_hit": self.data_cache_hit,
                   "model_cache_hit": self.model_cache_hit,
                   "base_model": base.to_json() if base is not None else None,
                   "tokens": self.tokens, "skipped_rows": self.data_stats.skipped,
                   "dropped_rows": self.data_stats.dropped, "truncated_rows": self.data_stats.truncated,
                   "objective": self.cfg.objective, "reference": self.reference,
                   **self.evaluator.last_preference, **self.evaluator.last_generation}
        if env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if summary["predicted_tokens_per_s"] and summary["tokens_per_s"] and not self.quiet:
                # The time model's efficiency figures are GPUs'; on a CPU only its matmul rate is this machine's.
                rough = " (a rough guess on a CPU: this machine's matmul rate, GPU efficiency figures)" \
                    if env.device.type == "cpu" else ""
                print(f"shardfit: {summary['tokens_per_s']:,.0f} tokens/s measured, "
                      f"{summary['predicted_tokens_per_s']:,.0f} predicted by the plan for {self.strategy.name}{rough}")
        self.metrics.close()
        barrier(env)
        return TrainResult(self.run_dir, self.model, self.tokenizer, summary)


    def _save_outputs(self) -> BaseRef | None:
        """adapter/ or model/ (a vision-language run's processor files beside); returns the base an adapter names.
        An adapter trained on a .gguf file that names no repository gets the GGUF's weights as `base/`, so that
        AutoPeftModelForCausalLM can load it (train/base_ref.py)."""
        lora = methods.get(self.cfg.method).adapters
        if self.experts_shard is not None:  # saved whole, as one process saves it (an adapter: its factors only)
            gather_experts(self.experts_shard, stacks=not lora)
        base = self.adapter_base
        stages = gather_stages(self.pipe, self.loss_module, lora) if self.pipe is not None else None
        out = save_final(self.loss_module, self.model, self.tokenizer, self.run_dir, self.env, is_lora=lora,
                         base_name=base.name if base is not None else None, stages=stages)
        if self.env.is_main:
            if self.vision is not None:
                save_processor(self.vision, out)  # the processor files beside the tokenizer's
            if base is not None and base.export_to is not None:
                export_base(self.cfg.model, base.export_to, DTYPES.get(self.cfg.precision, torch.float32),
                            self.cfg.trust_remote_code, precision=self.cfg.precision)
            if base is not None and not self.quiet:
                log.info("adapter base: %s", base.describe())
        return base

    def allows_cudnn_attention(self) -> bool:
        """Whether this run's attention may use cuDNN's kernel (resolve/defaults.py), once set up: the shapes its
        schedule brings (the first steps' share of new ones, over all its micro-batches) against the plan's time."""
        c = self.plan.candidate(self.strategy.name) if self.plan is not None else None
        steps = self.total_steps - self.start_step
        run_s = c.step_s * steps if c is not None and c.step_s else None
        new_shapes = 1.0 if self.static_shape else self.batches.new_shape_share() * steps * self.cfg.grad_accum
        self.cudnn_attention = cudnn_attention_allowed(self.cfg.attn_implementation, self.env.device.type,
                                                       bool(self.cfg.compile), new_shapes=new_shapes, run_s=run_s)
        if not self.cudnn_attention and self.env.is_main and not self.quiet:
            predicted = f"{run_s:.0f} s predicted" if run_s is not None else "no predicted time"
            log.info("attention: SDPA without cuDNN's kernel: its plans for about %.0f new row shapes (%.0f s) would "
                     "take over %.0f%% of the run's %s (attn_implementation: sdpa keeps it; docs/training.md)",
                     new_shapes, new_shapes * CUDNN_PLAN_S, 100 * CUDNN_PLAN_SHARE, predicted)
        return self.cudnn_attention

    def out_of_memory(self, e: BaseException, what: str) -> JobFailed:
        """The message of an out-of-memory `e` (`what` ran out): where, the plan's figure, what fits instead."""
        strategy = getattr(self, "strategy", None)
        name = strategy.name if strategy is not None else self.cfg.strategy
        at = Where(self.cfg, name, self.env.world, self.env.device, self.run_dir, self.wd.last_place)
        return out_of_memory(e, what, self.plan, at)

    def predicted_tokens_per_s(self) -> float | None:
        """The plan's tokens/s for the strategy this run used, at the run's own tokens per micro-batch (padding
        does not count), or None without a plan."""
        c = self.plan.candidate(self.strategy.name) if self.plan is not None else None
        if c is None or not c.tokens_per_s or self.pipe is not None:  # the strategy's row is not a pipeline's
            return None
        micro_batches = (self.total_steps - self.start_step) * self.cfg.grad_accum * self.env.world
        if not self.fit_tokens or micro_batches <= 0:
            return round(c.tokens_per_s, 2)
        at = tokens_per_s_at(self.plan, self.cfg.model, self.strategy.name, self.fit_tokens / micro_batches)
        return round(at or c.tokens_per_s, 2)


def train(cfg: Config, env: DistEnv, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
          job: Resolved | None = None, quiet: bool = False, watchdog: Watchdog | None = None) -> TrainResult:
    """Run the fine-tune `cfg` describes on this process's share of the work (as `job` resolved it; without one,
    as the launcher resolved it or, in a plain process, resolved here); returns the trained model."""
    recipe = FineTune(cfg, env, model=model, tokenizer=tokenizer, job=job, quiet=quiet, watchdog=watchdog)
    try:
        recipe.setup()
        with attention_kernels(recipe.allows_cudnn_attention()):
            recipe.fit()
            return recipe.finish()
    except Exception as e:
        what = ran_out(e, env.device)
        if what is None:
            raise
        raise recipe.out_of_memory(e, what) from e  # an expected failure: exit 1 with what to do, no traceback
    finally:
        recipe.release()
