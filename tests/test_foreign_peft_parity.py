"""The planner's trainable parameters equal what peft 0.21 with transformers 5 trains on each mixture family, for
another tool's usual LoRA targets (all-linear, the seven projections, the attention alone): its rewrite of
transformers 4's expert names onto the fused weights (gate_up at twice the rank, Mixtral's w1/w3/w2, no adapters on
the dense layers' or shared experts' MLPs), and the families it does not rewrite (gpt-oss, Llama 4, Qwen2-MoE),
whose routed experts take no adapter from target_modules. Tiny models built on the meta device, counted by peft."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from shardfit.errors import UserError
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.targets import (
    PEFT_DEFAULT_TARGETS,
    plan_all_linear,
    plan_linear_names,
    plan_peft_default,
    plan_saved,
    plan_targets,
)
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.estimate import trainable_params
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "head_dim": 16}
FAMILIES = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                    "interleave_moe_layer_step": 1, "moe_layers": [0, 1]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LISTS = {"all-linear": "all-linear", "seven": SEVEN, "attention": SEVEN[:4]}
# Lists and patterns peft 0.21 reads otherwise than as written, or refuses: dotted MLP names it moves onto every
# expert whatever their prefix, gate_proj without up_proj after that move, the router by a prefixed name, a
# pattern that matches a block's MLP or experts container, the router of a family without the rewrite.
TRICKY = {"dotted": ["self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
          "one layer's": ["q_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
          "gate without up": ["q_proj", "mlp.shared_expert.gate_proj"],
          "router": ["q_proj", "gate"], "router dotted": ["q_proj", "mlp.gate"], "gpt-oss router": ["q_proj", "router"],
          "mlp pattern": r".*mlp.*", "experts pattern": r".*\.mlp\.experts.*", "under mlp": r".*\.mlp\..*",
          "attention pattern": r".*\.(q_proj|v_proj)"}
RANK = 4


def _peft_count(config: object, targets: str | list[str] | None) -> int:
    """What peft trains on the model of `config`, built on the meta device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=targets))
    return sum(p.numel() for p in lora.parameters() if p.requires_grad)


def _peft_count_or_none(config: object, targets: str | list[str] | None) -> int | None:
    """`_peft_count`, or None where peft refuses the targets (it raises ValueError)."""
    try:
        return _peft_count(config, targets)
    except ValueError:
        return None


def _job_count_or_none(job: ForeignJob, shape: ModelShape, plan: Callable[..., object],
                       *args: object) -> int | None:
    """The trainable parameters on `shape` of `job` after `plan(job, *args)` reads its targets, or None where the
    plan refuses them (exit 2, as peft raises)."""
    try:
        plan(job, *args)
    except UserError:
        return None
    return trainable_params(shape, job.workload)


def _planned(model_type: str, config: object, targets: str | list[str]) -> int:
    """The planner's trainable parameters for another tool's job with `targets` on that model."""
    return _plan(model_type, config, targets)[0]


def _plan(model_type: str, config: object, targets: str | list[str]) -> tuple[int, list[str]]:
    """The planner's trainable parameters and notes for another tool's job with `targets` on that model."""
    version = transformers.__version__
    shape = shape_from_config({**config.to_dict(), "model_type": model_type}, f"tiny/{model_type}")
    job = ForeignJob(tool="axolotl", source="job.yml", model=f"tiny/{model_type}",
                     workload=Workload(method="lora", lora_rank=RANK))
    if targets == "all-linear":
        plan_all_linear(job, shape, version)
    else:
        plan_targets(job, "lora_target_modules", targets if isinstance(targets, str) else list(targets), shape,
                     version)
    return trainable_params(shape, job.workload), job.notes


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_planned_adapters_equal_what_peft_trains_on_each_mixture(model_type: str) -> None:
    """For each family and list, the plan's trainable parameters are peft's count on the same tiny model."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    for name, targets in LISTS.items():
        assert _planned(model_type, config, targets) == _peft_count(config, targets), (model_type, name)


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_lists_peft_reads_otherwise_are_planned_or_refused_as_peft_does(model_type: str) -> None:
    """Where peft trains a list or pattern, the plan counts what it trains; where peft raises, the job exits 2."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    for name, targets in TRICKY.items():
        expected = _peft_count_or_none(config, targets)
        try:
            planned, notes = _plan(model_type, config, targets)
        except UserError:
            planned, notes = None, []
        if any("every linear layer" in n for n in notes):
            continue  # names the planner cannot place (`router` where the model has none): its stated fallback
        assert planned == expected, (model_type, name)


