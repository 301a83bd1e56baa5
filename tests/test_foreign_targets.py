"""LoRA targets of other tools' jobs, matched as peft matches them on the model's own module names: what peft
refuses exits 2, what the planner cannot place plans every linear layer with a note."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.config.load import load_config
from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job
from shardfit.foreign.targets import block_modules
from shardfit.plan.shapes import resolve_shape

LF = "model_name_or_path: {model}\nfinetuning_type: lora\nlora_rank: 16\nlora_target: {targets}\ncutoff_len: 2048\n"
V1 = "model: Qwen/Qwen3-4B\npeft_config:\n  name: lora\n  r: 8\n  target_modules: {targets}\ncutoff_len: 1024\n"
AXOLOTL = ("base_model: {model}\nadapter: lora\nlora_r: 16\nsequence_len: 2048\nmicro_batch_size: 1\nbf16: true\n"
           "lora_target_modules: '{targets}'\n")
HF = ("from peft import LoraConfig, get_peft_model\nfrom transformers import AutoModelForCausalLM, Trainer, "
      "TrainingArguments\nmodel = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-7B')\n"
      "model = get_peft_model(model, LoraConfig(r=16, target_modules={targets}))\n"
      "args = TrainingArguments(output_dir='o', per_device_train_batch_size=1, bf16=True)\n"
      "Trainer(model=model, args=args).train()\n")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _lf(tmp_path: Path, model: str, targets: str, **opts):
    return read_job("llamafactory", _write(tmp_path, "lf.yaml", LF.format(model=model, targets=targets)),
                    JobOptions(**opts))


@pytest.mark.parametrize("targets", ["'q_proj'", "'q_proj|v_proj'", "r'self_attn\\.q_proj'"])
def test_a_string_that_matches_only_the_end_of_module_names_is_refused(tmp_path: Path, targets: str) -> None:
    """peft matches a string target on the whole module name (re.fullmatch), so `q_proj` as a string reaches no
    module and peft raises: exit 2 with the fix, not every linear layer planned. A pattern over whole names plans
    what it matches; one over paths the planner does not model still plans every linear layer, with a note."""
    script = _write(tmp_path, "train.py", HF.format(targets=targets))
    with pytest.raises(UserError, match=r"target_modules .* matches only the end of module names.*q_proj\|v_proj"):
        read_job("hf", script, JobOptions())
    assert main(["plan", "--from", "hf", script, "--gpus", "1xH100"]) == 2
    ok = read_job("hf", _write(tmp_path, "train.py", HF.format(targets="r'.*\\.q_proj'")), JobOptions())
    assert ok.workload.lora_targets == ("q",)
    other = read_job("hf", _write(tmp_path, "train.py", HF.format(targets="r'vision\\..*'")), JobOptions())
    assert other.workload.lora_targets is None and any("every linear layer" in n for n in other.notes)


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "'.*\\.q_proj'"])
def test_v1_string_targets_are_one_literal_name(tmp_path: Path, targets: str) -> None:
    """LLaMA-Factory v1 hands a string target to peft as a one-name list, so `q_proj,v_proj` or a regex names a
    module literally and matches none: exit 2 suggesting a YAML list."""
    path = _write(tmp_path, "v1.yaml", V1.format(targets=targets))
    with pytest.raises(UserError, match=r"peft_config.target_modules .*is no module name.*\[q_proj, v_proj\]"):
        read_job("llamafactory", path, JobOptions())


@pytest.mark.parametrize("targets", ["5", "{a: 1}", "[q_proj, 1]"])
def test_v1_targets_of_another_type_are_refused(tmp_path: Path, targets: str) -> None:
    path = _write(tmp_path, "v1.yaml", V1.format(targets=targets))
    with pytest.raises(UserError, match=r"v1.yaml:5: peft_config.target_modules is .*\[q_proj, v_proj\]"):
        read_job("llamafactory", path, JobOptions())


def test_vl_blocks_move_under_language_model_from_transformers_4_52(tmp_path: Path) -> None:
    """Qwen2-VL's blocks are model.layers.N before transformers 4.52 and model.language_model.layers.N from it: an
    anchored pattern is planned on the version the job runs."""
    pattern = r"model\.layers\.\d+\.self_attn\.(q|v)_proj"
    text = AXOLOTL.format(model="Qwen/Qwen2-VL-7B-Instruct", targets=pattern)
    old = read_job("axolotl", _write(tmp_path, "a.yml", text), JobOptions(transformers="4.45.0"))
    new = read_job("axolotl", _write(tmp_path, "a.yml", text), JobOptions(transformers="4.52.0"))
    assert old.workload.lora_targets == ("q", "v")
    assert new.workload.lora_targets is None


def test_mla_attention_has_no_v_proj(tmp_path: Path) -> None:
    """DeepSeek-V3's attention is q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj: q_proj, v_proj match
    none of its modules (peft refuses), and its own names are planned as the q and k projections."""
    with pytest.raises(UserError, match=r"lora_target q_proj, v_proj matches no module.*kv_a_proj_with_mqa"):
        _lf(tmp_path, "deepseek-ai/DeepSeek-V3", "q_proj,v_proj")
    own = _lf(tmp_path, "deepseek-ai/DeepSeek-V3", "q_a_proj,q_b_proj,kv_b_proj")
    assert own.workload.lora_targets == ("q", "k")


def test_a_mixtures_router_and_experts_are_modules_peft_adapts(tmp_path: Path) -> None:
    """Qwen3-30B-A3B's mlp.gate is its router, a module peft adapts: `gate` is planned (as gate projections, with a
    note), not refused. Under transformers 4 each routed expert is a module of its own, and a pattern over their
    projections plans them; transformers 5 fuses them into 3-D weights, so the same pattern reaches no module
    (every linear layer planned, with a note); peft 0.21 moves an entry naming one expert's gate_proj onto every
    expert, refused without up_proj as peft refuses it; gate_proj, up_proj, down_proj are planned on every expert
    (peft 0.21 rewrites them onto the fused weights), said in a note."""
    gate = _lf(tmp_path, "Qwen/Qwen3-30B-A3B", "gate")
    assert gate.workload.lora_targets == ("gate",) and any("router" in n for n in gate.notes)
    text = AXOLOTL.format(model="Qwen/Qwen3-30B-A3B", targets=r".*mlp\.experts\.\d+\.(gate|up|down)_proj")
    experts = read_job("axolotl", _write(tmp_path, "a.yml", text), JobOptions(transformers="4.57.6"))
    assert experts.workload.lora_targets == ("gate", "up", "down")
    fused = read_job("axolotl", _write(tmp_path, "a.yml", text), JobOptions(transformers="5.0.0"))
    assert fused.workload.lora_targets is None and any("every linear layer" in n for n in fused.notes)
    with pytest.raises(UserError, match=r"Cannot convert PEFT target\(s\) gate_proj without also targeting up_proj"):
        _lf(tmp_path, "Qwen/Qwen3-30B-A3B", "q_proj,mlp.experts.0.gate_proj", transformers="5.0.0")
    assert _lf(tmp_path, "Qwen/Qwen3-30B-A3B", "q_proj,mlp.experts.0.gate_proj",
               transformers="4.57.6").workload.lora_targets == ("q", "gate")
    mlp = _lf(tmp_path, "Qwen/Qwen3-30B-A3B", "gate_proj,up_proj,down_proj", transformers="5.0.0")
    assert mlp.workload.lora_targets == ("gate", "up", "down")
    assert any("fuses" in n and "peft 0.21 moves" in n for n in mlp.notes)
    assert mlp.workload.lora_rewritten == ("gate_up", "down") and not mlp.workload.lora_router
    short = AXOLOTL.format(model="Qwen/Qwen3-30B-A3B", targets=r"experts\.\d+\.gate_proj")
    with pytest.raises(UserError, match=r"only the end of module names \(experts\.127\.gate_proj of model\.layers"):
        read_job("axolotl", _write(tmp_path, "b.yml", short), JobOptions(transformers="4.57.6"))
    assert not any(m.endswith(".mlp.gate") for m in block_modules(resolve_shape("Qwen/Qwen2.5-7B"))["gate"])


def test_glm45s_shared_expert_is_shared_experts(tmp_path: Path) -> None:
    """GLM-4.5 names its shared expert mlp.shared_experts, as DeepSeek does (the planner named it shared_expert
    for every family without latent attention, so this job exited 2); Qwen2-MoE's is mlp.shared_expert."""
    job = _lf(tmp_path, "zai-org/GLM-4.5-Air", "mlp.shared_experts.gate_proj,mlp.shared_experts.up_proj")
    assert job.workload.lora_targets == ("gate", "up")
    with pytest.raises(UserError, match=r"mlp\.shared_expert\.gate_proj matches no module of zai-org/GLM-4\.5-Air"):
        _lf(tmp_path, "zai-org/GLM-4.5-Air", "mlp.shared_expert.gate_proj", transformers="4.57.6")
    skipped = _lf(tmp_path, "zai-org/GLM-4.5-Air", "q_proj,mlp.shared_expert.gate_proj", transformers="4.57.6")
    assert skipped.workload.lora_targets == ("q",)
    # peft 0.21 moves any entry ending in .gate_proj onto the fused experts, whatever its prefix, and then raises
    # on gate_proj without up_proj
    for targets in ("mlp.shared_expert.gate_proj", "q_proj,mlp.shared_expert.gate_proj"):
        with pytest.raises(UserError, match=r"reaches gate_proj but not up_proj.*Cannot convert PEFT target"):
            _lf(tmp_path, "zai-org/GLM-4.5-Air", targets, transformers="5.0.0")


