"""Memory trackers for a fake-tensor training step: torch's `MemTracker` / `FSDPMemTracker` with the loss's
tensors filed as logits and a snapshot per phase of the step.

These lean on private torch modules (`torch.distributed._tools`, DTensor's sharding propagator); only
`shardfit plan --simulate` imports this package, so a torch upgrade that moves them cannot break `check` or `train`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _RefType
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from shardfit.plan.estimate import GIB, Breakdown, add_runtime_overhead
from shardfit.plan.hardware import Hardware

# How the trackers' categories map onto the plan's columns.
COLUMNS = {
    "Parameter": "weights", "Sharded Param": "weights", "Buffer": "weights",
    "Gradient": "grads", "Sharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "Unsharded Param": "temporaries", "Unsharded Grad": "temporaries",
    "All Gather": "temporaries", "Reduce Scatter": "temporaries", "Other": "temporaries",
    "Logits": "logits",
}


class _NoHook:
    def remove(self) -> None:
        """Nothing was registered, so nothing to remove."""


def skip_frozen_grad_hooks(tracker: Any, module: torch.nn.Module) -> None:
    """MemTracker hooks every parameter for its gradient, which torch refuses on frozen ones (LoRA's base
    weights); marking those as already hooked makes it skip them (they never get a gradient anyway)."""
    for p in module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


class _LossRef(_RefType):
    LOGITS = "Logits"


class LossAttribution:
    """Mixin for torch's MemTracker / FSDPMemTracker that files what the loss creates under its own category.

    The trackers file every tensor by when it was made (forward: Activation, backward: Temp). Tensors made after
    the decoder body's forward and before its backward starts belong to the loss (logits, their softmax and
    gradients, the gradient handed back to the body): they become "Logits", the plan's logits column. The
    snapshot at each phase's own peak (forward, backward, optimizer) is kept as well (`phase_peaks`)."""

    def __init__(self, body: torch.nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self._body = body
        self._after_body = self._body_bw = False
        self._propagating = 0
        self.phase_peaks: dict[str, dict[str, int]] = {}

        def before(*_: Any) -> None:
            self._after_body = self._body_bw = False

        def after(*_: Any) -> None:
            self._after_body = True

        body.register_forward_pre_hook(before)
        body.register_forward_hook(after)

    def _in_loss(self) -> bool:
        if not self._after_body:
            return False
        if self._mod_tracker.is_bw and self._mod_tracker.get_known_fqn(self._body) in self._mod_tracker.parents:
            self._body_bw = True
        return not self._body_bw

    @contextlib.contextmanager
    def ignoring_sharding_propagation(self) -> Iterator[None]:
        """DTensor derives output shapes by running each new op on global-shape fake tensors in the active fake
        mode, which under a fake-tensor simulation is the tracker's own: those tensors would be counted. Real runs
        make them in a throw-away fake mode (no memory), so they are ignored here (a foreach optimizer step over
        a whole model would otherwise count every parameter at full size)."""
        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(prop: Any, op_schema: Any) -> Any:
            self._propagating += 1
            try:
                return original(prop, op_schema)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if self._propagating:
            return
        if reftype.value in ("Activation", "Temp") and self._in_loss():
            reftype = _LossRef.LOGITS
        super()._track(reftype, t)  # type: ignore[misc]

    def track_as_activation(self, *tensors: torch.Tensor) -> None:
        """File tensors made before the step (a batch's image pixels) as activations: they stay allocated through
        the step, as the batch does on a GPU. Without this the trackers see them only if an op passes them on
        uncopied (fp32), not when the first op makes a cast copy."""
        act = next(r for r in self._ref_class if r.value == "Activation")  # type: ignore[attr-defined]
        for t in tensors:
            self._update_and_maybe_create_winfos(t, act)  # type: ignore[attr-defined]

    def phase(self) -> str:
        """Where the step is: forward (the loss included), backward, or optimizer (gradient clipping, the update)."""
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            return "backward"
        return "forward" if len(self._mod_tracker.parents) > 1 else "optimizer"

    def peak_phase(self) -> str:
        """The phase of the step's overall peak."""
        return max(self.phase_peaks, key=lambda k: self.phase_peaks[k]["Total"])

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The tracker-wide peak only. torch also updates every tracked module's own peak on every op, a loop over
        all modules per op that makes a step quadratic in the model's size (minutes for a 135M model); shardfit
        reads no per-module peaks."""
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
        snap.setdefault(_LossRef.LOGITS, 0)
        super()._update_snap(u_type, winfo, *args, **kwargs)  # type: ignore[misc]
        snap = self._curr_mem_snap.get(winfo.device)
        if snap:
            best = self.phase_peaks.setdefault(self.phase(), {})
            if snap["Total"] > best.get("Total", -1):
                best.clear()
                best.update((getattr(k, "value", k), v) for k, v in snap.items())


class StepMemTracker(LossAttribution, MemTracker):
    """MemTracker with the loss's tensors filed as Logits."""


class StepFSDPMemTracker(LossAttribution, FSDPMemTracker):
    """FSDPMemTracker with the loss's tensors filed as Logits, and units whose forward did not run left alone.

    A simulated text step of a vision-language model runs the decoder only, so its towers' FSDP units are never
    gathered (training runs them on a blank input, a few kernels' worth); FSDP2's post-backward still visits them,
    and torch's tracker then reads an unsharded parameter that was never made. Such a unit has no gradient to
    file, so its post-backward runs untracked."""

    def _fsdp_param_group_post_backward(self, fsdp_mod: Any, orig: Any) -> Any:
        tracked = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        @functools.wraps(orig)
        def inner(*args: Any, **kwargs: Any) -> Any:
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 - what torch's tracker reads too
            if group is not None and not all(hasattr(p, "_unsharded_param") for p in group.fsdp_params):
                return orig(*args, **kwargs)
            return tracked(*args, **kwargs)

        return inner


def train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple,
               amp: Any = contextlib.nullcontext) -> None:
    """One training step as the training loop runs it: forward under `amp()`, backward, gradient clipping,
    optimizer step, gradients released."""
    with amp():
        loss, _ = module(*batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad()


def measure_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, tracker: Any,
                 steps: int = 2, amp: Any = contextlib.nullcontext) -> dict[str, float]:
    """Peak bytes per tracker category over `steps` training steps (GiB), each a `train_step`. The optimizer's
    states exist from the second step on: a caller that ran one step before making the tracker (which then finds
    the states) measures one step instead of two, at a little over half the cost."""
    with tracker:
        for _ in range(steps):
            train_step(module, optimizer, batch, amp)
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    out: dict[str, float] = {}
    for per_dev in peak.values():
        for k, v in per_dev.items():
            name = getattr(k, "value", k)
            out[name] = out.get(name, 0.0) + v / GIB
    return out


def to_breakdown(cats: dict[str, float], hw: Hardware, strategy: str) -> Breakdown:
    b = Breakdown()
    for name, gib in cats.items():
        col = COLUMNS.get(name)
        if col is not None:
            setattr(b, col, getattr(b, col) + gib)
    add_runtime_overhead(b, hw, strategy)
    return b
