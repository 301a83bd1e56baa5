"""The peer bench's harness (bench/compare.py and its parts) without training anything: its command line, the
batch each mode gives a peer, the shared evaluator's arithmetic, and the JSON it writes (docs/reference.md,
`bench/results/latest.json`)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from shardfit.config import load_config
from tests.helpers import DEMO_DATA, ROOT


def _load(name: str):  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # compare.py imports its siblings by these names
    spec.loader.exec_module(module)
    return module


workloads = _load("workloads")
peers = _load("peers")
evaluator = _load("evaluator")
compare = _load("compare")
proc = _load("proc")


def test_results_keep_one_entry_per_workload(tmp_path: Path) -> None:
    """Merging after every workload keeps older entries only of workloads not run again, never a stale twin."""
    first, second, third = list(workloads.WORKLOADS)[:3]
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"workloads": [{"name": n, "date": "old"} for n in (first, second, third)]}))
    report = {"workloads": []}
    for n in (first, second):
        report["workloads"].append({"name": n, "date": "new"})
        out.write_text(json.dumps(compare.merge(report, out)))
    assert json.loads(out.read_text())["workloads"] == [
        {"name": first, "date": "new"}, {"name": second, "date": "new"}, {"name": third, "date": "old"}]
    assert len(report["workloads"]) == 2


def test_a_temporary_work_folder_goes_and_an_asked_one_stays(tmp_path: Path) -> None:
    """Runs save models and checkpoints, gigabytes a bench: a folder the bench made itself is removed at the end,
    even when a run fails; one the user named is kept."""
    with pytest.raises(RuntimeError), compare.work_folder(None, "shardfit-bench-test-") as work:
        (work / "run").mkdir()
        made = work
        raise RuntimeError("a run failed")
    assert not made.exists()
    with compare.work_folder(str(tmp_path / "kept"), "unused-") as work:
        (work / "run").mkdir()
    assert (tmp_path / "kept" / "run").is_dir()


def test_arguments_default_to_everything_and_reject_unknown_names(capsys: pytest.CaptureFixture) -> None:
    args = compare.parse_args([])
    assert args.runs == 3 and args.workloads == list(workloads.WORKLOADS)
    assert args.peers == list(peers.PEERS) and args.modes == list(compare.MODES)
    for bad in (["--workloads", "nope"], ["--peers", "axolotl"], ["--modes", "fastest"], ["--runs", "0"]):
        with pytest.raises(SystemExit) as e:
            compare.parse_args(bad)
        assert e.value.code == 2
    assert "choose from" in capsys.readouterr().err


def test_every_workload_config_is_one_shardfit_accepts() -> None:
    paths = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "train": str(DEMO_DATA), "eval": str(DEMO_DATA)}
    for w in workloads.WORKLOADS.values():
        assert set(w.peers) <= set(peers.PEERS)
        cfg = load_config(None, workloads.overrides(workloads.user_config(w, paths, "/tmp/unused")))
        assert (cfg.micro_batch, cfg.max_seq_len, cfg.method) == (w.micro_batch, w.max_seq_len, w.method)
        default = load_config(None, [f"data={DEMO_DATA}"])
        # Each tool's own defaults, untouched: a workload names no precision unless it sets one.
        assert cfg.precision == (w.precision or default.precision) and cfg.compile == default.compile
        if w.method == "lora":
            assert (cfg.lora.rank, cfg.lora.alpha) == (w.lora_rank, w.lora_alpha)


def test_longtail_data_is_mostly_short_with_a_long_tail() -> None:
    rows = workloads.longtail_rows(200)
    notes = [r["input"].count("\n") + 1 for r in rows]
    assert sum(n == 1 for n in notes) > 0.6 * len(rows) and max(notes) >= 8
    assert workloads.longtail_rows(200) == rows  # seeded: every run reads the same rows


def test_peer_batch_in_each_mode() -> None:
    w = workloads.WORKLOADS["smollm2-135m-lora-longtail"]
    assert compare.peer_batch(w, "hf_trainer", "same_config", 9.0, 120, None) == w.micro_batch
    assert compare.peer_batch(w, "trl_sft", "same_precision", 9.0, 120, 30) == w.micro_batch
    assert compare.peer_batch(w, "hf_trainer", "equal_examples", 11.6, 120, None) == 12
    # TRL packs: 120 examples in 30 rows hold 4 examples a row, so 12 examples a step are 3 rows.
    assert compare.peer_batch(w, "trl_sft", "equal_examples", 12.0, 120, 30) == 3
    assert peers.rows_per_step(0.1, 120, 30) == 1
    z3 = workloads.WORKLOADS["qwen2-small-full-zero3"]
    assert compare.peer_batch(z3, "deepspeed_zero3", "equal_examples", 8.0, 120, None) == 4  # per rank of 2


def test_peer_precision_is_the_tools_own_unless_asked() -> None:
    """No precision in the config: the peer's default (TrainingArguments then decides); asked: that precision, with
    a LoRA base loaded in bf16 under bf16 autocast."""
    cfg = {"grad_accum": 1, "lr": 1e-3, "epochs": 1, "seed": 0, "method": "lora"}
    assert "bf16" not in peers._common_args(cfg, 4, Path("/tmp/x"))
    assert peers._common_args(dict(cfg, precision="bf16"), 4, Path("/tmp/x"))["bf16"] is True
    assert peers._common_args(dict(cfg, precision="fp32"), 4, Path("/tmp/x"))["bf16"] is False
    assert peers._model_dtype(cfg, bf16=True) == torch.bfloat16 and peers._model_dtype(cfg, False) == torch.float32
    assert peers._model_dtype(dict(cfg, method="full"), bf16=True) == torch.float32  # fp32 master weights


def test_a_mode_reuses_the_run_it_would_repeat() -> None:
    """same_precision reuses a default-precision run that already ran in that precision (TRL's bf16), never one of
    another batch or precision, nor a failed run."""
    ran_bf16 = {"mode": "same_config", "batch_per_device": 4, "asked_precision": None, "precision": "bf16"}
    assert compare.same_run(ran_bf16, 4, None) and compare.same_run(ran_bf16, 4, "bf16")
    assert not compare.same_run(ran_bf16, 8, "bf16") and not compare.same_run(ran_bf16, 4, "fp32")
    ran_fp32 = dict(ran_bf16, precision="fp32")
    assert not compare.same_run(ran_fp32, 4, "bf16") and compare.same_run(ran_fp32, 4, None)
    assert not compare.same_run(dict(ran_bf16, failed="exit 1"), 4, None)


def test_deepspeed_configs_leave_the_schedule_to_the_trainer() -> None:
    for stage in (2, 3):
        cfg = peers.deepspeed_config(stage)
        assert cfg["zero_optimization"]["stage"] == stage
        assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["bf16"]["enabled"] == "auto"
    assert peers.deepspeed_config(3)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_mean_token_loss_weighs_tokens_not_examples() -> None:
    assert evaluator.mean_token_loss([(6.0, 3), (2.0, 1)]) == pytest.approx(2.0)
    assert math.isnan(evaluator.mean_token_loss([]))
    with pytest.raises(ValueError):
        evaluator.mean_token_loss([(1.0, -1)])


def test_example_loss_counts_only_target_tokens() -> None:
    vocab = 7

    class Uniform(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> object:
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, vocab)})()

    loss, n = evaluator.example_loss(Uniform(), [1, 2, 3, 4], [evaluator.IGNORE, 3, 4, evaluator.IGNORE])
    assert n == 2 and loss == pytest.approx(2 * math.log(vocab))


def _run(who: str, mode: str | None, rnd: int, tps: float, mem: float, loss: float) -> dict:
    return {"who": who, "mode": mode, "round": rnd, "tokens_per_s": tps, "train_tokens_per_s": 2 * tps,
            "wall_s": 100 / tps, "train_s": 50 / tps, "peak_mem_gib": mem, "eval_loss": loss, "steps": 10,
            "examples_per_step": 4.0, "load_avg_1m": 1.5}


def test_summary_keeps_section_8_keys_and_every_run() -> None:
    w = workloads.WORKLOADS["smollm2-135m-lora"]
    runs = [_run("shardfit", None, 0, 200, 1.0, 2.0), _run("hf_trainer", "same_config", 0, 100, 2.0, 2.5),
            _run("shardfit", None, 1, 300, 1.0, 2.0), _run("hf_trainer", "same_config", 1, 100, 2.0, 2.0),
            _run("trl_sft", "same_config", 0, 150, 1.5, 2.0), _run("trl_sft", "same_config", 1, 150, 1.5, 2.0)]
    e = compare.summarise(w, runs, 2)
    for key in ("name", "shardfit", "hf_trainer", "speedup", "memory_ratio", "eval_loss_ratio", "runs"):
        assert key in e
    assert e["speedup"] == pytest.approx(2.5)  # the median of per-round ratios 2.0 and 3.0
    assert e["memory_ratio"] == pytest.approx(0.5) and e["eval_loss_ratio"] == pytest.approx(0.9)
    assert e["peers"]["trl_sft"]["same_config"]["speedup"] == pytest.approx((200 / 150 + 300 / 150) / 2)
    assert len(e["all_runs"]) == 6 and e["load_avg_1m"] == [1.5] * 6
    table = compare.markdown({"machine": "test", "date": "today", "workloads": [e]})
    assert "| trl_sft | same_config |" in table and "2.50x" in table
    targets = compare.target_table({"workloads": [e]})
    assert "| smollm2-135m-lora | hf_trainer | speedup | >= 2.0 | 2.50 | met |" in targets
    assert "| smollm2-135m-lora | hf_trainer | eval_loss_ratio | <= 1.02 | 0.90 | met |" in targets
    assert "| smollm2-135m-lora | trl_sft | memory_ratio | <= 0.8 | 0.67 | met |" in targets


def test_a_failed_peer_run_is_reported_not_averaged() -> None:
    w = workloads.WORKLOADS["smollm2-135m-lora-longtail"]
    failed = {"who": "hf_trainer", "mode": "equal_examples", "round": 0, "batch_per_device": 16,
              "failed": "killed (out of memory?)", "load_avg_1m": 2.0, "saved": None}
    runs = [_run("shardfit", None, 0, 200, 1.0, 2.0), _run("hf_trainer", "same_config", 0, 100, 2.0, 2.5), failed]
    e = compare.summarise(w, runs, 1)
    assert e["peers"]["hf_trainer"]["equal_examples"] == {"failed": "killed (out of memory?)", "batch_per_device": 16}
    assert e["speedup"] == pytest.approx(2.0)  # the section-8 keys still come from the same-config run
    table = compare.markdown({"machine": "test", "date": "today", "workloads": [e]})
    assert "failed: killed (out of memory?) (batch 16)" in table


def test_a_childs_peak_is_its_own_not_its_parents() -> None:
    """Linux carries ru_maxrss across exec, so a child of a large process would report the parent's size: the
    bench's measured peak and shardfit's own (summary.json) must both be the child's alone."""
    ballast = bytearray(1024 * 2**20)
    ballast[:: 4096] = bytes(len(ballast) // 4096)  # a write to every page makes them resident
    code = "from shardfit.train.metrics import resident_peak_gib; print(resident_peak_gib())"
    m = proc.run_measured([sys.executable, "-c", code], dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert m.returncode == 0, m.output_tail
    own = float(m.output_tail.split()[-1])
    assert 0.05 < own < 0.6 and 0.05 < m.peak_rss_gib < 0.6, (own, m.peak_rss_gib)
    assert abs(m.peak_rss_gib - own) < 0.1
    del ballast


def test_a_runs_environment_is_its_own() -> None:
    """Variables given to one run (the allocator bench's SHARDFIT_ALLOCATOR or LD_PRELOAD) reach that run's
    environment and leave the bench process's own untouched."""
    assert "SHARDFIT_BENCH_PROBE" not in os.environ
    env = compare._env(1, extra={"SHARDFIT_BENCH_PROBE": "tcmalloc"})
    assert env["SHARDFIT_BENCH_PROBE"] == "tcmalloc" and env["HF_HUB_OFFLINE"] == "1"
    assert "SHARDFIT_BENCH_PROBE" not in os.environ and "SHARDFIT_BENCH_PROBE" not in compare._env(1)


def _tiny_model_folder(path: Path, **text: int) -> Path:
    """A config.json (no weights): all that the planner's FLOP count reads."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
           "tie_word_embeddings": False, **text}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_mfu_counts_useful_flops_without_recomputation(tmp_path: Path) -> None:
    """MFU's FLOPs per token: about 6 per weight for a full fine-tune and 4 for LoRA's frozen base (no weight
    gradients), the same whether or not the run recomputes activations (recomputation is not useful work)."""
    model = _tiny_model_folder(tmp_path / "m")
    base = {"model": str(model), "data": str(DEMO_DATA), "max_seq_len": 64, "micro_batch": 4, "lr": 1e-4}
    full = compare.model_flops_per_token(dict(base, method="full"))
    lora = compare.model_flops_per_token(dict(base, method="lora", lora={"rank": 8, "alpha": 16}))
    weights = 4 * (4 * 256 * 256 + 3 * 256 * 512) + 256 * 1000
    assert 6 * weights < full < 6.5 * weights  # the rest is attention over 64 tokens
    assert 4 * weights < lora < 4.7 * weights  # and the adapters' own
    assert compare.model_flops_per_token(dict(base, method="full", grad_ckpt="full")) == full


def test_tables_show_mfu_only_for_gpu_runs() -> None:
    w = workloads.WORKLOADS["smollm2-135m-lora"]
    runs = [_run("shardfit", None, 0, 200, 1.0, 2.0), _run("hf_trainer", "same_config", 0, 100, 2.0, 2.5)]
    assert "MFU" not in compare.markdown({"machine": "cpu", "date": "today",
                                          "workloads": [compare.summarise(w, runs, 1)]})
    for r, mfu in zip(runs, (0.02, 0.01), strict=True):
        r["mfu"] = mfu
    table = compare.markdown({"machine": "gpu", "date": "today", "workloads": [compare.summarise(w, runs, 1)]})
    assert "whole (training MFU 2.0%)" in table and "| 100 (training MFU 1.0%) |" in table


def test_peers_train_on_the_gpu_where_there_is_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {"grad_accum": 1, "lr": 1e-4, "epochs": 1, "seed": 0}
    assert peers._common_args(cfg, 4, tmp_path)["use_cpu"] is (not torch.cuda.is_available())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert peers._common_args(cfg, 4, tmp_path)["use_cpu"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers._common_args(cfg, 4, tmp_path)["use_cpu"] is True


@pytest.mark.heavy  # the GPU check's own preparation; test_gpu_check rehearses the check
def test_gpu_bench_builds_its_model_folders_from_exported_assets(tmp_path: Path) -> None:
    """What a GPU machine without the bundled GGUF gets: `export` writes SmolLM2's config and tokenizer, no weights;
    `models` builds loadable random-weight folders from them, the same on every call (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gpu = _load("gpu")
    assets = tmp_path / "assets"
    gpu.export(assets)
    assert not list(assets.glob("*.safetensors")) and not list(assets.glob("*.gguf"))
    assert AutoConfig.from_pretrained(assets).num_hidden_layers == 30
    # The bench's own architecture at a test's size: the same code path, a smaller model.
    small = AutoConfig.from_pretrained(assets)
    small.num_hidden_layers, small.hidden_size, small.intermediate_size = 1, 64, 128
    small.num_attention_heads, small.num_key_value_heads, small.head_dim = 4, 2, 16
    small.save_pretrained(assets)
    weights = []
    for work in (tmp_path / "w1", tmp_path / "w2"):
        gpu.main(["models", str(assets), "--work-dir", str(work)])
        for name in ("smollm2", "qwen2"):
            model = AutoModelForCausalLM.from_pretrained(work / name)
            assert AutoTokenizer.from_pretrained(work / name).eos_token is not None
        weights.append(AutoModelForCausalLM.from_pretrained(work / "smollm2").model.norm.weight.sum().item())
        weights.append(model.lm_head.weight.sum().item())
    assert weights[:2] == weights[2:]


def test_a_variant_is_shardfit_with_settings_compared_like_a_peer(capsys: pytest.CaptureFixture) -> None:
    args = compare.parse_args(["--variants", "sdpa:attn_implementation=sdpa", "flat:packing=false,loss_chunk=256"])
    assert args.variants == [("sdpa", {"attn_implementation": "sdpa"}),
                             ("flat", {"packing": False, "loss_chunk": 256})]
    for bad in ("sdpa", "sdpa:", ":packing=false", "x:packing"):
        with pytest.raises(SystemExit):
            compare.parse_args(["--variants", bad])
    assert "NAME:KEY=VALUE" in capsys.readouterr().err
    w = workloads.WORKLOADS["smollm2-135m-lora"]
    variant = dict(_run("shardfit:sdpa", "variant", 0, 100, 1.0, 2.0), settings={"attn_implementation": "sdpa"})
    runs = [_run("shardfit", None, 0, 200, 1.0, 2.0), variant, _run("hf_trainer", "same_config", 0, 50, 2.0, 2.0)]
    e = compare.summarise(w, runs, 1)
    assert e["peers"]["shardfit:sdpa"]["variant"]["speedup"] == pytest.approx(2.0)
    assert e["legacy_peer"] == "hf_trainer" and e["speedup"] == pytest.approx(4.0)  # the tool, not the variant
    assert "| shardfit:sdpa | variant |" in compare.markdown({"machine": "t", "date": "d", "workloads": [e]})
