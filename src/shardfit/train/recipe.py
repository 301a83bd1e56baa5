"""The fine-tuning recipe: `setup` (plan, data, model, preflight, parallelize, optimizer, resume) -> `fit` (the
loop) -> `finish` (final evaluation, checkpoint, adapter or model, summary).

The loop is one optimizer step per iteration; the components (`StepLogger`, `Evaluator`, `Checkpointer`) decide
their own cadence. With world size 1 the distributed parts reduce to plain PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.check.config_rules import device_map_rules, float8_rules, qlora_rules
from shardfit.check.findings import Finding, is_ok, refuse_unfixable
from shardfit.check.pipeline_rules import pipeline_plan_rules, refuse_stage_oom
from shardfit.check.rules import placement_rules, quantized_placement_rules
from shardfit.check.run import preflight
from shardfit.config import Config
from shardfit.data.cache import cached_encode_split
from shardfit.data.dataset import read_split
from shardfit.data.loader import Batch, BatchSchedule, StepRows, collate
from shardfit.data.packing import PackedRow, no_pack, pack, pack_stream, pack_where_padded
from shardfit.data.preference import Pair, encode_preference_split, pair_former, read_preference_split
from shardfit.data.static_shape import stream_shape
from shardfit.data.tokenize import Encoded
from shardfit.dtypes import DTYPES
from shardfit.errors import JobFailed, UserError
from shardfit.evals.scorers import parse_metrics
from shardfit.gc_policy import end_of_startup
from shardfit.infer.generate import Sampling
from shardfit.infer.prompts import requests_from_conversations
from shardfit.models.adapters import skip_adapter_input_casts
from shardfit.models.anatomy import input_device, output_vocab, vision_body
from shardfit.models.attention_by_width import AttentionByWidth
from shardfit.models.build import (
    attention_kernels,
    build_model,
    load_tokenizer,
    model_config,
    use_attention,
    weights_cached,
)
from shardfit.models.experts import aux_loss_of, moe_top_k, switch_form
from shardfit.models.gguf_reads import GGUFReads
from shardfit.models.processor import load_vision_processor, save_processor
from shardfit.models.source import resolve_model
from shardfit.parallel import allocator, faults, ulysses
from shardfit.parallel.agree import require_same
from shardfit.parallel.compile import require_compiler
from shardfit.parallel.env import DistEnv, barrier, cpu_matmul_gflops, fast_cpu_bf16, fast_fp32_matmuls
from shardfit.parallel.expert_grads import step_grad_norm
from shardfit.parallel.experts import gather_experts, share_experts
from shardfit.parallel.job import agreed_job
from shardfit.parallel.layout import layout_of
from shardfit.parallel.parallelize import micro_batch_sync, parallelize
from shardfit.parallel.pipeline import cut, cut_looped
from shardfit.parallel.sequence import shard_batch
from shardfit.parallel.threads import thread_reason
from shardfit.parallel.watchdog import Watchdog, WatchdogSettings
from shardfit.plan.attention_layout import carries_state
from shardfit.plan.choose import tokens_per_s_at
from shardfit.plan.estimate import loss_chunk_for
from shardfit.plan.plan import Plan
from shardfit.resolve import Resolved
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve.decide import settled
from shardfit.resolve.defaults import (
    CUDNN_PLAN_S,
    CUDNN_PLAN_SHARE,
    cudnn_attention_allowed,
)
from shardfit.resolve.fits import refuse_if_oom
from shardfit.resolve.resume import global_batch
from shardfit.resolve.sequence import check_balancing, check_model, facts_of_config
from shardfit.strategy import get as get_strategy
from shardfit.train.base_ref import BaseRef, base_for_adapter
from shardfit.train.checkpoint import Checkpointer, list_checkpoints
from shardfit.train.diverge import Diverged, DivergenceStop
from shardfit.train.evaluate import Evaluator, GenerationEval
from shardfit.train.export import export_base, save_final
from shardfit.train.inputs import InputFeed
from shardfit.train.loss import CausalLMLoss
from shardfit.train.metrics import SAMPLES_FILE, MetricsLog, StepLogger, gather_floats, peak_mem_gib, truncate_after
from shardfit.train.oom import Where, out_of_memory, ran_out
from shardfit.train.optim import build_optimizer, cosine_with_warmup
from shardfit.train.pipeline import PipelineEvalModule, PipelineRun, clip_global_norm, gather_stages, over_stages
from shardfit.train.preference import PreferenceLoss, PreferenceSettings
from shardfit.train.profiling import StepProfiler
from shardfit.train.rundir import (
    RunLock,
    check_writable,
    claim,
    decide_on_rank0,
    fingerprint,
    record_length,
)
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


def report_findings(findings: list[Finding], env: DistEnv) -> None:
    """Log what the preflight fixed or warns about; refuse to start on an error it could not fix."""
    for f in findings:
        if env.is_main and f.severity != "info":
            log.warning("%s: %s (%s)%s", f.rule, f.message, f.fix, " [fixed]" if f.auto_fixed else "")
    refuse_unfixable(findings)


def threads_phrase() -> str:
    """The start line's thread count, e.g. '1 thread per rank (load average 1.6)' (parallel/threads.py)."""
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n != 1 else ''} per rank" + (f" ({why})" if (why := thread_reason()) else "")


