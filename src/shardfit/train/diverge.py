"""The stop at the first non-finite gradient norm, with no update applied from that step on.

Testing the norm on the host (`if not torch.isfinite(norm)`) makes a GPU's host wait for the device at every step.
Where the optimizer can skip its update on the device (the fused AdamW reads `found_inf`, as GradScaler uses it),
the test stays on the device: the first bad step and its norm are recorded there, and from it on every update is
skipped, so the weights and the optimizer's state stay those of the last good step. The host reads the record where
it reads the device anyway or must before going on: at a logged step, before an evaluation or a checkpoint, and at
the last step; the run then stops naming the first bad step, as if it had stopped there (a few no-op steps later).
Elsewhere (a CPU, where reading costs nothing; an optimizer without `found_inf`) the norm is read at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Diverged:
    """The first step (1-based) whose gradient norm was not finite, and that norm."""

    step: int
    grad_norm: float


class DivergenceStop:
    """Watches each step's gradient norm before `optimizer.step()`; `check()` says whether the run diverged."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, on_device: bool):
        # GradScaler's protocol: optimizers that skip their update by a device flag say so with this attribute.
        self.on_device = on_device and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.first = torch.zeros((), dtype=torch.long, device=device)  # 0: every step so far was finite
        self.norm = torch.zeros((), dtype=torch.float32, device=device)
        self.optimizer = optimizer
        if self.on_device:
            optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=device)

    @classmethod
    def for_device(cls, optimizer: torch.optim.Optimizer, device: torch.device) -> DivergenceStop:
        """On the device wherever reading it back would make the host wait (every device but the CPU)."""
        return cls(optimizer, device, on_device=device.type != "cpu")

    def observe(self, step: int, grad_norm: torch.Tensor) -> Diverged | None:
        """Record step `step`'s norm (call before `optimizer.step()`); returns the divergence when it is read now."""
        norm = grad_norm.detach().float().to(self.first.device)
        if not self.on_device:
            return None if torch.isfinite(norm) else Diverged(step, float(norm))
        new = ~torch.isfinite(norm) & (self.first == 0)
        self.first.copy_(torch.where(new, step, self.first))
        self.norm.copy_(torch.where(new, norm, self.norm))
        self.optimizer.found_inf.copy_((self.first != 0).float())  # sticky: no update after the first bad step
        return None

    def check(self) -> Diverged | None:
        """The divergence recorded on the device so far (reads it: the host waits for the device)."""
        if not self.on_device:
            return None
        first = int(self.first)
        return Diverged(first, float(self.norm)) if first else None