def test_families_with_other_module_names_refuse_lists_none_of_whose_names_they_have(tmp_path: Path) -> None:
    """Phi-3's and GLM-4-9B's shapes (the compact catalog form) cannot list their fused qkv_proj/query_key_value:
    q_proj, v_proj matches none of their modules, which peft refuses ("Target modules ... not found"); a list
    naming one of their own modules beside q_proj is planned, with a note that peft skips names the model lacks."""
    for model, own in (("microsoft/Phi-3-mini-4k-instruct", "qkv_proj"), ("THUDM/glm-4-9b-chat", "query_key_value")):
        with pytest.raises(UserError, match=rf"q_proj, v_proj matches no module of {model}.*{own}"):
            _lf(tmp_path, model, "q_proj,v_proj")
    job = _lf(tmp_path, "microsoft/Phi-3-mini-4k-instruct", "q_proj,o_proj")
    assert job.workload.lora_targets == ("q", "o")
    assert any("qkv_proj" in n and "peft skips a name" in n for n in job.notes)


def test_the_family_is_read_from_the_model_type_not_the_hub_id(tmp_path: Path) -> None:
    """GLM-4-9B-0414 (model_type glm4) names its attention q_proj...: unlike THUDM/glm-4-9b (chatglm, whose
    query_key_value the compact shape cannot list), q_proj, v_proj is planned on it without a note."""
    folder = tmp_path / "GLM-4-9B-0414"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "glm4", "architectures": ["Glm4ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "head_dim": 16}))
    job = _lf(tmp_path, str(folder), "q_proj,v_proj")
    assert job.workload.lora_targets == ("q", "v")
    assert not any("query_key_value" in n for n in job.notes)


@pytest.mark.parametrize(("targets", "fix"), [("[q, v]", "q_proj, v_proj"), ("[q_proj, up]", "up_proj"),
                                              ("['q_proj,v_proj']", r"\[q_proj, v_proj\]")])
def test_own_lora_targets_that_name_no_module_exit_2(tmp_path: Path, targets: str, fix: str) -> None:
    """shardfit's own `lora.targets` hands a list to peft as the readers' jobs do: `[q, v]` names no module (peft
    would refuse it at train time, or skip `up` beside q_proj), so plan exits 2 naming the key and the fix, by
    the readers' rule; a full fine-tune's unused targets are not checked."""
    text = f"model: Qwen/Qwen2.5-7B\ndata: d.jsonl\nmethod: {{method}}\nlora: {{{{rank: 8, targets: {targets}}}}}\n"
    path = _write(tmp_path, "own.yaml", text.format(method="lora"))
    assert main(["plan", path, "--gpus", "1xH100"]) == 2
    with pytest.raises(UserError, match=rf"own.yaml:4: 'lora.targets' has .* no module.*{fix}"):
        load_config(Path(path), check_files=False)
    full = _write(tmp_path, "full.yaml", text.format(method="full"))
    assert load_config(Path(full), check_files=False).method == "full"


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, head_dim=16)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32),
       "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
       "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                           first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
       "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
       "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                           interleave_moe_layer_step=1),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("model_type", list(MOE))
