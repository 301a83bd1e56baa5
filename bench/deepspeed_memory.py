"""DeepSpeed ZeRO's per-rank tensor memory, measured: real training steps of a DeepSpeed engine on gloo ranks
(CPU), every tensor allocation tracked, against `shardfit plan --from deepspeed`'s estimate of the same job.

Run under torchrun (2 ranks), or without it to launch itself that way:

    python bench/deepspeed_memory.py                      # every case below, writes bench/results/deepspeed_memory.json
    python bench/deepspeed_memory.py --cases tiny-z3 --out /tmp/x.json

Each case builds a Llama-architecture model from a config (no weights needed), the way the HF Trainer does
under DeepSpeed (ZeRO-3: constructed inside `deepspeed.zero.Init`, so no rank ever holds the whole model), hands
it with a client torch AdamW (what the Trainer passes when the DeepSpeed JSON has no optimizer section, as
LLaMA-Factory's shipped ones do) to `deepspeed.initialize`, and runs 3 steps over random tokens with the model's
own loss. What is tracked: the bytes of every live tensor storage on the rank (a dispatch mode sees each
allocation, a weak reference each free), not the process's RSS. On a CPU "device" and "host" are one memory, so
for offload cases the measured total is device + host; the offloaded part is reported separately from the
engine's optimizer state.

Needs `deepspeed` (pip install -c constraints.txt deepspeed==0.19.8, or `pip install .[deepspeed]`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

# Model shapes (Llama architecture): tiny is the test suite's tiny model, small a 14.8M-parameter one whose
# blocks are above DeepSpeed's default persistence threshold.
MODELS = {
    "tiny": dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}


def _zero(stage: int, offload: bool, **extra: Any) -> dict:
    z: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                         "reduce_bucket_size": 2e6, "allgather_bucket_size": 2e6}
    if stage == 3:
        z.update({"stage3_prefetch_bucket_size": 1e6, "stage3_param_persistence_threshold": 1e4,
                  "stage3_max_live_parameters": 1e9})
    if offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if stage == 3:
            z["offload_param"] = {"device": "cpu", "pin_memory": False}
    z.update(extra)
    return z


# name -> (model, method, seq, micro-batch, DeepSpeed JSON). Bucket sizes are scaled to the models (a 2e6-element
# bucket is to a 15M model what DeepSpeed's 5e8 default is to a 7B one).
CASES: dict[str, tuple[str, str, int, int, dict]] = {
    "tiny-z2": ("tiny", "full", 128, 2, {"zero_optimization": _zero(2, False)}),
    "tiny-z3": ("tiny", "full", 128, 2, {"zero_optimization": _zero(3, False)}),
    "tiny-z2-offload": ("tiny", "full", 128, 2, {"zero_optimization": _zero(2, True)}),
    "tiny-z3-offload": ("tiny", "full", 128, 2, {"zero_optimization": _zero(3, True)}),
    "small-z2": ("small", "full", 256, 1, {"zero_optimization": _zero(2, False)}),
    "small-z3": ("small", "full", 256, 1, {"zero_optimization": _zero(3, False)}),
    "small-z2-offload": ("small", "full", 256, 1, {"zero_optimization": _zero(2, True)}),
    "small-z3-offload": ("small", "full", 256, 1, {"zero_optimization": _zero(3, True)}),
    "small-z3-lora": ("small", "lora", 256, 1, {"zero_optimization": _zero(3, False)}),
    # Short rows, so that the optimizer step is the peak: torch AdamW's multi-tensor kernel (what torch picks on a
    # GPU, and what the HF Trainer's `adamw_torch` hands DeepSpeed) over the flat fp32 partition; ZeRO-3 also with
    # sub-groups smaller than the partition (`sub_group_size`), stepped one at a time.
    "small-z2-step": ("small", "full", 16, 1, {"zero_optimization": _zero(2, False)}),
    "small-z3-step": ("small", "full", 16, 1, {"zero_optimization": _zero(3, False)}),
    "small-z3-subgroups": ("small", "full", 16, 1, {"zero_optimization": _zero(3, False, sub_group_size=2e6)}),
}
# Cases stepped by torch AdamW's multi-tensor (foreach) kernel; the others by its for-loop kernel, one tensor at a
# time (foreach=False).
FOREACH = ("small-z2-step", "small-z3-step", "small-z3-subgroups")
TEST_CASES = ("tiny-z2", "tiny-z3", "tiny-z2-offload", "tiny-z3-offload")


def ds_config(case: str) -> dict:
    """The complete DeepSpeed JSON of a case (bf16 on, one micro-batch per step, gradient clipping as the Trainer
    sets it)."""
    _, _, _, batch, extra = CASES[case]
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
            "wall_clock_breakdown": False, **extra}


class LiveTensors:
    """Bytes of live tensor storages: every op's outputs (and in-place inputs, which may resize) are recorded under
    their storage; a weak reference to the storage takes its bytes off when it is freed."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                tracker._see(out)
                if func._schema.is_mutable:
                    tracker._see(args)
                return out

        self.mode = _Mode()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = 0
        self.peak = 0

    def _see(self, obj: Any) -> None:
        import torch

        if isinstance(obj, (list, tuple)):
            for o in obj:
                self._see(o)
            return
        if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
            return
        st = obj.untyped_storage()
        key, n = st._cdata, st.nbytes()
        old = self.sizes.get(key)
        if old is None:
            self.refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
            old = 0
        self.sizes[key] = n
        self.now += n - old
        self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def track(self, tensors: Any) -> None:
        """Count tensors made before tracking began."""
        self._see(list(tensors))

    def reset_peak(self) -> None:
        self.peak = self.now


