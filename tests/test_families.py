"""Today's families (MoE and the rest): the catalog's sizes against the models transformers builds, the plan's
step time from active parameters, LoRA on experts and never on routers, and training per family (tests/families.py
holds the matrix the README's table is rendered from)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardfit.cli.main import main
from shardfit.config import Config, LoraSettings
from shardfit.data.tokenize import IGNORE
from shardfit.models.adapters import apply_lora
from shardfit.models.anatomy import decoder_and_head
from shardfit.models.build import model_class
from shardfit.models.experts import use_experts
from shardfit.plan.adapters import lora_params
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.shapes import catalog, hf_config, resolve_shape
from shardfit.plan.workload import Workload, workload_of
from shardfit.resolve.defaults import EXPERTS_BY_DEVICE, resolve_experts
from shardfit.train.loss import CausalLMLoss
from tests.families import FAMILIES, HEAVY_ZERO3, MATRIX, MEDIA_MATRIX, make_family_model, table, tiny_text_config
from tests.helpers import ROOT, read_jsonl, run_cli, run_here, train_here, write_config

KEPT = sorted(k for k, e in catalog().items() if "config" in e)
MOE = ["Qwen3-MoE", "gpt-oss", "GLM-4.5", "DeepSeek-V3", "Llama 4 (text)"]
BASE = dict(precision="fp32", max_seq_len=128, micro_batch=2, log_steps=1, save_steps=100, eval_steps=100,
            max_steps=3, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, resume="never")


def _meta_params(model_id: str) -> int:
    """Parameters of the model transformers builds (weightless) from the catalog's published config: what trains
    (Qwen-Omni: the thinker)."""
    config = hf_config(resolve_shape(model_id))
    if getattr(config, "enable_audio_output", False):
        config.enable_audio_output = False
    cls = model_class(config)
    with torch.device("meta"):
        model = cls.from_config(config) if cls is AutoModelForCausalLM else cls._from_config(config)
    model = getattr(model, "thinker", model)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_id", KEPT)
def test_catalog_sizes_are_the_built_models(model_id: str) -> None:
    shape = resolve_shape(model_id)
    assert shape.params() == pytest.approx(_meta_params(model_id), rel=0.01)
    assert shape.active_params() <= shape.params()


def test_plan_weights_are_parameters_times_bytes(capsys: pytest.CaptureFixture) -> None:
    """The issue's case: Qwen3-30B-A3B's weights per replica are its 30.5B parameters in bf16 (57 GiB), not 439."""
    code, out, err = run_here(capsys, "plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "8xH100", "--method", "lora",
                              "--json")
    assert code == 0, err
    plan = json.loads(out)
    single = next(c for c in plan["candidates"] if c["strategy"] == "single")
    frozen = single["per_gpu_gib"]["weights"] * 2**30 - 4 * plan["model"]["trainable_params"]
    # The card's 3.3B counts the embedding too (a lookup, which the plan's compute leaves out: 0.31B).
    assert plan["model"]["active_params"] + 151936 * 2048 == pytest.approx(3.3e9, rel=0.03)
    assert frozen == pytest.approx(2 * _meta_params("Qwen/Qwen3-30B-A3B"), rel=0.03)


def test_moe_step_time_follows_active_parameters(capsys: pytest.CaptureFixture) -> None:
    """3.3B active parameters train about as fast as a dense 4B, not at 0.28x of it as when every expert counted."""
    speed = {}
    for model in ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-4B"):
        # Checkpointing on, as users run a mixture: without it LoRA on the experts keeps every block's merged
        # expert weights for the backward (peft rebuilds them each forward), about 1.2 GB a block here.
        code, out, err = run_here(capsys, "plan", "--model", model, "--gpus", "8xH100", "--method", "lora",
                                  "--strategy", "zero3", "--grad-ckpt", "full", "--json")
        assert code == 0, err
        speed[model] = json.loads(out)["candidates"][0]["tokens_per_s"]
    assert 0.5 < speed["Qwen/Qwen3-30B-A3B"] / speed["Qwen/Qwen3-4B"] < 1.5, speed


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("experts", [True, False])
def test_lora_adapts_experts_never_routers(family: str, experts: bool) -> None:
    config = tiny_text_config(family)
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict(), family)
    assert shape.params() == pytest.approx(sum(p.numel() for p in model.parameters()), rel=1e-3)
    peft_model = apply_lora(model, LoraSettings(rank=4, experts=experts))
    trainable = {n: p.numel() for n, p in peft_model.named_parameters() if p.requires_grad}
    assert not [n for n in trainable if ".gate.lora" in n or ".router." in n], "a router got an adapter"
    routed = [n for n in trainable if ".experts." in n]
    assert bool(routed) == (experts and shape.moe), routed
    # The planner counts exactly the adapters peft makes (fused expert weights: a rank per expert).
    w = Workload(lora_rank=4, lora_experts=experts)
    assert sum(trainable.values()) == lora_params(shape, w)


@pytest.mark.parametrize("targets", [r".*self_attn\.(q|v)_proj", ["q_proj", "v_proj"]])
@pytest.mark.parametrize("experts", [True, False])
def test_own_config_targets_plan_the_expert_adapters_the_trainer_adds(targets: str | list[str],
                                                                      experts: bool) -> None:
    """shardfit's trainer adds adapters to every routed expert weight under `lora.experts`, whatever
    `lora.targets` names: the planner counts them too, for a regular expression and a list alike, not only where
    gate/up/down is a target (Qwen3-30B-A3B: 636M trainable at rank 16, not the 7M of q and v alone)."""
    config = tiny_text_config("Qwen3-MoE")
    shape = shape_from_config(config.to_dict(), "Qwen3-MoE")
    lora = LoraSettings(rank=4, targets=targets, experts=experts)
    peft_model = apply_lora(AutoModelForCausalLM.from_config(config), lora)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == lora_params(shape, workload_of(Config(lora=lora)))


def test_experts_implementation_is_chosen_by_device() -> None:
    """grouped_mm on both devices (bench/results/moe_experts.json; on a GPU where it dispatches); the builder sets
    it on a mixture, leaves a dense model alone, and a class transformers cannot switch as it was built."""
    assert resolve_experts("cpu") == resolve_experts("cuda") == "grouped_mm"
    assert set(EXPERTS_BY_DEVICE) == {"cpu", "cuda"}
    model = AutoModelForCausalLM.from_config(tiny_text_config("Qwen3-MoE"), experts_implementation="eager")
    assert use_experts(model, resolve_experts("cpu")) == "grouped_mm" == model.config._experts_implementation
    assert use_experts(model, None) == "grouped_mm"  # None: as built
    assert use_experts(AutoModelForCausalLM.from_config(tiny_text_config("Qwen3 (dense)")), "grouped_mm") is None
    model.set_experts_implementation("eager")
    type(model)._can_set_experts_implementation_cached_value = False  # a class transformers cannot switch
    try:
        assert use_experts(model, "grouped_mm") == "eager"  # kept as built, no error
    finally:
        del type(model)._can_set_experts_implementation_cached_value


def _train(tmp: Path, model: Path, data: Path, name: str, *extra: str, **over) -> Path:
    cfg = write_config(tmp / f"{name}.yaml", **dict(BASE, model=str(model), data=str(data),
                                                     output_dir=str(tmp / name), **over))
    if not extra:
        train_here(cfg)
        return tmp / name
    r = run_cli("train", str(cfg), *extra, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / name


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_model(f, root / f.replace(" ", "_").replace("(", "").replace(")", ""), tokenizer_dir)
            for f in FAMILIES}


@pytest.fixture(scope="module")
def one_process_lora(tmp_path_factory: pytest.TempPathFactory, family_models: dict[str, Path],
                     small_data: Path) -> Callable[[str], Path]:
    """A family's one-process LoRA run, made once: the family test checks it and the zero3 test compares its
    two-rank run with it (a global batch of 4 rows: micro-batch 2 x 2 accumulated, as 2 ranks x micro-batch 2)."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            root = tmp_path_factory.mktemp("one-process-lora")
            runs[family] = _train(root, family_models[family], small_data, "run", method="lora", lr=1e-2,
                                  grad_accum=2)
        return runs[family]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("family,method", [(f, m) for f, m, s in MATRIX if s == "single"])