def test_a_mixtures_module_names_are_those_transformers_builds(model_type: str) -> None:
    """The names the targets are matched on are the installed transformers' own, read off a tiny model of each
    family built on the meta device: GLM-4.5's shared expert is mlp.shared_experts (as DeepSeek's; Qwen's is
    mlp.shared_expert), Llama 4's MLP is feed_forward, gpt-oss's router mlp.router. transformers 5 fuses the routed
    experts into 3-D weights: no expert's own module is listed, only the transformers-4 names peft rewrites onto
    the fused weights (where the family had them), which stand for weights the build has."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardfit.foreign.targets import fused_experts
    from shardfit.plan.config_shape import shape_from_config

    config = AutoConfig.for_model(model_type, **SMALL, **MOE[model_type])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = {name for name, _ in model.named_modules()}
    weights = {name for name, _ in model.named_parameters()}
    shape = shape_from_config(config.to_dict(), model_type)
    listed = {m for names in block_modules(shape, transformers.__version__).values() for m in names}
    fused = fused_experts(shape, transformers.__version__)
    for m in listed - built:
        container, _, last = m.rpartition(".")
        weight = "down_proj" if last == "down_proj" else "gate_up_proj"
        assert fused and container.endswith(".experts") and f"{container}.{weight}" in weights, m
    assert not fused or not any(re.search(r"experts\.\d+\.", m) for m in listed)
    projections = {m for m in built if m.endswith("_proj") and ".layers." in m} | \
        {m for m in built if re.search(r"\.(mlp|feed_forward)\.(gate|router)$", m)}
    assert projections <= listed, sorted(projections - listed)[:4]


def test_own_and_other_tools_targets_are_judged_by_one_rule_with_the_same_words(tmp_path: Path) -> None:
    """An entry that names no module beside one that does (`q_proj, up`: peft skips `up` silently) is judged by
    config/targets.py's one rule with its words: shardfit's own lora.targets refuses it (the run would train fewer
    adapters than asked), another tool's job is planned as peft runs it, with the same words as a note (exit 0).
    `gate` is a mixture's router (mlp.gate), a module: neither refuses it."""
    own = _write(tmp_path, "own.yaml", "model: Qwen/Qwen2.5-7B\ndata: d.jsonl\nmethod: lora\n"
                                       "lora: {rank: 8, targets: [q_proj, up]}\n")
    with pytest.raises(UserError) as mine:
        load_config(Path(own), check_files=False)
    theirs = _lf(tmp_path, "Qwen/Qwen2.5-7B", "q_proj,up")
    said = "has up, which names no module: peft matches a list entry on the end of a module's name"
    assert said in str(mine.value) and any(said in n and "peft skips up" in n for n in theirs.notes)
    assert theirs.workload.lora_targets == ("q",)
    assert main(["plan", "--from", "llamafactory", str(tmp_path / "lf.yaml"), "--gpus", "1xH100"]) == 0
    router = _write(tmp_path, "router.yaml", "model: Qwen/Qwen3-30B-A3B\ndata: d.jsonl\nmethod: lora\n"
                                             "lora: {rank: 8, targets: [q_proj, gate]}\n")
    assert load_config(Path(router), check_files=False).lora.targets == ["q_proj", "gate"]


SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.mark.parametrize(("model", "planned"), [("openai/gpt-oss-20b", ("q", "k", "v", "o")),
                                                 ("deepseek-ai/DeepSeek-V3", ("gate", "up", "down", "o"))])
def test_entries_a_model_lacks_beside_others_are_skipped_as_peft_skips_them(tmp_path: Path, model: str,
                                                                          planned: tuple[str, ...]) -> None:
    """peft refuses a list of targets only when no entry matches a module, and skips the entries that match
    nothing beside others: the usual 7-projection list trains on gpt-oss (no gate_proj: fused experts) and on
    DeepSeek-V3 (no q_proj, k_proj, v_proj: latent attention), so another tool's job plans the entries that match,
    with a note naming the skipped ones, and exits 0; a list of which none matches still exits 2."""
    job = _lf(tmp_path, model, SEVEN, transformers="5.0.0")
    assert set(job.workload.lora_targets or ()) == set(planned)
    assert any("peft skips" in n for n in job.notes)
    script = _write(tmp_path, "ax.yml", AXOLOTL.format(model=model, targets=SEVEN).replace(
        f"'{SEVEN}'", "[" + SEVEN.replace(",", ", ") + "]"))
    assert main(["plan", "--from", "axolotl", script, "--gpus", "8xH100", "--transformers", "5.0.0"]) in (0, 3)
    with pytest.raises(UserError, match=r"matches no module.*refuses targets of which none matches"):
        _lf(tmp_path, "openai/gpt-oss-20b", "gate_proj,up_proj")


