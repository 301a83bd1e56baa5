"""transformers' Trainer.evaluate on a tiny bf16 model on the CPU holds what plan/evaluation.py counts: the eval
batch's logits upcast to fp32 by the loss, and with a compute_metrics every eval step's logits and labels
concatenated and kept (`step_kept_bytes` each) until eval_accumulation_steps moves them off the device."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardfit.plan.evaluation import step_kept_bytes
from shardfit.plan.workload import Workload

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, EXAMPLES = 512, 16, 4, 12


class _Upcasts(torch.overrides.TorchFunctionMode):
    """Records every 16-bit [batch, seq, vocab] tensor cast to fp32 with `.float()`."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.float and args[0].dtype == torch.bfloat16 and args[0].dim() == 3:
            self.shapes.append(tuple(out.shape) if out.dtype == torch.float32 else ())
        return out


def _evaluate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metrics: bool, **args: Any) -> dict[str, Any]:
    """Evaluate a tiny bf16 Llama over EXAMPLES rows, BATCH at a time: the bytes the predictions' and labels'
    containers hold after every add while on the device, the fp32 upcasts, the predictions compute_metrics got."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.trainer_pt_utils import EvalLoopContainer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, VOCAB, (EXAMPLES, SEQ))]
    held: list[int] = []
    add = EvalLoopContainer.add

    def recording_add(self: Any, tensors: Any) -> None:
        add(self, tensors)
        if isinstance(self.tensors, torch.Tensor) and self.tensors.dim() >= 2:  # predictions and labels
            held.append(self.tensors.nbytes)

    monkeypatch.setattr(EvalLoopContainer, "add", recording_add)
    seen: dict[str, Any] = {}

    def compute_metrics(p: Any) -> dict[str, float]:
        seen["predictions"] = p.predictions
        return {}

    targs = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True,
                              **args)
    trainer = Trainer(model=model, args=targs, eval_dataset=data, compute_metrics=compute_metrics if metrics else None)
    with _Upcasts() as upcasts:
        trainer.evaluate()
    return {"held": held, "upcasts": upcasts.shapes, "predictions": seen.get("predictions")}


def _one_step() -> float:
    """One eval step's logits and labels as the planner counts them (bf16 logits, one rank)."""
    w = Workload(precision="bf16", seq_len=SEQ, eval_batch=BATCH, eval_keeps_logits=True)
    return step_kept_bytes(SimpleNamespace(vocab=VOCAB), w, 1)  # type: ignore[arg-type]


def test_the_eval_loss_upcasts_the_batch_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _evaluate(tmp_path, monkeypatch, metrics=False)
    assert run["upcasts"] == [(BATCH, SEQ, VOCAB)] * (EXAMPLES // BATCH)  # one fp32 copy per eval step's loss
    assert run["held"] == []  # no compute_metrics: prediction_loss_only, nothing kept


def test_compute_metrics_keeps_every_steps_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _evaluate(tmp_path, monkeypatch, metrics=True)
    steps = EXAMPLES // BATCH
    assert run["predictions"].shape == (EXAMPLES, SEQ, VOCAB)
    # after step k the predictions and labels kept are k steps' worth, as the plan counts a step
    logits = [run["held"][i] for i in range(0, 2 * steps, 2)]
    labels = [run["held"][i] for i in range(1, 2 * steps, 2)]
    assert [a + b for a, b in zip(logits, labels, strict=True)] == [k * _one_step() for k in range(1, steps + 1)]


def test_eval_accumulation_steps_bounds_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _evaluate(tmp_path, monkeypatch, metrics=True, eval_accumulation_steps=1)
    assert max(run["held"][0::2]) + max(run["held"][1::2]) == _one_step()


def test_prediction_loss_only_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _evaluate(tmp_path, monkeypatch, metrics=True, prediction_loss_only=True)
    assert run["held"] == [] and run["predictions"] is None