def test_family_trains(tmp_path: Path, family_models: dict[str, Path], small_data: Path, family: str,
                       method: str, one_process_lora: Callable[[str], Path]) -> None:
    run = one_process_lora(family) if method == "lora" else \
        _train(tmp_path, family_models[family], small_data, "run", method=method, lr=1e-3)
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) for m in metrics)
    if family in MOE:  # the expert load is logged every step; the load-balancing loss where the family has one
        assert all(0 <= m["expert_load_min"] <= 1 <= m["expert_load_max"] for m in metrics), metrics
        assert ("aux_loss" in metrics[0]) and (metrics[0]["aux_loss"] > 0) == (family in ("Qwen3-MoE", "gpt-oss"))
    if method == "lora":
        saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
        assert not [k for k in saved if ".gate.lora" in k or ".router." in k]
        assert any(".experts." in k for k in saved) == (family in MOE)


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.heavy) if f in HEAVY_ZERO3 else f
                                    for f, m, s in MATRIX if s == "zero3"])
def test_zero3_on_two_ranks_equals_one_process(tmp_path: Path, family_models: dict[str, Path], small_data: Path,
                                                   family: str, one_process_lora: Callable[[str], Path]) -> None:
    one = one_process_lora(family)
    two = _train(tmp_path, family_models[family], small_data, "two", "--nproc", "2", method="lora", lr=1e-2,
                 strategy="zero3")
    ref, got = (read_jsonl(r / "metrics.jsonl") for r in (one, two))
    for a, b in zip([m for m in ref if "loss" in m], [m for m in got if "loss" in m], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        if "aux_loss" in a:  # a family with a load-balancing loss
            assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3_offload"])
def test_moe_other_strategies_on_two_ranks_equal_one_process(tmp_path: Path, family_models: dict[str, Path],
                                                             small_data: Path, strategy: str,
                                                             one_process_lora: Callable[[str], Path]) -> None:
    """The rest of the strategy table on a mixture (zero3 is in the matrix above): the experts replicated (ddp),
    their gradients and optimizer state sharded (zero2), everything in host memory between uses (zero3_offload)."""
    one = one_process_lora("Qwen3-MoE")
    two = _train(tmp_path, family_models["Qwen3-MoE"], small_data, "two", "--nproc", "2", method="lora", lr=1e-2,
                 strategy=strategy)
    ref, got = (read_jsonl(r / "metrics.jsonl") for r in (one, two))
    for a, b in zip([m for m in ref if "loss" in m], [m for m in got if "loss" in m], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
@pytest.mark.heavy
def test_moe_resumed_run_equals_the_uninterrupted_one(tmp_path: Path, family_models: dict[str, Path],
                                                      small_data: Path) -> None:
    """Resuming a mixture restores experts, adapters, optimizer state and data order: steps 3-4 continued from the
    step-2 checkpoint are those of the run that went straight through."""
    model = family_models["Qwen3-MoE"]
    straight = _train(tmp_path, model, small_data, "straight", method="lora", lr=1e-2, max_steps=4, save_steps=2)
    resumed = _train(tmp_path, model, small_data, "resumed", method="lora", lr=1e-2, max_steps=4, save_steps=2,
                     resume=str(straight / "checkpoints" / "step-2"))
    ref = {m["step"]: m for m in read_jsonl(straight / "metrics.jsonl") if "loss" in m}
    got = {m["step"]: m for m in read_jsonl(resumed / "metrics.jsonl") if "loss" in m}
    assert sorted(got) == [3, 4], got
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6)
        assert got[step]["aux_loss"] == pytest.approx(ref[step]["aux_loss"], rel=1e-5, abs=1e-8)
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (straight, resumed))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_moe_adapter_merges_into_a_model_transformers_loads(tmp_path: Path, one_process_lora: Callable[[str], Path],
                                                             capsys: pytest.CaptureFixture) -> None:
    """The one-process GLM-4.5 LoRA run (test_family_trains checks it), exported merged in this process."""
    run = one_process_lora("GLM-4.5")
    assert main(["export", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    out = merged.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] == 6


def test_media_cases_the_table_marks_are_tests_that_exist() -> None:
    """Each media case the README's table marks tested names a test function (and parameter) that exists."""
    for where in MEDIA_MATRIX.values():
        path, name = where.split("::")
        func, _, param = name.partition("[")
        text = (ROOT / path).read_text()
        assert f"def {func}(" in text, where
        assert not param or f'"{param.rstrip("]")}"' in text, where


def test_readme_table_is_the_tested_matrix() -> None:
    assert table() in (ROOT / "README.md").read_text(), "README's families table differs from tests/families.py"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shardfit_loss_is_the_models_own(family: str) -> None:
    """shardfit runs the body and the head apart (train/loss.py); per family, its loss is the model's own forward's.
    Llama 4's `get_decoder()` answers the whole model, whose logits went into the head (models/anatomy.py)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_text_config(family)).float()
    decoder, _ = decoder_and_head(model)
    assert decoder is not model
    ids = torch.randint(3, 1000, (2, 12))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
    total, n = CausalLMLoss(model)(ids, None, targets)
    assert (total / n).item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)


@pytest.mark.parametrize("family", ["gpt-oss", "Gemma 3 (text)"])
def test_packed_rows_keep_sliding_windows_inside_each_example(family: str) -> None:
    """Packing with sliding-window layers: a window must not reach across into the previous example. shardfit's
    packed rows restart their positions, from which transformers builds each layer type's mask per example; two
    examples longer than the window (16 here) lose the same packed into one row as apart."""
    torch.manual_seed(0)
    config = tiny_text_config(family)
    assert getattr(config, "sliding_window", None) == 16
    model = AutoModelForCausalLM.from_config(config).float().eval()
    loss = CausalLMLoss(model)
    docs = [torch.randint(3, 1000, (1, n)) for n in (40, 28)]
    apart = [loss(d, torch.arange(d.shape[1])[None], torch.cat([d[:, 1:], torch.full((1, 1), IGNORE)], 1))
             for d in docs]
    ids = torch.cat(docs, 1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    targets = torch.cat([torch.cat([d[:, 1:], torch.full((1, 1), IGNORE)], 1) for d in docs], 1)
    with torch.no_grad():
        packed, n = loss(ids, positions, targets, restarts=True)
        unpacked = sum(t for t, _ in apart)
    assert n == sum(m for _, m in apart)
    assert packed.item() == pytest.approx(unpacked.item(), rel=1e-5)
