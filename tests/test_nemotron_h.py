"""NVIDIA Nemotron-H / Nemotron Nano 2 / Nemotron 3 (model_type nemotron_h): each block is ONE part (a Mamba-2
mixer, attention, an MLP or a mixture), which the planner counted as attention plus MLP (a 4.49 G model planned as
8.33 G). Counted against transformers' own model built on the meta device, timed and sized part by part, and read
alike by the planner and the rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

from shardfit.cli import plan_cmd
from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.plan.activations import block_activation_bytes_per_token
from shardfit.plan.flops import linear_flops_per_token, softmax_groups
from shardfit.plan.model_shape import ATTENTION, MAMBA, MLP, Block
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve import sequence

# A Nemotron Nano 2 9B-like config as the brief gives it (hybrid_override_pattern form, dense, relu2 MLPs).
NANO9B = {"model_type": "nemotron_h", "hidden_size": 3072, "num_hidden_layers": 52,
          "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
          "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "mamba_num_heads": 112, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
          "vocab_size": 131072, "tie_word_embeddings": False, "mlp_hidden_act": "relu2", "use_bias": False,
          "use_conv_bias": True, "chunk_size": 128}
# A small mixture in the layers_block_type form, with everything the class can bias biased, a latent projection
# of the experts and tie_word_embeddings set (the class never ties).
LATENT_MOE = {"model_type": "nemotron_h", "hidden_size": 256, "intermediate_size": 512,
              "layers_block_type": ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"],
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8,
              "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "vocab_size": 1000,
              "tie_word_embeddings": True, "n_routed_experts": 16, "num_experts_per_tok": 4,
              "moe_intermediate_size": 96, "moe_shared_expert_intermediate_size": 192, "moe_latent_size": 64,
              "mlp_bias": True, "use_bias": True, "use_conv_bias": False}
# A Nemotron 3 Nano-like mixture cut small: the pattern form, no latent, experts routed in groups.
PATTERN_MOE = {"model_type": "nemotron_h", "hidden_size": 384, "num_hidden_layers": 8,
               "hybrid_override_pattern": "MEMEM*EM", "intermediate_size": 1024, "num_attention_heads": 6,
               "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 12, "mamba_head_dim": 32,
               "ssm_state_size": 32, "n_groups": 4, "conv_kernel": 4, "vocab_size": 2048, "n_routed_experts": 32,
               "num_experts_per_tok": 6, "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 256,
               "n_group": 1, "topk_group": 1, "tie_word_embeddings": True}


def _folder(cfg: dict[str, Any] | None, tmp_path: Path) -> Path:
    """A folder with `cfg` as its config.json, or (None) transformers' default NemotronHConfig saved as
    save_pretrained writes it (its time_step_limit's inf as {"__float__": "Infinity"})."""
    if cfg is None:
        NemotronHConfig().save_pretrained(tmp_path)
    else:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _built_params(folder: Path) -> tuple[int, Any]:
    """The parameters of transformers' model of the folder's config, built on the meta device, and its config."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), config


CONFIGS = {"nano9b": NANO9B, "latent_moe": LATENT_MOE, "pattern_moe": PATTERN_MOE, "default": None}


@pytest.mark.parametrize("which", list(CONFIGS))
def test_parameters_are_the_built_models(which: str, tmp_path: Path) -> None:
    """Every config's count is transformers' built model's to the parameter (the 9B-like one: 4.49 G, planned
    8.33 G before; the default config's file was refused)."""
    folder = _folder(CONFIGS[which], tmp_path)
    built, _ = _built_params(folder)
    assert resolve_shape(str(folder)).params() == built


@pytest.mark.parametrize("which", ["latent_moe", "pattern_moe", "default"])
def test_active_parameters_run_the_top_k(which: str, tmp_path: Path) -> None:
    """A token computes with its top-k routed experts of each mixture: the whole model less the embedding row
    lookup and the experts it was not routed to (two matrices each)."""
    folder = _folder(CONFIGS[which], tmp_path)
    built, config = _built_params(folder)
    shape = resolve_shape(str(folder))
    moe_blocks = config.layers_block_type.count("moe")
    width = config.moe_latent_size or config.hidden_size
    idle = moe_blocks * (config.n_routed_experts - config.num_experts_per_tok) * 2 * width * \
        config.moe_intermediate_size
    assert shape.active_params() == built - config.vocab_size * config.hidden_size - idle


def test_the_default_config_file_plans(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """transformers writes the default config's inf as {"__float__": "Infinity"} and reads it back; the planner
    refused the file as one the class cannot build. It plans it now."""
    folder = _folder(None, tmp_path)
    assert main(["plan", "--model", str(folder), "--gpus", "1xH100", "--seq", "512", "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hybrid_override_pattern", "M-M*X", "hybrid_override_pattern has 'X'"),
    ("layers_block_type", ["ssm", "mlp"], "layers_block_type is ['ssm', 'mlp']")])
def test_a_block_the_class_does_not_know_names_its_key(key: str, value: Any, named: str, tmp_path: Path) -> None:
    """A block other than the four exits 2 naming the key and the four (the class's own error named neither)."""
    cfg = {k: v for k, v in NANO9B.items() if k != "hybrid_override_pattern"}
    folder = _folder({**cfg, key: value}, tmp_path)
    with pytest.raises(UserError, match=named.replace("[", r"\[").replace("]", r"\]")) as e:
        resolve_shape(str(folder))
    assert "'M', '*', '-', 'E'" in str(e.value) or "'linear_attention'" in str(e.value)


def test_older_block_names_plan_as_the_class_builds_them(tmp_path: Path) -> None:
    """transformers renames "mamba" and "attention" blocks to "linear_attention" and "full_attention" and builds
    the model; the planner refused them as unknown blocks."""
    cfg = {k: v for k, v in LATENT_MOE.items() if k != "layers_block_type"}
    folder = _folder({**cfg, "layers_block_type": ["mamba", "moe", "attention", "moe", "mamba", "mlp"]}, tmp_path)
    shape = resolve_shape(str(folder))
    assert (shape.mamba_layers, shape.attention_layers) == (2, 1)
    assert shape.params() == _built_params(folder)[0]


def test_a_shared_expert_of_width_0_is_built_as_wide_as_the_mlp(tmp_path: Path) -> None:
    """NemotronHMLP builds a shared expert given width 0 as intermediate_size wide; the planner counted none."""
    folder = _folder({**LATENT_MOE, "moe_shared_expert_intermediate_size": 0}, tmp_path)
    assert resolve_shape(str(folder)).params() == _built_params(folder)[0]


@pytest.mark.parametrize(("keys", "named"), [
    ({"n_routed_experts": 1, "num_experts_per_tok": 1}, "n_routed_experts is 1"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok \\(17\\)")])
def test_a_mixture_that_cannot_route_names_its_key(keys: dict[str, int], named: str, tmp_path: Path) -> None:
    """One routed expert (planned as a dense MLP, so mis-counted) or more experts a token than there are exits 2."""
    with pytest.raises(UserError, match=named):
        resolve_shape(str(_folder({**LATENT_MOE, **keys}, tmp_path)))


def test_only_attention_blocks_attend_and_mlps_mix_no_tokens(tmp_path: Path) -> None:
    """The time model runs softmax attention over the 4 attention blocks alone (the 24 MLP blocks were timed as
    attention), the 24 Mamba-2 blocks by their state, and each block's linear FLOPs are its one part's."""
    shape = resolve_shape(str(_folder(NANO9B, tmp_path)))
    w = Workload(seq_len=4096)
    assert sum(n for n, _ in softmax_groups(shape, w)) == 4
    assert sum(g.blocks for g in shape.attention_groups if g.recurrence > 0) == 24
    _, params = linear_flops_per_token(shape)
    assert params * shape.layers == shape.decoder_linear_params()  # a dense model runs every weight


def _hooked_bytes_per_token(cfg: dict[str, Any], part: str, seq: int) -> float:
    """What autograd saves per token in one NemotronHBlock of `part` (bf16 weights, all trained), as saved-tensor
    hooks see it: each tensor once, weights left out."""
    config = NemotronHConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "hybrid_override_pattern",
                                                                          "layers_block_type")},
                             layers_block_type=[part])
    config._attn_implementation = "sdpa"
    block = NemotronHBlock(config, 0).to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[tuple[int, tuple[int, ...]], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.data_ptr(), tuple(t.shape)] = t.numel() * t.element_size()
        return t

    x = torch.randn(1, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kwargs = {"position_ids": torch.arange(seq)[None]} if part == "full_attention" else {}
        block(x, **kwargs)
    return sum(seen.values()) / seq


@pytest.mark.parametrize(("part", "kind"), [("linear_attention", MAMBA), ("mlp", MLP),
                                            ("full_attention", ATTENTION)])
def test_a_part_saves_what_transformers_keeps(part: str, kind: str) -> None:
    """Each kind of block's activations per token within 2 % of what transformers' block saves (the Mamba-2 mixer
    by its reference torch scan; a pure-bf16 full fine-tune), where a paired block's count was used for
    every block."""
    cfg = {**LATENT_MOE, "mlp_bias": False, "use_bias": False, "chunk_size": 32}
    shape = resolve_shape(cfg_path(cfg))
    w = Workload(seq_len=256, method="full", precision="bf16", pure_16bit=True, attention="flash",
                 mamba_scan="torch")
    measured = _hooked_bytes_per_token(cfg, part, 256)
    planned = block_activation_bytes_per_token(shape, w, part=Block(False, part=kind))
    assert planned == pytest.approx(measured, rel=0.02)


def cfg_path(cfg: dict[str, Any]) -> str:
    """`cfg` written to a fresh config.json; its path."""
    import tempfile

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("which", list(CONFIGS))
def test_splits_are_refused_as_the_rank_refuses_them(which: str, tmp_path: Path) -> None:
    """Sequence-parallel and pipeline refusals of the planner's shape and of the rank's built config agree (the
    rank read a dense file's class default of 8 experts as a mixture); the head is untied on both sides, as the
    built model's is."""
    folder = _folder(CONFIGS[which], tmp_path)
    shape = resolve_shape(str(folder))
    config = AutoConfig.from_pretrained(folder)
    verdicts = []
    for sp, pp in ((sequence.facts_of_shape(shape), pipelines.facts_of_shape(shape)),
                   (sequence.facts_of_config(config), pipelines.facts_of_config(config))):
        out = []
        for check in (lambda sp=sp: sequence.check_model(2, sp, "m"),
                      lambda pp=pp: pipelines.check_model(2, pp, "m", "lora")):
            try:
                check()
                out.append("")
            except UserError as e:
                out.append(str(e))
        verdicts.append(out)
    assert verdicts[0] == verdicts[1] and all("recurrent layers" in v for v in verdicts[0][:1])
    assert shape.tied is pipelines.facts_of_config(config).tied is False



# (packages installed, whether mamba_ssm's kernel module imports) -> the scan transformers runs in training.
SCANS = {"none": ((), True, "torch"), "no causal_conv1d": (("mamba_ssm",), True, "torch"),
         "import fails": (("mamba_ssm", "causal_conv1d"), False, "torch"),
         "both": (("mamba_ssm", "causal_conv1d"), True, "mamba_ssm")}


@pytest.mark.parametrize("case", list(SCANS))
def test_the_mamba_scan_is_the_one_transformers_runs(case: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba-2 blocks are planned for the fused kernel only where transformers would call it (mamba_ssm and
    causal_conv1d installed and mamba_ssm's kernel importable: transformers falls back to the torch scan on any
    import error); else for transformers' reference scan, with a note naming the fused kernel."""
    import importlib
    import importlib.util
    import types

    from shardfit import kernels

    packages, imports, expected = SCANS[case]
    find, load = importlib.util.find_spec, importlib.import_module
    fused = types.SimpleNamespace(mamba_split_conv1d_scan_combined=lambda *a, **k: None)

    def import_module(name: str, *a: Any) -> Any:
        if not name.startswith("mamba_ssm"):
            return load(name, *a)
        if not imports:
            raise ImportError("undefined symbol in selective_scan_cuda")
        return fused

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if name in packages else None)
                        if name in ("mamba_ssm", "causal_conv1d") else find(name, *a))
    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(plan_cmd, "cards_here", lambda hw: True)  # planned on the GPU machine itself: probed
    kernels.mamba_kernel.cache_clear()
    try:
        assert Workload().mamba_scan == expected
        assert main(["plan", "--model", str(_folder(NANO9B, tmp_path)), "--gpus", "1xH100", "--seq", "4096"]) == 0
        assert ("Mamba-2 blocks are planned with transformers' reference torch scan" in capsys.readouterr().out) \
            is (expected == "torch")
    finally:
        kernels.mamba_kernel.cache_clear()
    shape = resolve_shape(str(tmp_path))
    mamba = Block(False, part=MAMBA)
    fused, torch_scan = (block_activation_bytes_per_token(shape, Workload(mamba_scan=k), part=mamba)
                         for k in ("mamba_ssm", "torch"))
    assert fused < torch_scan / 5


TINY_DENSE = {"model_type": "nemotron_h", "hidden_size": 64, "hybrid_override_pattern": "M*-M-",
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
              "chunk_size": 32, "vocab_size": 49152, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.parametrize("which", ["dense", "latent_moe", "pattern_moe"])
def test_all_linear_lora_trains_what_the_plan_counts(which: str, tmp_path: Path) -> None:
    """all-linear leaves each Mamba mixer's out_proj alone (the fused kernel reads its base weight; peft refuses
    an adapter there) in the trainer and the planner alike, so both count the same adapters."""
    from shardfit.config import LoraSettings
    from shardfit.models.adapters import apply_lora
    from shardfit.plan.estimate import trainable_params

    cfg = {"dense": TINY_DENSE, "latent_moe": LATENT_MOE, "pattern_moe": PATTERN_MOE}[which]
    folder = _folder(cfg, tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    peft_model = apply_lora(model, LoraSettings(rank=8, targets="all-linear", experts=False))
    built = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert not any("out_proj.lora" in n for n, p in peft_model.named_parameters() if "mixer" in n)
    planned = trainable_params(resolve_shape(str(folder)), Workload(method="lora", lora_rank=8, lora_experts=False))
    assert built == planned


def test_a_dense_nemotron_h_trains_with_default_lora(tmp_path: Path, tokenizer_dir: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """The schema's default LoRA (all-linear) on a dense Nemotron-H trains a step on a CPU: peft refused it."""
    from tests.helpers import DEMO_DATA, save_with_tokenizer, train_here, write_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(NemotronHConfig(**{k: v for k, v in TINY_DENSE.items()
                                                                if k != "model_type"}))
    folder = save_with_tokenizer(model, tmp_path / "model", tokenizer_dir)
    config = write_config(tmp_path / "run.yaml", model=str(folder), data=str(DEMO_DATA), method="lora",
                          lora={"rank": 8, "targets": "all-linear"}, max_seq_len=128, micro_batch=1, max_steps=1,
                          output_dir=str(tmp_path / "out"), precision="fp32")
    train_here(config, capsys)
