"""What one use of a 4-bit weight costs a QLoRA step: the kernels and the bytes torchao's NF4 dequantization moves.

shardfit's QLoRA (models/quantize.py) stores every decoder linear weight as torchao's NF4Tensor and dequantizes it
with plain PyTorch ops for each matmul: in forward, in backward (the gradient of the layer's input needs the
weight), and once more where checkpointing recomputes the block. A TorchDispatchMode over one F.linear on an NF4
weight (a 4096 x 4096 weight, bf16, CPU: the op sequence and tensor sizes are the device's) counts the aten ops
that launch a kernel (views apart, as bench/dispatch_ops.py counts them) and the bytes each reads (its tensor
inputs) and writes (its outputs); the matmul itself is left out (a LoRA step runs it too). Per weight per use.
plan/dequant.py (DEQUANT) carries the figures this writes to bench/results/dequant_traffic.json.

`compiled` in the same file: the same dequantization under torch.compile (inductor, this machine's CPU backend):
the kernels inductor generated for it (its own count), whether the values are bit-equal to the eager ones (and
with inductor's emulate_precision_casts), the compile's seconds and both versions' milliseconds per use of a
1024 x 1024 weight (one thread). Inductor's CPU backend does not count bytes; a fused kernel reads the packed codes
and scales and writes the weight once.

    python bench/dequant_traffic.py
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
OUT = ROOT / "bench" / "results" / "dequant_traffic.json"
MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "t"}


def _bytes(values: object) -> int:
    """Bytes of every plain tensor among `values` (a subclass's inner tensors show up in their own ops)."""
    flat, _ = torch.utils._pytree.tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in flat if type(t) is torch.Tensor)


class TrafficCounter(TorchDispatchMode):
    """Kernels, views and the bytes the kernels read and write, matmuls left out."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view:
            self.n["views"] += 1
        elif name not in MATMULS:
            self.n["kernels"] += 1
            self.n["read"] += _bytes((args, kwargs))
            self.n["written"] += _bytes(out)
        return out


def measure(rows: int = 4096, cols: int = 4096) -> dict:
    from shardfit.models.quantize import to_nf4

    torch.manual_seed(0)
    w = to_nf4(torch.randn(rows, cols, dtype=torch.bfloat16), torch.bfloat16)
    x = torch.randn(8, cols, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)  # warm: first-call set-up is not per use
    counter = TrafficCounter()
    with counter:
        torch.nn.functional.linear(x, w)
    numel = rows * cols
    # the activations' own bytes in and out of the matmul are not the dequantization's
    return {"weight": [rows, cols], "dtype": "bf16", "kernels": counter.n["kernels"], "views": counter.n["views"],
            "bytes_per_weight": round((counter.n["read"] + counter.n["written"]) / numel, 2),
            "read_per_weight": round(counter.n["read"] / numel, 2),
            "written_per_weight": round(counter.n["written"] / numel, 2),
            "torch": torch.__version__}


def _ms(fn, w, reps: int = 20) -> float:
    fn(w)
    start = time.perf_counter()
    for _ in range(reps):
        fn(w)
    return (time.perf_counter() - start) / reps * 1e3


def measure_compiled(rows: int = 1024, cols: int = 1024) -> dict:
    """One dequantization compiled against eager: inductor's kernel count, bit-equality, times."""
    import torch._inductor.metrics as metrics

    from shardfit.models.quantize import to_nf4

    torch.manual_seed(0)
    w = to_nf4(torch.randn(rows, cols, dtype=torch.bfloat16), torch.bfloat16)

    def dequantize(t: torch.Tensor) -> torch.Tensor:
        return t.get_original_weight()

    compiled = torch.compile(dequantize)
    metrics.reset()
    start = time.perf_counter()
    out = compiled(w)
    compile_s = time.perf_counter() - start
    kernels = metrics.generated_kernel_count
    ref = dequantize(w)
    # inductor keeps the scale's product in fp32 and rounds once; eager rounds each bf16 step. Its
    # emulate_precision_casts rounds where eager does.
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        emulated = torch.compile(dequantize)(w)
    return {"weight": [rows, cols], "kernels": kernels, "bit_equal": torch.equal(out, ref),
            "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
            "bit_equal_emulating_casts": torch.equal(emulated, ref),
            "compile_s": round(compile_s, 1), "eager_ms": round(_ms(dequantize, w), 2),
            "compiled_ms": round(_ms(compiled, w), 2)}


def main() -> None:
    import torchao

    torch.set_num_threads(1)
    res = {**measure(), "torchao": torchao.__version__, "compiled": measure_compiled()}
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
