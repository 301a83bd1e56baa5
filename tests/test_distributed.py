"""Real 2-rank gloo runs of the CLI (`shardfit train --nproc 2`): every strategy, placement rules, resume, restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardfit.parallel import launch
from shardfit.parallel.allocator import PRELOADED_ENV, choose, gpu_host
from tests.helpers import free_port, read_jsonl, run_cli, run_here, train_here, write_config

pytestmark = pytest.mark.slow
ENV = {"OMP_NUM_THREADS": "1"}
BASE = dict(method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=3,
            max_steps=6, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, eval_steps=100)


def _cfg(tmp: Path, model: Path, data: Path, name: str, **over) -> Path:
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp / name))
    keys.update(over)
    return write_config(tmp / f"{name}.yaml", **keys)


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


def _weights(run: Path, method: str) -> dict[str, torch.Tensor]:
    f = run / "adapter" / "adapter_model.safetensors" if method == "lora" else run / "model" / "model.safetensors"
    return load_file(str(f))


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, tiny_llama: Path, small_data: Path) -> dict[str, Path]:
    """The single-process reference with the same global batch (2 rows x 2 accumulation steps)."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for method in ("lora", "full"):
        cfg = _cfg(tmp, tiny_llama, small_data, f"single-{method}", method=method, grad_accum=2,
                   lr=1e-2 if method == "lora" else 1e-3)
        train_here(cfg)
        out[method] = tmp / f"single-{method}"
    return out


