"""A full fine-tune of a model whose head shares the input embedding: at the end of backward autograd adds the
head's gradient (kept in the shared weight's input buffer since the loss) to the embedding's, out of place. The
estimate holds that moment as the fake-tensor step of the same model does."""

from __future__ import annotations

import pytest

from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from shardfit.simulate.step import simulate

TENSORS = ("weights", "grads", "optimizer", "activations", "logits", "temporaries")


def _tensor_total(candidate: object) -> float:
    return sum(getattr(candidate.per_gpu_gib, part) for part in TENSORS)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_shared_weights_gradient_sum_is_planned(tied: bool, precision: str) -> None:
    """A vocabulary far wider than the model and short rows, so that the embedding's gradient decides the peak:
    tied, three vocab x hidden gradients at the embedding's backward (the head's, the embedding's, their sum) and
    the shared weight's .grad not yet made; untied, the embedding's gradient beside the head's. The estimate's
    peak and its tensors agree with the fake-tensor step's within 1 %."""
    shape = ModelShape("tiny-llama", 2, 32, 64, 4, 2, 49152, tied, None)
    w = Workload(method="full", precision=precision, seq_len=16, micro_batch=1, grad_ckpt="none", fused_adamw=True)
    hw = parse_gpus("1x80GB")
    ca, cs = estimate(shape, w, hw, "single"), simulate(shape, w, hw, "single", None)
    assert _tensor_total(ca) == pytest.approx(_tensor_total(cs), rel=0.01)
    if tied:
        assert ca.peak_phase == cs.peak_phase == "backward"
        one = shape.vocab * shape.hidden * 4 / 2**30  # fp32 masters under autocast too
        assert ca.per_gpu_gib.temporaries >= 3 * one
        assert ca.per_gpu_gib.grads == pytest.approx(cs.per_gpu_gib.grads, abs=1e-4)  # the blocks' alone