def run_case(case: str) -> dict:
    """One case on this rank: returns its measurements in bytes."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    model_name, method, seq, batch, _ = CASES[case]
    cfg = ds_config(case)
    stage = cfg["zero_optimization"]["stage"]
    torch.manual_seed(0)
    live = LiveTensors()
    config = LlamaConfig(max_position_embeddings=max(seq, 512), **MODELS[model_name])
    config._attn_implementation = "sdpa"
    with live.mode:
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.bfloat16):
                model = LlamaForCausalLM(config)
        else:
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        if method == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=case in FOREACH)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        after_init = live.now
        live.reset_peak()
        gen = torch.Generator().manual_seed(dist.get_rank())
        step_peaks, optimizer_peaks = [], []
        for _ in range(3):
            ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            # the optimizer step's own peak, apart from forward and backward's
            before, live.peak = live.peak, live.now
            engine.step()
            optimizer_peaks.append(live.peak)
            live.peak = max(before, live.peak)
            step_peaks.append(live.peak)
        end = live.now
    host = _offloaded_bytes(engine) if _offloads(cfg) else 0
    out = {"case": case, "rank": dist.get_rank(), "after_init": after_init, "peak": live.peak,
           "step_peaks": step_peaks, "optimizer_peaks": optimizer_peaks, "end": end, "offloaded": host}
    engine.destroy()
    del engine, model, optimizer
    return out


def _offloads(cfg: dict) -> bool:
    return bool(cfg["zero_optimization"].get("offload_optimizer"))


def _offloaded_bytes(engine: Any) -> int:
    """The optimizer's host-resident tensors (fp32 partition, its gradient, the AdamW states), read from the
    engine's optimizer: what an offloading run keeps in host RAM instead of on the GPU."""
    import torch

    opt = engine.optimizer
    seen: dict[int, int] = {}
    groups = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat",
                                                                              [])
    for t in groups:
        for x in (t, t.grad):
            if isinstance(x, torch.Tensor):
                seen[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
    for state in opt.optimizer.state.values():
        for x in state.values():
            if isinstance(x, torch.Tensor) and x.numel() > 1:
                seen[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
    return sum(seen.values())


def worker(case: str, out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    mine = run_case(case)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"case": case, "world": dist.get_world_size(), "ranks": every}))
    dist.barrier()
    dist.destroy_process_group()


def launch(cases: list[str], out: str, nproc: int = 2) -> dict:
    """Run each case under its own torchrun with `nproc` gloo ranks (a second engine in the same process group
    hangs DeepSpeed's CPU collectives); returns and writes every case's measurements."""
    import deepspeed

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), DS_ACCELERATOR="cpu",
               PYTHONWARNINGS="ignore")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            part = Path(tmp) / f"{case}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
                   __file__, "--worker", "--cases", case, "--out", str(part)]
            _run_ranks(cmd, env, case)
            results.append(json.loads(part.read_text()))
    report = {"deepspeed": deepspeed.__version__, "results": results}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    return report