def test_modules_to_save_of_each_tool_are_planned_as_trainable_copies(tmp_path: Path) -> None:
    """LLaMA-Factory's additional_target (and resize_vocab without it), axolotl's lora_modules_to_save and
    ms-swift's --modules_to_save are peft's modules_to_save: the embedding's and head's copies train whole."""
    base = LF.format(model="Qwen/Qwen2.5-7B", targets="q_proj,v_proj")
    for extra, saved in (("additional_target: embed_tokens,lm_head\n", ("embed", "head")),
                         ("resize_vocab: true\n", ("embed", "head")), ("additional_target: lm_head\n", ("head",))):
        job = read_job("llamafactory", _write(tmp_path, "lf.yaml", base + extra), JobOptions())
        assert job.workload.lora_saved == saved, extra
        assert not job.not_modelled
    ax = (AXOLOTL.format(model="Qwen/Qwen2.5-7B", targets=r".*\.q_proj")
          + "lora_modules_to_save: [embed_tokens, lm_head]\n")
    assert read_job("axolotl", _write(tmp_path, "a.yml", ax), JobOptions()).workload.lora_saved == ("embed", "head")
    sw = ("swift sft --model Qwen/Qwen2.5-7B --train_type lora --target_modules q_proj v_proj --modules_to_save "
          "embed_tokens lm_head --dataset x.jsonl\n")
    assert read_job("swift", _write(tmp_path, "s.sh", sw), JobOptions()).workload.lora_saved == ("embed", "head")


def test_modules_to_save_copies_are_planned_in_each_tool_s_dtype(tmp_path: Path) -> None:
    """peft keeps a modules_to_save copy in the dtype the module was loaded in (bf16 here); LLaMA-Factory then casts
    every trainable weight to fp32 unless pure_bf16: the same job plans about 2 bytes x 2 x (weight, gradient and
    two AdamW states) per copied weight more under LLaMA-Factory than under axolotl, where it was counted fp32
    alike."""
    import dataclasses

    from shardfit.foreign.asplanned import plan_job
    from shardfit.plan.estimate import state_bytes
    from shardfit.plan.hardware import parse_gpus

    shape = resolve_shape("Qwen/Qwen2.5-7B")
    lf = read_job("llamafactory", _write(tmp_path, "lf.yaml", LF.format(model="Qwen/Qwen2.5-7B", targets="q_proj")
                                         + "bf16: true\nadditional_target: lm_head\n"), JobOptions())
    pure = read_job("llamafactory", _write(tmp_path, "p.yaml", LF.format(model="Qwen/Qwen2.5-7B", targets="q_proj")
                                           + "pure_bf16: true\nadditional_target: lm_head\n"), JobOptions())
    ax = read_job("axolotl", _write(tmp_path, "a.yml", AXOLOTL.format(model="Qwen/Qwen2.5-7B", targets=r".*\.q_proj")
                                    + "lora_modules_to_save: [lm_head]\n"), JobOptions())
    head = shape.vocab * shape.hidden
    for job, copy_bytes in ((lf, 4), (pure, 2), (ax, 2)):
        w = job.workload
        assert w.lora_saved == ("head",) and w.precision == "bf16" and not w.frozen_fp32
        _, grads, _ = state_bytes(shape, w)
        _, no_copy, _ = state_bytes(shape, dataclasses.replace(w, lora_saved=()))
        assert grads - no_copy == pytest.approx(head * copy_bytes, rel=1e-9), job.tool
    fp_lf, fp_ax = (plan_job(j, shape, parse_gpus("1x80GB")).configured.per_gpu_gib for j in (lf, ax))
    # AdamW's two states of the copy, held through the step: fp32 under LLaMA-Factory, bf16 under axolotl
    assert fp_lf.optimizer - fp_ax.optimizer == pytest.approx(head * 4 / 2**30, rel=0.05)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-7B", "openai/gpt-oss-20b"])
