"""Count the aten ops the host dispatches once per optimizer step, outside the micro-batches: the optimizer's step,
gradient clipping, zero_grad, the learning-rate scheduler.

    python bench/optimizer_step_ops.py [--transformers-optimization PATH]
    # prints the table, writes bench/results/optimizer_step_ops.json

A TorchDispatchMode sees every aten op each call hands to the device, one call at a time, as bench/dispatch_ops.py
counts a micro-batch's. Each phase runs on tiny Llama models of 1 and 2 decoder layers (fp32, CPU) after a warm-up
step (the optimizer's states exist); the difference over the difference in parameter tensors is the count per
tensor, the rest the phase's fixed ops. Views are counted apart (host time, no kernel), and so are the ops on the
optimizer's `step` counters: torch keeps those on the host (a CPU tensor unless capturable or fused), so on a GPU
they launch no kernel. Those host ops are timed beside a view's (`host_op_us`): a counter's increment or read costs
the host about what a view does, far below a kernel's launch.

Implementations counted: torch's AdamW by its three loops (for-loop `foreach=False`, torch's default before 2.0;
`foreach`, the default on a GPU since 2.0; `fused`), with and without weight decay; clip_grad_norm_ by both of its
paths (one norm and one multiply per gradient, or foreach); zero_grad writing zeros (`set_to_none=False`, torch's
default before 2.0) or dropping the gradients. transformers' own AdamW (a Python loop over the parameters, removed
from transformers since) is counted from the release that ran it: `--transformers-optimization` names that
release's transformers/optimization.py (`pip download transformers==4.2.2 --no-deps`, unzipped); its AdamW class
is compiled from that file alone, so the count is of the code that ran. torch's SGD, RMSprop and Adagrad by
loop, transformers' and torch's Adafactor, each as the HF Trainer builds it. torchao's low-bit AdamW runs a
compiled function per tensor (one fused kernel, counted from the graph inductor generates) whose call the host
pays beyond the launch: timed (`host_op_us` `torchao_call_per_tensor`). plan/optimizer_launches.py carries the
figures.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.optimization import Adafactor

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "optimizer_step_ops.json"


class StepOpCounter(TorchDispatchMode):
    """Counts aten ops as views, ops on the optimizer's host-side step counters (`host_ids`: their tensors' ids),
    or kernels."""

    def __init__(self, host_ids: set[int]) -> None:
        super().__init__()
        self.host_ids = host_ids
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        lists = [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        on_host = [t for t in tensors + lists if id(t) in self.host_ids]
        if func.is_view:
            self.ops["view"] += 1
        elif on_host and len(on_host) == len(tensors + lists):
            self.ops["host"] += 1
        else:
            self.ops["kernel"] += 1
        return func(*args, **(kwargs or {}))


def tiny_model(layers: int) -> torch.nn.Module:
    """A tiny Llama of `layers` decoder layers (9 parameter tensors each, 3 outside them: embedding, final norm,
    head)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=layers, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).train()


def transformers_adamw(path: Path) -> type:
    """The AdamW class of the transformers release whose optimization.py is at `path`, compiled from that file's
    class alone (its module imports the rest of its own release)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AdamW")
    namespace: dict[str, Any] = {"torch": torch, "math": math, "Optimizer": torch.optim.Optimizer,
                                 "Callable": Callable, "Iterable": list, "Tuple": tuple, "warnings": None}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["AdamW"]


def backward(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def host_ids(opt: torch.optim.Optimizer) -> set[int]:
    """The ids of the optimizer's step counters that are tensors (torch's; transformers' AdamW keeps an int)."""
    return {id(s["step"]) for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)}


def phase_ops(layers: int, phase: str, make_opt: Callable[[list], torch.optim.Optimizer]) -> Counter[str]:
    """aten ops of one call of `phase` (optimizer step, clipping, zero_grad, scheduler) on a tiny model after a
    warm-up step, the gradients of a fresh backward in place."""
    model = tiny_model(layers)
    params = list(model.parameters())
    opt = make_opt(params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    backward(model)
    opt.step()
    sched.step()
    model.zero_grad(set_to_none=False)
    backward(model)
    calls = {
        "optimizer": opt.step,
        "clip_per_tensor": lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=False),
        "clip_foreach": lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=True),
        "zero_grad_zeros": lambda: model.zero_grad(set_to_none=False),
        "zero_grad_none": lambda: model.zero_grad(set_to_none=True),
        "scheduler": sched.step,
    }
    with StepOpCounter(host_ids(opt)) as c:
        calls[phase]()
    return c.ops


def per_tensor(phase: str, make_opt: Callable[[list], torch.optim.Optimizer]) -> dict[str, float]:
    """The phase's ops per parameter tensor (2-layer count minus 1-layer count over the tensors between them) and
    its fixed ops, by kind."""
    tensors = {n: len(list(tiny_model(n).parameters())) for n in (1, 2)}
    one, two = (phase_ops(n, phase, make_opt) for n in (1, 2))
    out: dict[str, float] = {"tensors_1_layer": tensors[1]}
    for kind in ("kernel", "view", "host"):
        slope = (two[kind] - one[kind]) / (tensors[2] - tensors[1])
        out[f"per_tensor_{kind}"] = slope
        out[f"fixed_{kind}"] = one[kind] - slope * tensors[1]
    return out