def _run_ranks(cmd: list[str], env: dict, case: str, tries: int = 2) -> None:
    """Run one case's torchrun; a failed launch is tried once more (torchrun's standalone rendezvous can lose its
    port to another process between choosing and binding it), and a second failure raises with the ranks' last
    output, so that a CI log shows why."""
    for attempt in range(1, tries + 1):
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=900, check=False)
        if done.returncode == 0:
            return
        tail = "\n".join(done.stderr.splitlines()[-40:])
        print(f"bench case {case}: try {attempt} of {tries} exited {done.returncode}:\n{tail}", file=sys.stderr)
    raise RuntimeError(f"bench case {case} failed {tries} times; its ranks' last output:\n{tail}")


def shape_of(model: str):  # noqa: ANN201 - shardfit's ModelShape
    """The planner's shape of a bench model."""
    from shardfit.plan.shapes import ModelShape

    m = MODELS[model]
    return ModelShape(model, m["num_hidden_layers"], m["hidden_size"], m["intermediate_size"],
                      m["num_attention_heads"], m["num_key_value_heads"], m["vocab_size"], m["tie_word_embeddings"])


def estimate_case(case: str, world: int = 2) -> dict:
    """What `shardfit plan --from deepspeed` predicts for a case, in bytes per rank: the step's tensor peak on the
    device plus what offload keeps on the host (one memory on a CPU), the same between steps, and the offloaded
    optimizer state."""
    from shardfit.foreign.deepspeed import read_deepspeed
    from shardfit.plan.deepspeed import estimate_deepspeed
    from shardfit.plan.hardware import Hardware
    from shardfit.plan.workload import Workload

    model, method, seq, batch, _ = CASES[case]
    shape = shape_of(model)
    zero = read_deepspeed(ds_config(case), case, shape.hidden).zero
    # The model's own loss (transformers 5); no mask: rows without padding go to SDPA's causal kernel. The
    # planner's multi-tensor AdamW (`fused_adamw` off) is what the FOREACH cases run; the others run torch's
    # one-tensor-at-a-time kernel (a temporary per tensor, not a copy of the partition) and peak in backward: the
    # copy planned at their step stays under their peak, and their step's own figure over-counts it.
    w = Workload(method=method, precision="bf16", seq_len=seq, micro_batch=batch, grad_ckpt="full", loss="full",
                 attention="flash")
    c = estimate_deepspeed(shape, w, Hardware(1, world, 80.0), zero)
    b = c.per_gpu_gib
    tensors = b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries
    gib = 2**30
    return {"peak": (tensors + c.cpu_gib) * gib, "between_steps": (c.extra["between_steps_gib"] + c.cpu_gib) * gib,
            "offloaded": c.extra["host_optimizer_gib"] * gib, "phase": c.peak_phase,
            "optimizer_step": (c.extra["optimizer_step_gib"] + c.cpu_gib) * gib}


def compare(report: dict) -> list[dict]:
    """Measured against estimated, per case and rank: relative errors of the peak, the memory between steps and
    the offloaded optimizer state."""
    rows = []
    for r in report["results"]:
        est = estimate_case(r["case"], r["world"])
        for m in r["ranks"]:
            row = {"case": r["case"], "rank": m["rank"], "measured_peak_mib": m["peak"] / 2**20,
                   "estimated_peak_mib": est["peak"] / 2**20, "peak_error": est["peak"] / m["peak"] - 1,
                   "between_steps_error": est["between_steps"] / m["end"] - 1, "estimated_phase": est["phase"]}
            if m["offloaded"]:
                row["offloaded_error"] = est["offloaded"] / m["offloaded"] - 1
            if "optimizer_peaks" in m:  # the optimizer step's own peak, where it was recorded
                row["optimizer_step_error"] = est["optimizer_step"] / max(m["optimizer_peaks"]) - 1
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<18}{'rank':>5}{'measured MiB':>14}{'estimated MiB':>15}{'peak err':>10}{'between':>9}"
          f"{'offload':>9}")
    for r in rows:
        off = f"{r['offloaded_error']:+.1%}" if "offloaded_error" in r else "-"
        print(f"{r['case']:<18}{r['rank']:>5}{r['measured_peak_mib']:>14.1f}{r['estimated_peak_mib']:>15.1f}"
              f"{r['peak_error']:>+10.1%}{r['between_steps_error']:>+9.1%}{off:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "deepspeed_memory.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compare", default=None, metavar="JSON", help="only compare a measured file with the estimate")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.compare:
        print_table(compare(json.loads(Path(args.compare).read_text())))
    elif args.worker:
        worker(cases[0], args.out)
    else:
        print_table(compare(launch(cases, args.out)))


if __name__ == "__main__":
    main()
