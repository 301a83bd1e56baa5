"""Single-process training end to end: methods, outputs, PEFT reload, merged export, kill-and-resume."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from shardfit.config import load_config
from shardfit.parallel.env import cpu_matmul_gflops, init_distributed
from shardfit.plan.estimate import loss_chunk_for
from shardfit.plan.hardware import job_hardware
from shardfit.train.recipe import train
from tests.helpers import ROOT, read_jsonl, run_here, train_here, write_config

BASE = dict(method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=4,
            eval_steps=100, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, resume="auto")


def _cfg(tmp_path: Path, model: Path, data: Path, **over) -> Path:
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp_path / "run"))
    keys.update(over)
    return write_config(tmp_path / "c.yaml", **keys)


def test_lora_run_outputs_and_peft_reload(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(_cfg(tmp_path, tiny_llama, small_data, max_steps=6, eval_split=0.1))
    result = train(cfg, init_distributed(), quiet=True)
    run = result.run_dir
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors", "checkpoints/step-6/trainer.pt"):
        assert (run / name).exists(), name
    # Everything docs/reference.md lists for a run directory is there, and nothing the run wrote is unlisted.
    layout = (ROOT / "docs" / "reference.md").read_text().split("<!-- run-dir")[1].split("<!-- end: run-dir")[0]
    entries = dict(re.findall(r"^(\S+?)/?\s{2,}(.*)$", layout.split("```")[1], re.M))
    required = {name for name, what in entries.items() if "(only when" not in what}
    present = {p.name for p in run.iterdir()}
    assert required <= present <= set(entries), (required - present, present - set(entries))
    # The adapter names a base that loads anywhere: the config's model, as an absolute path when it is a folder.
    adapter_cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(tiny_llama.resolve())
    # The checkpoint holds what trains and its optimizer state, not the frozen base (the tied head included).
    saved = FileSystemReader(run / "checkpoints" / "step-6").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("train.model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in model_keys if "lora_" not in k]
    preflight = json.loads((run / "preflight.json").read_text())
    assert preflight["strategy"] == "single" and preflight["ok"] is True
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mem_gib", "wall_s"):
        assert key in metrics[0]
    assert metrics[-1]["tokens"] > metrics[0]["tokens"] > 0 and isinstance(metrics[0]["mem_gib"], list)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((run / "summary.json").read_text())
    for key in ("steps", "train_loss", "eval_loss", "tokens_per_s", "peak_mem_gib", "wall_s", "strategy",
                "world_size", "resumed_from_step", "trainable_params", "tokens", "skipped_rows"):
        assert key in summary
    assert summary["strategy"] == "single" and summary["world_size"] == 1 and summary["eval_loss"] is not None

    ids = torch.tensor([[1, 100, 200, 300, 400]])
    result.model.eval()
    with torch.no_grad():
        want = result.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        untouched = base(input_ids=ids).logits
        reloaded = PeftModel.from_pretrained(base, run / "adapter")
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(untouched, want, atol=1e-4)  # the adapter changed the model

    code, _, err = run_here(capsys, "export", str(run), "--merge", "--dtype", "fp32", "--out", str(tmp_path / "merged"))
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        gen_a = merged.generate(ids, max_new_tokens=8, do_sample=False)
        gen_b = result.model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert gen_a.tolist() == gen_b.tolist()


def test_full_finetune_saves_hf_model(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    cfg = load_config(_cfg(tmp_path, tiny_qwen2, small_data, method="full", lr=1e-3, max_steps=4,
                           grad_ckpt="full", precision="bf16"))
    result = train(cfg, init_distributed(), quiet=True)

    saved = AutoModelForCausalLM.from_pretrained(result.run_dir / "model", dtype=torch.float32)
    before = load_file(str(tiny_qwen2 / "model.safetensors"))
    after = saved.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v.float(), after[k].float())]
    assert len(changed) == len(before)  # every weight trains in a full fine-tune
    # `loss_chunk: auto` from the model's vocabulary and this machine's card, as the plan decides it.
    rates = (cpu_matmul_gflops(torch.float32), cpu_matmul_gflops(torch.bfloat16))
    hardware = job_hardware("cpu", 1, rates)
    assert result.summary["loss_chunk"] == loss_chunk_for("auto", saved.config.vocab_size, hardware, "bf16") < 1024


def test_freeze_trains_only_chosen_modules(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = load_config(_cfg(tmp_path, tiny_llama, small_data, method="freeze", freeze_trainable=["layers.1"],
                           lr=1e-3, max_steps=3))
    result = train(cfg, init_distributed(), quiet=True)
    before = load_file(str(tiny_llama / "model.safetensors"))
    after = load_file(str(result.run_dir / "model" / "model.safetensors"))
    for k, v in before.items():
        same = torch.equal(v.float(), after[k].float())
        assert same != ("layers.1." in k), k


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    over = dict(max_steps=12, save_steps=3, lora={"rank": 4, "alpha": 8, "dropout": 0.1})  # dropout: RNG matters
    (tmp_path / "a").mkdir()
    clean = _cfg(tmp_path / "a", tiny_llama, small_data, **over)
    train_here(clean)  # in this process: only the killed run needs one of its own

    (tmp_path / "b").mkdir()
    killed = _cfg(tmp_path / "b", tiny_llama, small_data, **over)
    run_b = tmp_path / "b" / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "train", str(killed)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run_b / "checkpoints" / "step-3" / "trainer.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_b / "summary.json").exists(), "the run finished before it was killed"
    train_here(killed)  # the resume, in this process too
    summary = json.loads((run_b / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 3

    a, b = _adapter(tmp_path / "a" / "run"), _adapter(run_b)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    steps = [m["step"] for m in read_jsonl(run_b / "metrics.jsonl") if "loss" in m]
    assert steps == list(range(1, 13))  # the log reads as one run


def test_resume_never_starts_over_and_bad_resume_path(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    cfg_file = _cfg(tmp_path, tiny_llama, small_data, max_steps=2, resume="nowhere/step-9")
    code, _, err = run_here(capsys, "train", str(cfg_file))  # one process: a regression trains 2 steps here
    assert code == 2 and "'resume'" in err and "Traceback" not in err


@pytest.mark.parametrize("grad_ckpt", ["none", pytest.param("full", marks=pytest.mark.heavy),
                                       pytest.param("selective", marks=pytest.mark.heavy)])
def test_compiled_blocks_train_like_eager(tmp_path: Path, tiny_qwen2: Path, small_data: Path, grad_ckpt: str) -> None:
    """compile: true changes how the step runs, not what it computes: same losses, same adapter, same outputs."""
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"compile-{flag}"
        out.mkdir()
        cfg = load_config(_cfg(out, tiny_qwen2, small_data, max_steps=4, eval_split=0.1, compile=flag,
                               grad_ckpt=grad_ckpt, resume="never"))
        runs[flag] = train(cfg, init_distributed(), quiet=True).run_dir
    eager, compiled = (read_jsonl(runs[f] / "metrics.jsonl") for f in (False, True))
    losses = [[m["loss"] for m in ms if "loss" in m] for ms in (eager, compiled)]
    assert len(losses[0]) == 4
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=0)
    evals = [json.loads((r / "summary.json").read_text())["eval_loss"] for r in (runs[False], runs[True])]
    assert evals[1] == pytest.approx(evals[0], rel=1e-4)
    a, b = _adapter(runs[False]), _adapter(runs[True])
    assert a.keys() == b.keys() and a  # compiled blocks keep their parameter names (no _orig_mod prefix)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)


def test_selective_checkpointing_trains_like_none(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """`grad_ckpt: selective` changes what backward recomputes, not what it computes: same losses and adapter as
    without checkpointing."""
    runs = {}
    for ckpt in ("none", "selective"):
        out = tmp_path / ckpt
        out.mkdir()
        cfg = load_config(_cfg(out, tiny_qwen2, small_data, max_steps=3, grad_ckpt=ckpt, resume="never"))
        runs[ckpt] = train(cfg, init_distributed(), quiet=True).run_dir
    losses = [[m["loss"] for m in read_jsonl(runs[c] / "metrics.jsonl") if "loss" in m] for c in runs]
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    a, b = _adapter(runs["none"]), _adapter(runs["selective"])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


def test_compile_without_a_cpu_compiler_is_a_clear_error(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                                         capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on PATH
    monkeypatch.setenv("CXX", "no-such-c++")
    # one process, one step at most: a regression trains (or fails in inductor) here and exits other than 2
    code, _, err = run_here(capsys, "train", str(_cfg(tmp_path, tiny_qwen2, small_data, max_steps=1, compile=True)))
    assert code == 2, err
    assert "compile: true" in err and "C++ compiler" in err and "compile: false" in err


def test_attn_implementation_key(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    """`attn_implementation: eager` trains like SDPA (packed rows included); `auto` resolves by the measured rule
    (uncompiled on CPU: transformers' default, SDPA) and config.yaml records the resolved config; a kernel that is
    not installed stops at load with exit 2 naming the key."""
    runs = {}
    for attn in ("sdpa", "eager", "auto"):
        out = tmp_path / attn
        out.mkdir()
        cfg = load_config(_cfg(out, tiny_qwen2, small_data, max_steps=3, attn_implementation=attn, resume="never"))
        result = train(cfg, init_distributed(), quiet=True)
        runs[attn] = [m["loss"] for m in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in m]
        assert result.model.config._attn_implementation == ("eager" if attn == "eager" else "sdpa")
        recorded = load_config(result.run_dir / "config.yaml")
        assert recorded.compile is False  # auto: no compile on CPU, and then transformers' default attention
        assert recorded.attn_implementation == attn
    torch.testing.assert_close(runs["eager"], runs["sdpa"], rtol=1e-4, atol=0)

    code, _, err = run_here(capsys, "train", str(_cfg(tmp_path, tiny_qwen2, small_data, max_steps=1,
                                                       attn_implementation="flash_attention_2")))
    assert code == 2 and "'attn_implementation: flash_attention_2'" in err, err[-2000:]
    assert "attn_implementation: auto" in err


def test_auto_attention_follows_the_rows_in_bf16_on_cpu(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """bf16 on CPU, uncompiled: `auto` attention runs eager for the short micro-batches (the demo rows are) and
    SDPA for wide ones; summary.json counts them and config.yaml keeps `auto`."""
    cfg = load_config(_cfg(tmp_path, tiny_qwen2, small_data, max_steps=2, precision="bf16", resume="never"))
    result = train(cfg, init_distributed(), quiet=True)
    assert result.summary["attention_by_width"] == {"eager": 2}
    assert result.model.config._attn_implementation == "eager"
    assert load_config(result.run_dir / "config.yaml").attn_implementation == "auto"
    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    cfg = load_config(_cfg(fp32, tiny_qwen2, small_data, max_steps=1, precision="fp32", resume="never"))
    result = train(cfg, init_distributed(), quiet=True)
    assert result.summary["attention_by_width"] is None and result.model.config._attn_implementation == "sdpa"


def test_packing_trains_the_steps_and_losses_of_an_unpacked_run(tmp_path: Path, tiny_llama: Path,
                                                                 small_data: Path) -> None:
    """A config carried over from a tool that does not pack: 10 examples, micro_batch 2, grad_accum 2 take
    ceil(10 / 4) = 3 optimizer steps with packing on as off, and each step's loss (the mean over the step's label
    tokens) is the unpacked run's: packing only removes padding."""
    data = tmp_path / "ten.jsonl"
    data.write_text("\n".join(small_data.read_text().splitlines()[:10]) + "\n")
    runs = {}
    for packing in (True, False):
        out = tmp_path / f"packing-{packing}"
        out.mkdir()
        cfg = load_config(_cfg(out, tiny_llama, data, grad_accum=2, packing=packing, epochs=1, max_seq_len=256))
        result = train(cfg, init_distributed(), quiet=True)
        runs[packing] = result
        assert result.summary["steps"] == result.summary["steps_per_epoch"] == 3
        assert result.summary["examples_per_step"] == 4 and result.summary["packing"] is packing
    losses = {k: [m["loss"] for m in read_jsonl(r.run_dir / "metrics.jsonl") if "loss" in m] for k, r in runs.items()}
    assert len(losses[True]) == 3
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=0)
    assert runs[True].summary["tokens"] == runs[False].summary["tokens"]