@pytest.fixture(scope="module")
def zero3_lora_run(tmp_path_factory, tiny_llama: Path, small_data: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """The 2-rank zero3 LoRA run (its launch and its run directory), launched once: the strategy matrix compares it
    with one process, the resume test finishes a copy of it on one process."""
    tmp = tmp_path_factory.mktemp("zero3-lora")
    cfg = _cfg(tmp, tiny_llama, small_data, "run", method="lora", strategy="zero3", lr=1e-2)
    return run_cli("train", str(cfg), "--nproc", "2", env=ENV), tmp / "run"


@pytest.fixture(scope="module")
def ddp_lora_run(tmp_path_factory, tiny_llama: Path, small_data: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """The 2-rank DDP LoRA run, its config asking for `device_map: auto` (which shardfit ignores under DDP, saying
    so once), launched once: the strategy matrix compares it with one process, the device_map test reads its
    warning. Each is a whole launch of its own otherwise."""
    tmp = tmp_path_factory.mktemp("ddp-lora")
    cfg = _cfg(tmp, tiny_llama, small_data, "run", method="lora", strategy="ddp", lr=1e-2, device_map="auto")
    return run_cli("train", str(cfg), "--nproc", "2", env=ENV), tmp / "run"


# zero2 and zero3_offload train a full fine-tune as zero3 does, save where the optimizer state lives; DDP
# all-reduces a full fine-tune's gradients as it does LoRA's (ddp-lora holds it): heavy.
HEAVY_PAIRS = (("zero2", "full"), ("zero3_offload", "full"), ("ddp", "full"), ("zero2", "lora"))


@pytest.mark.parametrize("strategy,method", [
    pytest.param(s, m, marks=pytest.mark.heavy) if (s, m) in HEAVY_PAIRS else (s, m)
    for s in ("ddp", "zero2", "zero3", "zero3_offload") for m in ("lora", "full")])
def test_strategy_matches_single_process(tmp_path: Path, tiny_llama: Path, small_data: Path, single_runs,
                                         request: pytest.FixtureRequest, strategy: str, method: str) -> None:
    if (strategy, method) == ("zero3", "lora"):  # the same config the resume test starts from: one launch for both
        r, run = request.getfixturevalue("zero3_lora_run")
    elif (strategy, method) == ("ddp", "lora"):  # the device_map test's launch too
        r, run = request.getfixturevalue("ddp_lora_run")
    else:
        cfg = _cfg(tmp_path, tiny_llama, small_data, "run", method=method, strategy=strategy,
                   lr=1e-2 if method == "lora" else 1e-3)
        r, run = run_cli("train", str(cfg), "--nproc", "2", env=ENV), tmp_path / "run"
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = _losses(single_runs[method]), _losses(run)
    assert len(got) == len(ref) == 6
    for a, b in zip(ref, got, strict=True):
        assert b == pytest.approx(a, rel=1e-5)  # fp32 on both sides: only reduction order differs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    # The launcher re-executed itself with this host's faster malloc, and the ranks inherited it.
    expected = choose({k: v for k, v in os.environ.items() if k != PRELOADED_ENV}, gpu=gpu_host())
    assert summary["allocator"] == (expected.name if expected else "system")
    # A sharded parameter counts once, not once per rank; the start line says how big a step is.
    single = json.loads((single_runs[method] / "summary.json").read_text())
    assert summary["trainable_params"] == single["trainable_params"]
    assert "global batch 4 examples (micro_batch 2 x grad_accum 1 x 2 ranks)" in r.stdout
    # micro_batch counts examples with packing on: 64 examples / (2 x 1 x 2 ranks) steps per epoch.
    assert summary["steps_per_epoch"] == single["steps_per_epoch"] == 16 and summary["examples_per_step"] == 4
    assert len(read_jsonl(run / "metrics.jsonl")[-1]["mem_gib"]) == 2  # memory of each rank
    want, have = _weights(single_runs[method], method), _weights(run, method)
    assert want.keys() == have.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-4, atol=1e-5)


def test_device_map_is_overridden_or_refused(tmp_path: Path, tiny_llama: Path, small_data: Path, ddp_lora_run,
                                            capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = ddp_lora_run  # 2 DDP ranks of a config with device_map: auto
    assert r.returncode == 0, r.stderr[-3000:]
    # One cause, one warning: the preflight's rule, saying it is ignored (fixed) and how to make it an error.
    assert r.stderr.count("device_map_in_distributed") == 1 and "shardfit ignores it" in r.stderr
    assert "[fixed]" in r.stderr
    # strict: refused before any rank starts, so in this process; a launch is recorded, never run
    launched: list[list[str]] = []
    monkeypatch.setattr(launch, "relaunch", lambda cmd, env: launched.append(cmd) or 0)
    cfg = _cfg(tmp_path, tiny_llama, small_data, "dm", device_map="auto", max_steps=2, strategy="ddp")
    code, _, err = run_here(capsys, "train", str(cfg), "--nproc", "2", "--set", "strict=true")
    assert code == 2 and not launched, err[-3000:]
    assert "splits one process's model over several GPUs" in err and "Traceback" not in err.split(
        "shardfit: error")[-1]


def test_zero3_checkpoint_resumes_on_other_world_size(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                      zero3_lora_run, capsys: pytest.CaptureFixture) -> None:
    r, trained = zero3_lora_run  # 6 steps of zero3 LoRA on 2 ranks, a checkpoint every 3
    assert r.returncode == 0, r.stderr[-3000:]
    # A copy of the run under this config's output_dir (the checkpoints hold no path): the module's run stays whole.
    cfg = _cfg(tmp_path, tiny_llama, small_data, "rs", strategy="zero3")
    run = tmp_path / "rs"
    shutil.copytree(trained, run)
    two_rank = _weights(run, "lora")
    # Forget everything after step 3, then finish on ONE process (same global batch via accumulation).
    shutil.rmtree(run / "checkpoints" / "step-6")
    shutil.rmtree(run / "adapter")
    # One process launches nothing: it resumes in this one (the CLI's `main`), without a new interpreter's start-up.
    code, _, err = run_here(capsys, "train", str(cfg), "--set", "grad_accum=2")
    assert code == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 3
    one_rank = _weights(run, "lora")
    for k in two_rank:
        torch.testing.assert_close(one_rank[k], two_rank[k], rtol=1e-4, atol=1e-5)


# test_audio's zero3 case trains a tiny Qwen2.5-Omni on two zero3 ranks too (a text-only row on one of them), its
# adapter without talker or token2wav, and holds check's findings equal to those its launch applied: heavy.
@pytest.mark.heavy
def test_qwen_omni_text_model_trains_under_zero3(tmp_path: Path, tiny_omni: Path, small_data: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    cfg = _cfg(tmp_path, tiny_omni, small_data, "omni", strategy="zero3", max_steps=3)
    r = run_cli("train", str(cfg), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "talker and token2wav not loaded" in r.stderr
    run = tmp_path / "omni"
    assert len(_losses(run)) == 3 and (run / "adapter" / "adapter_model.safetensors").is_file()
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert adapter and not any("talker" in k or "token2wav" in k for k in adapter)
    # `check` builds the same model and runs the same preflight: it exits 0 with exactly the findings train applied.
    # It launches no ranks, so it runs in this process (the CLI's `main`), without a second start-up.
    code, out, err = run_here(capsys, "check", str(cfg), "--nproc", "2", "--json")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    checked = json.loads(out)
    applied = json.loads((run / "preflight.json").read_text())
    assert checked["ok"] is applied["ok"] is True and applied["strategy"] == "zero3"

    def key(f: dict) -> tuple:
        return f["rule"], f["where"], f["severity"], f["auto_fixed"]

    assert sorted(map(key, checked["findings"])) == sorted(map(key, applied["findings"]))


def _worker_pid(marker: str, local_rank: int) -> int | None:
    """The torchrun worker whose command line holds `marker` and whose LOCAL_RANK is `local_rank` (Linux /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"torch.distributed.run" not in cmdline \
                and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.heavy  # test_training holds resume equality; this, torchrun's restart of a killed group
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank to kill through /proc")
def test_killed_rank_restarts_and_ends_equal_to_clean_run(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    over = dict(strategy="zero3", max_steps=12, save_steps=3)
    clean = _cfg(tmp_path, tiny_llama, small_data, "clean", **over)
    r = run_cli("train", str(clean), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]

    killed = _cfg(tmp_path, tiny_llama, small_data, "killed", **over)
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "train", str(killed), "--nproc", "2",
                             "--max-restarts", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **ENV}, text=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-3" / "trainer.pt").exists() and time.time() < deadline:
        time.sleep(0.02)
    victim = _worker_pid(str(killed), local_rank=1)
    assert victim is not None, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the restarted group did not finish") from None
    assert proc.returncode == 0, err[-3000:]
    assert "local_rank: 1" in err and "exitcode: -9" in err  # torchrun saw the kill and restarted the group
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 3
    want, have = _weights(tmp_path / "clean", "lora"), _weights(run, "lora")
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=0)  # same world size, same order: bit-exact
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert steps == list(range(1, 13))



def _two_nodes(cfgs: list[Path], rendezvous: str, cwds: list[Path] | None = None) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine, one rank each, as two nodes would run them."""
    port = free_port()
    procs = []
    for node, cfg in enumerate(cfgs):
        link = (["--rdzv-endpoint", f"127.0.0.1:{port}"] if rendezvous == "c10d" else
                ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)])
        procs.append(subprocess.Popen([sys.executable, "-m", "shardfit", "train", str(cfg), "--nproc", "1",
                                       "--nnodes", "2", *link], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, **ENV}, cwd=cwds[node] if cwds else None))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("rendezvous", [pytest.param("static", marks=pytest.mark.heavy), "c10d"])
def test_two_node_launch_matches_single_process(tmp_path: Path, tiny_llama: Path, small_data: Path, single_runs,
                                                rendezvous: str) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, "mn", strategy="zero3")
    results = _two_nodes([cfg, cfg], rendezvous)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "mn"
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    for a, b in zip(_losses(single_runs["lora"]), _losses(run), strict=True):
        assert b == pytest.approx(a, rel=1e-5)


