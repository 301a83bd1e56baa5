"""The recipe's setup stages (train/recipe.py `FineTune.setup` runs them in order): the run directory claimed,
the data read and tokenised, the model built, preflighted and parallelized, the optimizer and its schedule,
the reference log-probabilities, the resume, and the run's files with its start line."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import yaml

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit.check.findings import Finding, is_ok, refuse_unfixable
from shardfit.check.rules import placement_rules, quantized_placement_rules
from shardfit.check.run import preflight
from shardfit.config import Config
from shardfit.data.cache import cached_encode_split
from shardfit.data.dataset import read_split
from shardfit.data.loader import BatchSchedule, collate
from shardfit.data.packing import PackedRow, no_pack, pack, pack_stream, pack_where_padded
from shardfit.data.preference import Pair, encode_preference_split, pair_former, read_preference_split
from shardfit.data.tokenize import Encoded
from shardfit.dtypes import DTYPES
from shardfit.evals.scorers import parse_metrics
from shardfit.infer.prompts import requests_from_conversations
from shardfit.models.adapters import skip_adapter_input_casts
from shardfit.models.anatomy import input_device, output_vocab, vision_body
from shardfit.models.attention_by_width import AttentionByWidth
from shardfit.models.build import build_model, load_tokenizer, model_config, use_attention, weights_cached
from shardfit.models.experts import aux_loss_of, moe_top_k, switch_form
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel import allocator, ulysses
from shardfit.parallel.agree import require_same
from shardfit.parallel.env import DistEnv
from shardfit.parallel.experts import share_experts
from shardfit.parallel.parallelize import parallelize
from shardfit.parallel.pipeline import cut, cut_looped
from shardfit.parallel.threads import thread_reason
from shardfit.plan.attention_layout import carries_state
from shardfit.plan.estimate import loss_chunk_for
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve.resume import global_batch
from shardfit.resolve.sequence import check_balancing, check_model, facts_of_config
from shardfit.train.base_ref import base_for_adapter
from shardfit.train.checkpoint import Checkpointer
from shardfit.train.diverge import DivergenceStop
from shardfit.train.inputs import InputFeed
from shardfit.train.loss import CausalLMLoss
from shardfit.train.metrics import SAMPLES_FILE, truncate_after
from shardfit.train.optim import build_optimizer, cosine_with_warmup
from shardfit.train.pipeline import PipelineRun, over_stages
from shardfit.train.preference import PreferenceLoss, PreferenceSettings
from shardfit.train.rundir import RunLock, check_writable, claim, decide_on_rank0, fingerprint, record_length

log = logging.getLogger("shardfit")


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


class RunSetup:
    """The setup stages of a `FineTune` (its base class): each reads the run's state and sets what the later stages,
    the loop and `finish` read."""

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