def test_a_router_name_the_model_lacks_is_refused_or_skipped_as_peft_does(tmp_path: Path, model: str) -> None:
    """`gate` or `router` on a model without that router (a dense model; gpt-oss, whose router is `router`)
    matches no module: alone, peft raises "Target modules ... not found in the base model" (exit 2 quoting it);
    beside q_proj, peft skips it. Both were planned as every linear layer."""
    with pytest.raises(UserError, match=r"Target modules .* not found in the base model"):
        _lf(tmp_path, model, "gate", transformers="5.0.0")
    job = _lf(tmp_path, model, "q_proj,gate", transformers="5.0.0")
    assert job.workload.lora_targets == ("q",) and any("peft skips" in n for n in job.notes)
    if model == "Qwen/Qwen2.5-7B":
        with pytest.raises(UserError, match="not found in the base model"):
            _lf(tmp_path, model, "router", transformers="5.0.0")


def test_one_experts_down_proj_reaches_every_fused_expert_as_peft_moves_it(tmp_path: Path) -> None:
    """peft 0.21 moves `mlp.experts.0.down_proj` on Qwen3-MoE under transformers 5 onto every expert's fused
    down_proj (it moves any entry ending in .down_proj); the entry was refused as naming a module that no longer
    exists."""
    job = _lf(tmp_path, "Qwen/Qwen3-30B-A3B", "q_proj,mlp.experts.0.down_proj", transformers="5.0.0")
    assert job.workload.lora_rewritten == ("down",) and job.workload.lora_targets == ("q", "down")


@pytest.mark.parametrize("model", ["mistralai/Mixtral-8x7B-v0.1", "openai/gpt-oss-20b"])
def test_one_experts_modules_peft_does_not_move_match_nothing(tmp_path: Path, model: str) -> None:
    """`experts.0.gate_proj, experts.0.up_proj` (no `mlp.` prefix) on fused experts peft 0.21 does not rewrite:
    no such module exists, so peft raises NoMatchingPeftModuleError; they were planned as every linear layer (a
    review's tiny Mixtral/Qwen2-MoE under get_peft_model). Beside q_proj they are skipped, as peft skips them."""
    with pytest.raises(UserError, match="not found in the base model"):
        _lf(tmp_path, model, "experts.0.gate_proj,experts.0.up_proj", transformers="5.0.0")
    job = _lf(tmp_path, model, "q_proj,experts.0.gate_proj", transformers="5.0.0")
    assert job.workload.lora_targets == ("q",)


@pytest.mark.parametrize(("model", "kind"), [
    ("THUDM/chatglm3-6b", "chatglm"), ("baichuan-inc/Baichuan2-7B-Base", "baichuan"),
    ("deepseek-ai/deepseek-llm-7b-base", "llama"), ("THUDM/chatglm2-6b", "chatglm"),
    ("deepseek-ai/deepseek-math-7b-base", "llama")])
def test_compact_catalog_entries_have_their_config_model_type(model: str, kind: str) -> None:
    """peft's default targets are looked up by the catalog entry's model_type (a twin's by its twin's): ChatGLM2/3's
    config.json says chatglm (peft: query_key_value), Baichuan2's baichuan (no peft default: peft raises, the plan
    exits 2), deepseek-llm's and deepseek-math's llama (q_proj, v_proj). chatglm2-6b and deepseek-math-7b-base were
    planned on every linear layer while the type was guessed from the hub id."""
    from shardfit.foreign.job import ForeignJob
    from shardfit.foreign.targets import plan_peft_default
    from shardfit.plan.workload import Workload

    shape = resolve_shape(model)
    assert shape.model_type == kind
    job = ForeignJob(tool="hf", source="run.sh", model=model, workload=Workload(method="lora", lora_rank=8))
    if kind == "baichuan":
        with pytest.raises(UserError, match="baichuan"):
            plan_peft_default(job, "--use_peft", shape, "5.23.0")
    else:
        assert plan_peft_default(job, "--use_peft", shape, "5.23.0")[1] == \
            (["query_key_value"] if kind == "chatglm" else ["q_proj", "v_proj"])