def rows_of(examples: list[Encoded], cfg: Config) -> list[PackedRow]:
    """Evaluation rows: packed several examples to a row, or one example per row (the mean token loss is the same)."""
    return pack(examples, cfg.max_seq_len) if cfg.packing else no_pack(examples)


def micro_batch_former(cfg: Config) -> Callable[[list[Any]], list[PackedRow]]:
    """How a micro-batch's `micro_batch` examples become rows: packed into rows of at most max_seq_len tokens where
    that removes a real share of padding (only padding goes away), or one example per row. A preference example's
    sides become tagged rows the same way (data/preference.py)."""
    if objectives.get(cfg.objective).preference:
        return pair_former(cfg.max_seq_len, cfg.packing)
    return functools.partial(pack_where_padded, max_len=cfg.max_seq_len) if cfg.packing else no_pack


def preference_settings(cfg: Config) -> PreferenceSettings:
    d = cfg.dpo
    return PreferenceSettings(cfg.objective, d.beta, d.loss, d.label_smoothing, d.simpo_gamma, d.desirable_weight,
                              d.undesirable_weight)


class FineTune:
    """One fine-tune of `cfg` on this process's share of the work. `model`/`tokenizer`, when given, are the
    config's model as `build_model` made it (the demo evaluates the base model before training). `watchdog`, when
    given, is the rank's running watchdog (train_cmd starts it); without one the phases are only recorded."""

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

    def _claim_run_dir(self) -> None:
        """One training per output_dir (a lock), resuming only its own checkpoints (run.json's fingerprint)."""
        cfg, env = self.cfg, self.env
        self.lock = RunLock(self.run_dir) if env.is_main else None

        def decide() -> tuple[str | None, str | None]:
            check_writable(self.run_dir)
            warning = self.lock.acquire()
            return warning, claim(self.run_dir, cfg, fingerprint(cfg, global_batch(cfg, self.job)))

        warning, self.longer = decide_on_rank0(env, decide)
        if warning and env.is_main:
            log.warning("%s: %s", self.run_dir, warning)

    def release(self) -> None:
        """Stop a profile left running and give the run directory back (rank 0's lock); safe to call more than
        once."""
        if self.profiler is not None:
            self.profiler.close()
        if self.lock is not None:
            self.lock.release()

    def _setup_data(self) -> None:
        """Data before the model: a bad row stops the run in seconds, before the tokenizer and the model load."""
        preference = objectives.get(self.cfg.objective).preference
        split = read_preference_split(self.cfg) if preference else read_split(self.cfg)
        self.startup.mark("data read")
        source = resolve_model(self.cfg.model)
        if self.tokenizer is None:
            with self.gguf.shared():
                self.tokenizer = load_tokenizer(source, self.cfg.trust_remote_code)
        self.vision = load_vision_processor(source, self.cfg, self.tokenizer)
        self.startup.mark("tokenizer")
        if preference:  # pairs are encoded afresh (the data cache keeps SFT examples)
            train_ex, eval_ex = encode_preference_split(self.cfg, self.tokenizer, split, self.vision)
            self.data_cache_hit = None
        else:
            encoding = cached_encode_split(self.cfg, self.tokenizer, split, self.vision, write=self.env.is_main)
            train_ex, eval_ex = encoding.train, encoding.eval
            self.data_cache_hit = encoding.hit
        self.startup.mark("tokenise (cached)" if self.data_cache_hit else "tokenise")
        with self.gguf.shared():
            built = self.model.config if self.model is not None else model_config(self.cfg, source, weights=False)
        self.carries_state = carries_state(built)
        self.n_images = sum(len(c.images) for c in split.train)
        self.n_clips = sum(len(c.audios) for c in split.train)
        self.n_videos = sum(len(c.videos) for c in split.train)
        self.data_stats = split.stats
        self.scorers = parse_metrics(self.cfg.eval_metrics)  # a bad py: scorer stops the run before the model loads
        eval_conv = [split.rows[c.where].prompt + split.rows[c.where].chosen for c in split.eval] if preference \
            else [c.messages for c in split.eval]
        self.eval_requests = requests_from_conversations(eval_conv, self.cfg.eval_samples) if self.scorers else []
        if self.scorers and not self.eval_requests and self.env.is_main:
            log.warning("eval_metrics %s: no held-out data to generate for; set eval_data or eval_split",
                        self.cfg.eval_metrics)
        if self.eval_requests and self.cfg.compile and self.env.is_main:
            log.warning("eval_metrics with compile: true: generation runs through the compiled blocks, which are "
                        "compiled for one shape and recompile for others (slow evaluations); compile: false avoids it")
        self.n_examples, self.n_eval = len(train_ex), len(eval_ex)
        cfg = self.cfg
        self.train_examples, self.eval_pairs = train_ex, eval_ex if preference else []
        # Held-out pairs are formed into rows when the evaluator starts, after any reference pass filled them in.
        self.eval_rows = [] if preference else rows_of(eval_ex, self.row_cfg)
        self.pad_id = self.tokenizer.pad_token_id
        self.batches = BatchSchedule(train_ex, cfg.micro_batch, cfg.grad_accum, self.layout.dp, self.layout.dp_rank,
                                     cfg.seed, pack_stream if self.static_shape else micro_batch_former(self.row_cfg))

    def _setup_model(self) -> None:
        """Build, preflight (fixes applied), then parallelize: checkpointing, compiled blocks, DDP or FSDP2."""
        cfg, env, s = self.cfg, self.env, self.strategy
        with self.gguf.shared():
            if self.model is None:
                self.model_cache_hit = weights_cached(cfg)
                self.model = build_model(cfg, s, weights=True, experts=self.job.experts)
            # read now: a GGUF's metadata names the base, from the parse the load made
            self.adapter_base = base_for_adapter(cfg.model, self.run_dir) if methods.get(cfg.method).adapters \
                else None
        self.gguf.clear()
        if self.layout.sp > 1:  # every width through the all-to-all attention (parallel/ulysses.py)
            check_model(self.layout.sp, facts_of_config(self.model.config), cfg.model)
            ulysses.register()
            self.model.set_attn_implementation(ulysses.NAME)
        elif vision_body(self.model) is None:  # the rule was measured on text models; towers keep their kernel
            use_attention(self.model, cfg.attn_implementation)
            # `auto` attention by each micro-batch's row width where the faster kernel depends on it.
            self.attention = AttentionByWidth.for_model(self.model, self.job.eager_max_width)
        findings = preflight(self.model, cfg, s, env.world, self.plan)
        quantized = quantized_placement_rules(self.model, env.device, env.world)
        report_findings(quantized, env)  # before anything below tries to move weights that cannot move
        # `loss_chunk: auto` as the job resolved it; by the built model's vocabulary where the plan had no shape.
        self.loss_chunk = self.job.loss_chunk or loss_chunk_for(cfg.loss_chunk, output_vocab(self.model),
                                                                self.job.hardware, cfg.precision)
        routing = {"moe_top_k": moe_top_k(self.model), "aux": aux_loss_of(self.model, self.model.config)}
        if self.layout.sp > 1 and routing["aux"] is not None:  # summed from the split rows' statistics (loss.py)
            check_balancing(self.layout.sp, switch_form(routing["aux"]), cfg.model)
        self.reference = self.job.reference  # resolve/decide.py: how this run gets its reference log-probabilities
        if objectives.get(cfg.objective).preference:
            loss_module = PreferenceLoss(self.model, preference_settings(cfg), reference=self.reference,
                                         chunk=self.loss_chunk, **routing)
        else:
            loss_module = CausalLMLoss(self.model, self.loss_chunk, **routing)
        self.routing = loss_module  # unwrapped: the engines below wrap it, its last micro-batch's routing stays here
        # expert_parallel: this rank's share of each block's experts, before the strategy wraps the rest
        self.experts_shard = share_experts(self.model, loss_module, self.layout, env.world, cfg.model)
        if self.layout.pp > 1:  # this rank's stage of the model takes the loss module's place
            loss_module = self._pipeline_stage()
        self.loss_module = parallelize(loss_module, s, device=env.device, world=self.job.dims.stage_ranks,
                                       precision=cfg.precision, grad_ckpt=cfg.grad_ckpt, compile=cfg.compile,
                                       ignored=set(self.experts_shard.params()) if self.experts_shard else None,
                                       mesh=self.layout.stage_mesh if self.pipe is not None else None,
                                       float8=cfg.float8)
        if self.pipe is not None:  # the schedule runs the stage as the strategy wrapped it
            self.pipe.module = self.loss_module
        if s.engine != "device_map" and not s.offload:
            findings += placement_rules(loss_module, env.device, fix=True)
        self.findings = quantized + findings
        report_findings(findings, env)
        self.in_device = input_device(self.model) if s.engine == "device_map" else env.device
        self.feed = InputFeed(self.in_device, self._collate)
        # FSDP2's MixedPrecisionPolicy already computes in low precision; the other engines use autocast.
        self.amp = torch.autocast(env.device.type, dtype=DTYPES[self.job.autocast]) if self.job.autocast \
            else contextlib.nullcontext()
        if methods.get(cfg.method).adapters and isinstance(self.amp, torch.autocast):
            skip_adapter_input_casts(self.model)  # every forward of the run is inside self.amp

    def _pipeline_stage(self) -> torch.nn.Module:
        """Cut the built model to this rank's pipeline stage (parallel/pipeline.py), checked against the rules on
        its own config first (the planner may not have known the shape)."""
        per_rank = pipelines.stages_per_rank(self.cfg)
        pipelines.check_model(self.layout.pp, pipelines.facts_of_config(self.model.config), self.cfg.model,
                              self.cfg.method, per_rank=per_rank)
        stages = cut_looped(self.model, self.layout.pp_rank, self.layout.pp, per_rank) if per_rank > 1 \
            else [cut(self.model, self.layout.pp_rank, self.layout.pp, self.job.stage_layers)]  # the plan's cut
        self.pipe = PipelineRun(stages, self.layout, self.env.device, self.loss_chunk,
                                DTYPES[self.job.autocast] if self.job.autocast else None,
                                zero_bubble=self.cfg.pipeline_schedule == pipelines.ZERO_BUBBLE)
        return stages[0]  # it holds the rank's whole share of the model

    def _setup_optimizer(self) -> None:
        cfg, env = self.cfg, self.env
        self.params = [p for p in self.loss_module.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in self.params)  # a sharded (DTensor) parameter counts its whole
        if self.pipe is not None:  # the whole model's, not this stage's
            self.n_trainable = over_stages(self.n_trainable, self.layout)
        self.optimizer = build_optimizer(self.params, cfg.lr, cfg.weight_decay)
        self.total_steps = cfg.max_steps or cfg.epochs * self.batches.steps_per_epoch
        # Every rank reads the whole data set, so these match unless the nodes read different files.
        require_same(env, {"train_examples": len(self.train_examples),
                           "eval_rows": len(self.eval_rows) + len(self.eval_pairs), "steps": self.total_steps},
                     "the training work",
                     "The data files differ between nodes: put the same data on every node (a shared filesystem, "
                     "or identical copies at the same path).")
        self.lr_schedule = cosine_with_warmup(self.optimizer, int(cfg.warmup_ratio * self.total_steps),
                                              self.total_steps)
        self.stop = DivergenceStop.for_device(self.optimizer, env.device)

    @torch.no_grad()
    def _precompute_reference(self) -> None:
        """Each training and held-out pair's reference log-probabilities, computed before the first update (and
        before a resumed run loads its checkpoint) while the policy still is the reference: each rank takes every
        world-th micro-batch, then the ranks pool them."""
        cfg, env = self.cfg, self.env
        pairs: list[Pair] = self.train_examples + self.eval_pairs
        for p in pairs:
            p.ref = None
        form, mb = micro_batch_former(self.row_cfg), cfg.micro_batch
        groups = [pairs[i:i + mb] for i in range(0, len(pairs), mb)]
        sides = len(pairs[0].sides)
        out = torch.zeros(len(pairs), sides, dtype=torch.float64, device=env.device)
        self.loss_module.eval()
        for k in range(-(-len(groups) // env.world)):
            idx = k * env.world + env.rank
            real = idx < len(groups)
            batch = collate(form(groups[idx if real else 0]), self.pad_id, self.job.rows).to(self.in_device)
            if self.attention is not None:  # the kernel training would run at this width: the same numbers
                self.attention.before(batch.input_ids.shape[-1])
            with self.amp:
                logps, _ = self.loss_module(batch.input_ids, batch.position_ids, batch.targets, **batch.media,
                                            **batch.host_facts, reference_only=True)
            if real:
                out[idx * mb:idx * mb + len(groups[idx])] = logps.to(out.device, out.dtype).view(-1, sides)
        self.loss_module.train()
        if env.distributed:
            torch.distributed.all_reduce(out)
        for p, ref in zip(pairs, out.tolist(), strict=True):
            p.ref = tuple(ref)

    def _resume(self) -> None:
        cfg, env = self.cfg, self.env
        self.checkpointer = Checkpointer(self.run_dir, env, every=cfg.save_steps, keep=cfg.save_limit,
                                         total_steps=self.total_steps, experts=self.experts_shard)
        resumed = self.checkpointer.resume(cfg.resume, self.loss_module, self.optimizer, self.lr_schedule)
        self.start_step, self.tokens = (resumed.step, resumed.tokens) if resumed else (0, 0)
        # Its last step is checkpointed and its summary written: nothing to train, nothing to overwrite.
        self.finished = self.start_step >= self.total_steps and (self.run_dir / "summary.json").is_file()
        if self.finished:
            return
        logs = [self.run_dir / "metrics.jsonl", self.run_dir / SAMPLES_FILE]
        if env.is_main and resumed is not None:
            for f in logs:
                truncate_after(f, self.start_step)
            log.info("resumed from %s (step %d)%s", resumed.path, self.start_step,
                     f": {self.longer}" if self.longer else "")
        elif env.is_main:
            for f in logs:
                f.unlink(missing_ok=True)

    def _write_run_files(self) -> None:
        if not self.env.is_main or self.finished:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record_length(self.run_dir, self.total_steps, self.batches.steps_per_epoch)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        if self.plan is not None:
            (self.run_dir / "plan.json").write_text(json.dumps(self.plan.to_json(), indent=2))
        (self.run_dir / "preflight.json").write_text(json.dumps(
            {"strategy": self.strategy.name, "ok": is_ok(self.findings),
             "findings": [f.to_json() for f in self.findings]}, indent=2))
        if not self.quiet:
            cfg, stats = self.cfg, self.data_stats
            world = self.env.world
            packing = "packed where padding would fill a quarter, the same steps as unpacked" if self.row_cfg.packing \
                else "unpacked: recurrent blocks would carry one example's state into the next" \
                if cfg.packing and self.carries_state else "unpacked"
            print(f"shardfit: {self.n_examples} examples, {self.n_eval} eval; rows of <= {cfg.max_seq_len} tokens "
                  f"({packing}); "
                  f"strategy {self.strategy.name} on {world} x {self.env.device.type} ({cfg.precision}); "
                  f"{self.n_trainable:,} trainable params; global batch {self.batches.global_examples} examples "
                  f"(micro_batch {cfg.micro_batch} x grad_accum {cfg.grad_accum} x {self.layout.dp} "
                  + (f"data groups of {self.layout.sp} ranks splitting each row" if self.layout.sp > 1
                     else f"data group{'s' if self.layout.dp > 1 else ''} of {self.layout.pp} pipeline stages"
                     if self.layout.pp > 1 else f"rank{'s' if world > 1 else ''}")
                  + f"); {self.batches.steps_per_epoch} steps per epoch, "
                  f"{self.total_steps} steps"
                  + (f" (continuing from step {self.start_step})" if self.start_step else "")
                  + self._media_line()
                  + (f"; {stats.describe()}" if stats.describe() else "")
                  + (f"; malloc: {self.malloc}; {threads_phrase()}" if self.env.device.type == "cpu" else ""))
            if allocator.install_would_help(os.environ, self.malloc, self.env.device.type):
                log.info("malloc: the C library's; with tcmalloc CPU training runs faster in less memory (%s; "
                         "docs/training.md, Start-up)", allocator.INSTALL_HINT)

    @property
    def row_cfg(self) -> Config:
        """The config rows are formed by: the run's, except that Gemma 3's image rows and the rows of a model with
        recurrent blocks stay unpacked. Gemma 3's image tokens attend to each other both ways, which shardfit's
        packed-row mask does not compose with the examples' blocks; one example per row gets the model's own mask
        (train/soft_token_forward.py). A recurrent block's state (Mamba, Gated DeltaNet) runs along the whole row,
        past any mask, so a packed example would start from the state its neighbour left. The run's config, its
        fingerprint and config.yaml keep the user's setting."""
        soft_grid = self.vision is not None and self.vision.soft_grid is not None
        if (soft_grid or self.carries_state) and self.cfg.packing:
            return dataclasses.replace(self.cfg, packing=False)
        return self.cfg

    @property
    def static_shape(self) -> bool:
        """Whether training micro-batches are one row of micro_batch x max_seq_len tokens (data/static_shape.py):
        as resolved, where the rows may be packed at all (`row_cfg`)."""
        return self.job.static_shape and self.row_cfg.packing

    def _media_line(self) -> str:
        """The start line's account of a multimodal run's media (empty for a text model)."""
        if self.vision is None:
            return ""
        clips = f", {self.n_clips} audio clips" if self.vision.audio is not None else ""
        clips += f", {self.n_videos} videos" if self.n_videos else ""
        if self.vision.soft_grid is not None:
            _, rows, cols = self.vision.soft_grid
            return (f"; {self.n_images} images ({rows * cols} soft tokens each, attended to both ways within an "
                    "image; Gemma 3's rows are never packed)")
        packed = " in packed rows" if self.cfg.packing else ""
        return f"; {self.n_images} images{clips} (M-RoPE positions kept per example{packed})"

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