def optimizers(hf_path: Path | None) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    """The optimizer implementations counted, by name."""
    out: dict[str, Callable[[list], torch.optim.Optimizer]] = {}
    for wd in (0.0, 0.01):
        tag = "" if wd else "/no_decay"
        out[f"torch_for_loop{tag}"] = lambda p, wd=wd: torch.optim.AdamW(p, lr=1e-3, weight_decay=wd, foreach=False)
        out[f"torch_foreach{tag}"] = lambda p, wd=wd: torch.optim.AdamW(p, lr=1e-3, weight_decay=wd, foreach=True)
        out[f"torch_fused{tag}"] = lambda p, wd=wd: torch.optim.AdamW(p, lr=1e-3, weight_decay=wd, fused=True)
    # torch's other optimizers as the HF Trainer builds them (their defaults: no weight decay, SGD without momentum)
    # by loop, and both Adafactors: transformers' as the Trainer builds it (`scale_parameter` and `relative_step`
    # off), torch's (foreach off by default).
    for name, cls in (("sgd", torch.optim.SGD), ("rmsprop", torch.optim.RMSprop), ("adagrad", torch.optim.Adagrad)):
        for loop, foreach in (("for_loop", False), ("foreach", True)):
            out[f"torch_{name}_{loop}"] = lambda p, cls=cls, foreach=foreach: cls(p, lr=1e-3, foreach=foreach)
    out["transformers_adafactor"] = lambda p: Adafactor(p, lr=1e-3, scale_parameter=False, relative_step=False)
    out["torch_adafactor"] = lambda p: torch.optim.Adafactor(p, lr=1e-3)
    if hf_path is not None:
        adamw = transformers_adamw(hf_path)
        out["transformers/no_decay"] = lambda p: adamw(p, lr=1e-3, weight_decay=0.0)
        out["transformers"] = lambda p: adamw(p, lr=1e-3, weight_decay=0.01)
    return out


def host_op_us(rounds: int = 100_000) -> dict[str, float]:
    """Microseconds the host spends on one op of the kinds counted apart, timed here: a step counter's increment
    and its read (a 0-dim CPU tensor, as torch keeps it beside a GPU's states), a view, and a CPU kernel on a
    4-element tensor; plan/step_ops.py prices the counters' ops as views from this."""
    import time

    step, x = torch.tensor(5.0), torch.zeros(4)
    ops = {"step_increment": lambda: step.add_(1), "step_read": step.item, "view": lambda: x.view(-1),
           "cpu_kernel": lambda: x.mul_(1.0)}
    out = {}
    for name, op in ops.items():
        start = time.perf_counter()
        for _ in range(rounds):
            op()
        out[name] = round((time.perf_counter() - start) / rounds * 1e6, 3)
    return out


def single_param_adam_call_us(side: int = 4, tensors: int = 8, rounds: int = 30) -> float | None:
    """Microseconds the host spends per tensor in torchao's low-bit AdamW step (where torchao is installed): it
    calls a `torch.compile`d function once per tensor, whose guards and wrappers the host runs each time beyond
    the kernel it launches. Timed on `side` x `side` tensors (below torchao's 4096 elements for 8-bit states, so
    the fused kernel's own work is a few elements) after warm-up steps that compile it."""
    import time

    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return None
    params = [torch.nn.Parameter(torch.randn(side, side)) for _ in range(tensors)]
    opt = AdamW8bit(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    for _ in range(5):
        opt.step()
    start = time.perf_counter()
    for _ in range(rounds):
        opt.step()
    return round((time.perf_counter() - start) / rounds / tensors * 1e6, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transformers-optimization", type=Path, default=None,
                    help="transformers/optimization.py of a release that has transformers' own AdamW")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"torch": torch.__version__, "counts": {}}
    if args.transformers_optimization is not None:
        text = args.transformers_optimization.read_bytes()
        result["transformers_optimization_sha256"] = hashlib.sha256(text).hexdigest()
    impls = optimizers(args.transformers_optimization)
    rows = [(f"optimizer/{name}", "optimizer", make) for name, make in impls.items()]
    plain = optimizers(None)["torch_foreach"]
    rows += [(phase, phase, plain) for phase in
             ("clip_per_tensor", "clip_foreach", "zero_grad_zeros", "zero_grad_none", "scheduler")]
    for name, phase, make in rows:
        r = per_tensor(phase, make)
        result["counts"][name] = r
        print(f"{name:32s} per tensor: {r['per_tensor_kernel']:5.2f} kernels, {r['per_tensor_view']:5.2f} views, "
              f"{r['per_tensor_host']:5.2f} host; fixed: {r['fixed_kernel']:5.1f} kernels, "
              f"{r['fixed_view']:5.1f} views, {r['fixed_host']:5.1f} host", flush=True)
    result["host_op_us"] = host_op_us()
    result["host_op_us"]["torchao_call_per_tensor"] = single_param_adam_call_us()
    print("host op microseconds:", result["host_op_us"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
