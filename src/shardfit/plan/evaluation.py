"""The evaluation a job runs while it trains under transformers' Trainer, as a moment of the step beside forward,
backward and the optimizer step (plan/estimate.py `step_moments`, plan/deepspeed.py).

What the Trainer (transformers 5) holds when it evaluates, from its source:
- The states between steps: the weights, the optimizer's states, and no gradients: the training loop calls
  model.zero_grad() (torch's default set_to_none) after each optimizer step and before `_maybe_log_save_evaluate`
  (trainer.py, the inner loop), so only what an engine keeps for the whole run stays (DDP's buckets, ZeRO-3's
  partition and bucket).
- The eval forward under torch.no_grad (trainer.py `prediction_step`): no saved activations, one block's tensors at
  a time, over `per_device_eval_batch_size` rows (training_args.py, default 8; `eval_batch_size` multiplies it only
  by n_gpu, the GPUs of one DataParallel process). The Trainer sets the model's use_cache from
  TrainingArguments.use_cache (default False), so no KV cache is built (trainer.py `__init__`, step 11).
- The loss over the eval batch: transformers' ForCausalLMLoss upcasts the logits to fp32 (loss/loss_utils.py
  `logits = logits.float()`) and cross-entropy makes an fp32 log-softmax, beside the model's 16-bit logits.
- The logits kept: unless prediction_loss_only (evaluate() passes it True when there is no compute_metrics), each
  step's logits are padded across processes, gathered from every rank (`gather_for_metrics`: each rank receives
  all ranks'), optionally reduced by preprocess_logits_for_metrics (LLaMA-Factory's and ms-swift's argmax), and
  concatenated on the GPU into an EvalLoopContainer (trainer_pt_utils.py `nested_concat` -> torch.cat: the old and
  the new tensor exist at once) until `eval_accumulation_steps` steps have gathered, when they move to the CPU
  (trainer.py `evaluation_loop`); unset, every step's stay until the loop ends. eval_do_concat_batches false
  appends each step's to a list instead (no concatenation: the kept steps alone); batch_eval_metrics hands each
  step's to compute_metrics and drops them, keeping none. Seq2SeqTrainer's predict_with_generate keeps generated
  token ids instead (trainer_seq2seq.py `prediction_step`).
"""

from __future__ import annotations

from dataclasses import replace

from shardfit.plan.activations import (
    logits_bytes,
    media_activation_bytes,
)
from shardfit.plan.precision import compute_bytes
from shardfit.plan.reference_memory import reference_activation_bytes, reference_logits_bytes
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import FULL_LOSSES, Workload

GIB = 2**30
# Eval steps planned as kept when the job keeps logits with eval_accumulation_steps unset and does not say how
# large its eval set is: the fewest that concatenate (two), a floor; the note gives what each further step adds.
ASSUMED_STEPS = 2
# Bytes per position of the labels gathered and kept beside the logits (int64).
LABEL_BYTES = 8


def eval_workload(w: Workload) -> Workload:
    """The eval forward as a workload: `eval_batch` rows, nothing accumulated, no towers training."""
    return replace(w, micro_batch=w.eval_batch, grad_accum=1, keeps_logits=False, vision_trainable=False,
                   audio_trainable=False)


def kept_steps(w: Workload, ranks: int) -> tuple[int, bool]:
    """(eval steps whose gathered logits are on the GPU at once, whether that count is assumed): 0 where none are
    kept; eval_accumulation_steps where set; else every step of the eval set over `ranks` ranks, or ASSUMED_STEPS
    where its size is not known."""
    if not w.eval_keeps_logits or not w.eval_batch:
        return 0, False
    steps = -(-w.eval_examples // (w.eval_batch * ranks)) if w.eval_examples else 0
    if w.eval_accumulation:
        return (min(w.eval_accumulation, steps) if steps else w.eval_accumulation), False
    return (steps, False) if steps else (ASSUMED_STEPS, True)


def step_kept_bytes(shape: ModelShape, w: Workload, ranks: int) -> float:
    """One eval step's logits and labels as each rank keeps them: every rank's `eval_batch` rows of seq_len
    positions (gathered), the logits in the dtype the model returns them in."""
    return ranks * w.eval_batch * w.seq_len * (shape.vocab * compute_bytes(w) + LABEL_BYTES)


def eval_loss_bytes(shape: ModelShape, we: Workload, strategy: str) -> float:
    """The eval batch's loss without gradients: a full loss's 16-bit logits, their fp32 upcast and the fp32
    log-softmax (`logits_bytes` at the loss; an fp32 head's 16-bit cast too: autocast caches it for the region, in
    no_grad as well, as the weight requires a gradient); a fused loss (Liger, Cut
    Cross-Entropy: the planner's chunked) one chunk, unless the logits are wanted, when the model makes them all."""
    if we.loss in FULL_LOSSES or we.eval_keeps_logits:
        return logits_bytes(shape, replace(we, loss=we.loss if we.loss in FULL_LOSSES else "full"), strategy)
    return reference_logits_bytes(shape, we)


def eval_parts(shape: ModelShape, w: Workload, strategy: str, ranks: int) -> list[tuple[float, float]]:
    """(activations, logits) in bytes at the evaluation's candidate peaks on one of `ranks` ranks, beside the
    states between steps: the last kept step's loss (its forward's transient, its loss, the earlier steps' logits),
    and the concatenation that adds its logits to them (old and new at once; appended to a list, the kept steps
    alone). Empty without evaluation."""
    if not w.eval_batch:
        return []
    we = eval_workload(w)
    act = reference_activation_bytes(shape, we, strategy) + media_activation_bytes(shape, we, strategy)
    k, _ = kept_steps(w, ranks)
    g = step_kept_bytes(shape, w, ranks)
    parts = [(act, eval_loss_bytes(shape, we, strategy) + max(0, k - 1) * g)]
    if k:
        parts.append((0.0, 2 * k * g if k > 1 and w.eval_concat else k * g))
    return parts


def eval_note(shape: ModelShape, w: Workload, ranks: int, peak: bool) -> str:
    """What the plan says of the evaluation: at an eval peak (`peak`), the keys that set it and what lowers it;
    otherwise, where the kept steps were assumed, what each further step adds. Empty where there is nothing to
    say."""
    k, assumed = kept_steps(w, ranks)
    if not w.eval_batch or not (peak or assumed):
        return ""
    g = step_kept_bytes(shape, w, ranks) / GIB
    keeps = f"logits of {k} eval step{'s' if k > 1 else ''} kept on the GPU ({k * g:.1f} GiB, " \
            f"eval_accumulation_steps {w.eval_accumulation or 'unset'}" if k else ""
    if assumed:
        keeps += f"; eval set size unknown: {k} steps assumed, each further step keeps {g:.1f} GiB more"
    keeps += ")" if k else ""
    if not peak:
        return f"evaluation: {keeps}; lowered by prediction_loss_only or eval_accumulation_steps 1"
    lowers = ("prediction_loss_only, " + ("eval_accumulation_steps 1, " if k > 1 else "")) if k else ""
    return (f"peak at evaluation: {w.eval_batch_key} {w.eval_batch} rows through the fp32 eval loss"
            + (f", {keeps}" if keeps else "") + f"; lowered by {lowers}a smaller {w.eval_batch_key}")