@pytest.mark.parametrize("saved", [["embed_tokens"], ["embed_tokens", "lm_head"]])
def test_modules_to_save_count_the_trainable_copies_peft_makes(saved: list[str]) -> None:
    """LLaMA-Factory's additional_target, axolotl's lora_modules_to_save, ms-swift's --modules_to_save: peft trains
    a full copy of each module beside the adapters; the plan counts them (it said "no effect on memory")."""
    config = transformers.AutoConfig.for_model("qwen2", **TINY)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=saved))
    expected = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    shape = shape_from_config({**config.to_dict(), "model_type": "qwen2"}, "tiny/qwen2")
    job = ForeignJob(tool="llamafactory", source="job.yml", model="tiny/qwen2",
                     workload=Workload(method="lora", lora_rank=RANK))
    plan_targets(job, "lora_target", ["q_proj", "v_proj"], shape, transformers.__version__)
    assert plan_saved(job, "additional_target", saved)
    assert trainable_params(shape, job.workload) == expected


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_tools_all_is_the_list_of_linear_names_they_hand_peft(model_type: str) -> None:
    """LLaMA-Factory's `lora_target: all` (0.9.5 find_all_linear_modules) and ms-swift's all-linear (4.6.0
    find_all_linears) hand peft the leaf names of the modules whose class name says Linear, less the head: under
    transformers 5 no fused experts container or router, so the plan counts what peft trains on that list."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if "Linear" in type(m).__name__ and "lm_head" not in n})
    expected = _peft_count(config, names)
    shape = shape_from_config({**config.to_dict(), "model_type": model_type}, f"tiny/{model_type}")
    for tool in ("llamafactory", "swift"):
        job = ForeignJob(tool=tool, source="job.yml", model=f"tiny/{model_type}",
                         workload=Workload(method="lora", lora_rank=RANK))
        plan_all_linear(job, shape, transformers.__version__)
        assert trainable_params(shape, job.workload) == expected, (tool, names)


def test_peft_default_targets_are_peft_own_table() -> None:
    """The planner's copy of peft's per-model defaults (a LoraConfig without target_modules) is peft's."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table

    # Every row: a type missing from the copy would be refused here where peft trains it (gpt_neox, falcon...).
    assert set(PEFT_DEFAULT_TARGETS) == set(table)
    for kind, names in table.items():
        if isinstance(names, str):  # a regex over whole module names (gemma4's language model q/v)
            assert all(re.search(rf"\b{n}\b", names) for n in PEFT_DEFAULT_TARGETS[kind]), kind
        else:
            assert list(PEFT_DEFAULT_TARGETS[kind]) == list(names), kind


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3_moe"])
def test_no_target_modules_is_planned_or_refused_as_peft_does(model_type: str) -> None:
    """TRL's --use_peft without targets: peft's default for the type, counted alike; a type peft has no default
    for raises in peft and exits 2 here."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES.get(model_type, {}))
    expected = _peft_count_or_none(config, None)
    shape = shape_from_config({**config.to_dict(), "model_type": model_type}, f"tiny/{model_type}")
    job = ForeignJob(tool="hf", source="run.sh", model=f"tiny/{model_type}",
                     workload=Workload(method="lora", lora_rank=RANK))
    assert _job_count_or_none(job, shape, plan_peft_default, "--use_peft", shape, transformers.__version__) == expected


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("named", [[], ["q_proj", "gate"]])
def test_axolotl_target_linear_is_its_list_of_linear_names(model_type: str, named: list[str]) -> None:
    """axolotl's `lora_target_linear: true` (0.19 loaders/adapter.py find_all_linear_names) hands peft the leaf
    names of the modules that are an nn.Linear or whose class name says Linear, less lm_head, joined with any
    lora_target_modules beside it: on transformers 5 no fused experts container and no router but Llama 4's (an
    nn.Linear). It was planned as peft's all-linear, which reaches the fused experts through peft's rewrite."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and n != "lm_head" and
                    (isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__)} | set(named))
    expected = _peft_count_or_none(config, names)
    shape = shape_from_config({**config.to_dict(), "model_type": model_type}, f"tiny/{model_type}")
    job = ForeignJob(tool="axolotl", source="job.yml", model=f"tiny/{model_type}",
                     workload=Workload(method="lora", lora_rank=RANK))
    planned = _job_count_or_none(job, shape, plan_linear_names, "lora_target_linear", named, shape,
                                 transformers.__version__)
    assert planned == expected, names


ONE_EXPERT = {"alone": ["mlp.experts.0.gate_proj"], "beside q_proj": ["q_proj", "mlp.experts.0.down_proj"],
              "gate and up": ["mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"],
              "mixtral's name": ["q_proj", "experts.1.w2"]}


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="peft's rewrite needs transformers 5")
@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("case", list(ONE_EXPERT))
def test_one_experts_module_is_planned_or_refused_as_peft_does(model_type: str, case: str) -> None:
    """An entry naming one expert's module on fused experts was refused outright. peft 0.21 moves it onto every
    expert's fused weight where it ends in a name its rewrite moves (gate_proj on Qwen3-MoE, w2 on Mixtral; gate
    only with up), and elsewhere it matches no module: skipped beside others, "not found" alone."""
    config = transformers.AutoConfig.for_model(model_type, **TINY, **FAMILIES[model_type])
    targets = ONE_EXPERT[case]
    expected = _peft_count_or_none(config, targets)
    planned: int | None
    try:
        planned, notes = _plan(model_type, config, targets)
    except UserError:
        planned, notes = None, []
    if any("every linear layer" in n for n in notes):
        assert case == "mixtral's name" and model_type != "mixtral"  # w2 is no name the planner places there
        return
    assert planned == expected, targets