def test_two_nodes_without_shared_output_dir_is_refused(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    cfgs = []
    for d in cwds:
        d.mkdir()
        cfgs.append(write_config(d / "c.yaml", **dict(BASE, model=str(tiny_llama), data=str(small_data),
                                                      output_dir="run", strategy="zero3")))
    results = _two_nodes(cfgs, "static", cwds)
    assert all(r.returncode != 0 for r in results)
    assert "is not shared: 1 of 2 ranks cannot see" in results[0].stderr
    assert not (cwds[0] / "run" / "checkpoints").exists()


@pytest.mark.heavy  # test_grad_sync holds zero3's reduce-scatter every micro-batch
def test_zero3_accumulating_micro_batches_matches_single_process(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                                single_runs) -> None:
    """A full fine-tune under zero3 with grad_accum 2 (a reduce-scatter per micro-batch, the gradient accumulating
    as shards): the same losses and weights as one process with the same 4 examples per step."""
    cfg = _cfg(tmp_path, tiny_llama, small_data, "run", method="full", strategy="zero3", micro_batch=1, grad_accum=2,
               lr=1e-3)
    r = run_cli("train", str(cfg), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    for a, b in zip(_losses(single_runs["full"]), _losses(tmp_path / "run"), strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    want, have = _weights(single_runs["full"], "full"), _weights(tmp_path / "run", "full")
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.heavy  # test_strategy_matches_single_process[zero3-lora] holds zero3 LoRA; this, an untied embedding unit
@pytest.mark.parametrize("method", ["lora", "full"])
def test_zero3_untied_embedding_unit_matches_single_process(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                                            method: str) -> None:
    """An untied input embedding is its own FSDP2 unit; with full fine-tuning its gradient crosses that unit."""
    lr = 1e-2 if method == "lora" else 1e-3
    single = _cfg(tmp_path, tiny_qwen2, small_data, "single", method=method, grad_accum=2, lr=lr)
    train_here(single)
    sharded = _cfg(tmp_path, tiny_qwen2, small_data, "zero3", method=method, strategy="zero3", lr=lr)
    r = run_cli("train", str(sharded), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    for a, b in zip(_losses(tmp_path / "single"), _losses(tmp_path / "zero3"), strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    want, have = _weights(tmp_path / "single", method), _weights(tmp_path / "zero3", method)
    assert want.keys() == have.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.heavy  # test_training holds compiled == eager on one process; this, compiled units under zero3
def test_zero3_with_compiled_blocks_matches_single_process(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                           single_runs) -> None:
    """torch.compile'd blocks under FSDP2 (compile first, then shard, as torchtitan does) on 2 ranks."""
    cfg = _cfg(tmp_path, tiny_llama, small_data, "run", strategy="zero3", compile=True)
    r = run_cli("train", str(cfg), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = _losses(single_runs["lora"]), _losses(tmp_path / "run")
    assert len(got) == len(ref) == 6
    for a, b in zip(ref, got, strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    want, have = _weights(single_runs["lora"], "lora"), _weights(tmp_path / "run", "lora")
    assert want.keys() == have.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-3, atol=1e-5)
