"""Pipeline parallelism (`pipeline_parallel: N`): the rules before anything loads, the cut of a decoder into
stages against the whole model, and 2-rank CLI runs (torch.distributed.pipelining's 1F1B over gloo) against one
process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen2VLConfig, Qwen3VLConfig

from shardfit.config import Config
from shardfit.errors import UserError
from shardfit.parallel import launch
from shardfit.parallel.pipeline import cut, cut_looped, looped_stages, stage_blocks
from shardfit.resolve.dims import ParallelDims
from shardfit.resolve.pipeline import check_layout, check_model, facts_of_config, stages_per_rank
from tests.helpers import make_tiny_model, read_jsonl, run_cli, run_here, train_here, write_config


def _cfg(**over) -> Config:
    return dataclasses.replace(Config(), **{"pipeline_parallel": 2, "grad_accum": 2, **over})


def test_layout_accepted_with_a_rank_per_stage() -> None:
    check_layout(_cfg(), 2)
    check_layout(dataclasses.replace(Config(), pipeline_parallel=1), 1)  # off: nothing to check


@pytest.mark.parametrize(("over", "world", "words"), [
    ({}, 3, "does not divide the job's 3 ranks"),
    ({"strategy": "model_parallel"}, 4, "2 stages x 2 data-parallel ranks"),
    ({"sequence_parallel": 2}, 2, "sequence_parallel: 1"),
    ({"objective": "dpo"}, 2, "objective sft only"),
    ({"method": "qlora"}, 2, "method lora or full"),
    ({"compile": True}, 2, "compile: false"),
    ({"grad_accum": 1}, 2, "grad_accum: 2 or more"),
    ({"eval_metrics": ["exact_match"]}, 2, "eval_metrics: []"),
    ({"pipeline_schedule": "interleaved_1f1b"}, 4, "pipeline_schedule: 1f1b, or launch 2 ranks"),
    ({"pipeline_schedule": "zero_bubble"}, 4, "pipeline_schedule: zero_bubble on 4 ranks"),
    ({"pipeline_schedule": "zero_bubble", "grad_accum": 5}, 2, "set grad_accum to one of 2, 3, 4, 6, 8"),
])
def test_layout_refusals_name_the_key_and_the_fix(over: dict, world: int, words: str) -> None:
    with pytest.raises(UserError, match="pipeline_parallel") as e:
        check_layout(_cfg(**over), world, over.get("strategy", "ddp"))
    # The fix: what divides (resolve/dims.py names it), or switching the pipeline off.
    assert words in str(e.value) and ("pipeline_parallel: 1" in str(e.value) or "use one of 1, 3" in str(e.value))


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_stages_times_data_parallel_accepted(strategy: str) -> None:
    check_layout(_cfg(), 4, strategy)
    check_layout(_cfg(), 2, "single")  # one rank per stage: no strategy runs over a stage's ranks


def test_each_stage_is_held_by_its_data_parallel_group() -> None:
    """4 ranks as 2 stages x 2 replicas (the layout's mesh, over a fake process group): ranks 0-1 hold stage 0 and
    2-3 stage 1; the strategy works over {0, 1} or {2, 3}, activations travel over {0, 2} or {1, 3}, and the rows
    are split two ways (dp_rank), not four."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardfit.parallel.env import DistEnv
    from shardfit.parallel.layout import layout_of

    seen = []
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            env = DistEnv(rank=rank, world=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
            lay = layout_of(env, ParallelDims(world=4, pp=2))
            seen.append((lay.pp_rank, lay.dp_rank, lay.dp, dist.get_process_group_ranks(lay.stage_mesh.get_group()),
                         dist.get_process_group_ranks(lay.pp_group)))
        finally:
            dist.destroy_process_group()
    assert seen == [(0, 0, 2, [0, 1], [0, 2]), (0, 1, 2, [0, 1], [1, 3]),
                    (1, 0, 2, [2, 3], [0, 2]), (1, 1, 2, [2, 3], [1, 3])]


def test_interleaved_stages_per_rank_and_block_count() -> None:
    assert stages_per_rank(_cfg()) == 1
    assert stages_per_rank(_cfg(pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=3)) == 3
    assert stages_per_rank(_cfg(pipeline_schedule="zero_bubble", pipeline_stages_per_rank=3)) == 3
    check_layout(_cfg(pipeline_schedule="interleaved_1f1b"), 2, "ddp")
    check_layout(_cfg(pipeline_schedule="zero_bubble"), 2, "ddp")
    facts = facts_of_config(Qwen2Config(num_hidden_layers=5))
    check_model(2, facts, "qwen2", "lora", per_rank=2)
    with pytest.raises(UserError, match=r"2 x 3 = 6 stages .*pipeline_stages_per_rank of at most 2"):
        check_model(2, facts, "qwen2", "lora", per_rank=3)


def test_model_rules_count_blocks_and_name_what_is_not_cut() -> None:
    check_model(2, facts_of_config(Qwen2Config(num_hidden_layers=2)), "qwen2", "full")
    with pytest.raises(UserError, match="2 decoder blocks, fewer than the 4 stages"):
        check_model(4, facts_of_config(Qwen2Config(num_hidden_layers=2)), "qwen2", "lora")
    check_model(2, facts_of_config(Qwen2VLConfig()), "qwen2-vl", "lora")  # its tower on the first stage
    for config, why in ((MixtralConfig(), "mixture of experts"), (Qwen3VLConfig(), r"other than Qwen2\(.5\)-VL")):
        with pytest.raises(UserError, match=why):
            check_model(2, facts_of_config(config), "m", "lora")
    tied = facts_of_config(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True))
    check_model(2, tied, "llama", "lora")  # the tied weight stays frozen
    with pytest.raises(UserError, match="method: lora"):
        check_model(2, tied, "llama", "full")


def test_blocks_split_contiguously_the_first_stages_taking_the_rest() -> None:
    assert stage_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


def _tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("packed", [False, True])
def test_stages_in_turn_give_the_whole_models_hidden_states(arch: str, packed: bool) -> None:
    """Stage 0 (embedding, blocks 0-1), 1 (blocks 2-3), 2 (block 4, final norm) run one after another equal the
    whole decoder, with each stage computing the rotary embeddings and (packed rows) the block-causal mask from
    the positions; the stages' parameter names are the whole model's, each name on one stage."""
    ids = torch.randint(0, 128, (2, 12))
    pos = torch.arange(12).repeat(2, 1)
    if packed:
        pos[0, 5:] = torch.arange(7)  # a second example from token 5 on
    with torch.no_grad():
        want = _tiny(arch).model(input_ids=ids, position_ids=pos, attention_mask=None).last_hidden_state
    stages = [cut(_tiny(arch), s, 3) for s in range(3)]
    if packed:  # the whole model needs the packed mask spelled out; the stages build it themselves
        from shardfit.models.masks import mask_argument

        whole = _tiny(arch)
        with torch.no_grad():
            want = whole.model(input_ids=ids, position_ids=pos, **mask_argument(whole.model, pos, True)
                               ).last_hidden_state
    h = ids
    with torch.no_grad():
        for stage in stages:
            h = stage(h, pos)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    names = [set(dict(s.model.named_parameters())) for s in stages]
    whole_names = set(dict(_tiny(arch).named_parameters()))
    assert set.union(*names) == whole_names and sum(map(len, names)) == len(whole_names)
    assert stages[0].head is None and stages[2].head is not None
    assert stages[1].model.model.embed_tokens is None and stages[1].model.lm_head is None


@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_a_named_sharded_strategy_over_lone_stages_computes_under_autocast(strategy: str) -> None:
    """strategy: zero3 (or zero3_offload) with as many stages as ranks: the stage as train builds it from the
    resolved job (its strategy over the stage's one rank, the pipeline's autocast) computes in bf16, as one process
    under autocast does, not in the fp32 of an unwrapped stage that FSDP2's mixed precision never reached."""
    from shardfit import strategy as strategies
    from shardfit.dtypes import DTYPES
    from shardfit.parallel.layout import Layout
    from shardfit.parallel.parallelize import parallelize
    from shardfit.plan.hardware import parse_gpus
    from shardfit.resolve import DeviceFacts, resolve_job
    from shardfit.train.pipeline import PipelineRun

    cfg = _cfg(model="Qwen/Qwen2.5-0.5B-Instruct", strategy=strategy, method="lora")
    job, _ = resolve_job(cfg, parse_gpus("2x24GB", 1, None), DeviceFacts("cuda", True), nproc=2)
    cpu = torch.device("cpu")
    stage = cut(_tiny("qwen2"), 0, 2)
    PipelineRun([stage], Layout(dp=1, dp_rank=0, pp=2), cpu, 64, DTYPES[job.autocast] if job.autocast else None)
    module = parallelize(stage, strategies.get(job.strategy), device=cpu, world=job.dims.stage_ranks,
                         precision=job.precision)
    seen: list[torch.dtype] = []  # the residual stream stays fp32 under autocast: the projections' outputs tell
    stage.model.model.layers["0"].mlp.down_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with torch.no_grad():
        module(torch.randint(0, 128, (2, 12)), torch.arange(12).repeat(2, 1))
    assert module is stage and seen == [torch.bfloat16]


def test_looped_stages_in_turn_give_the_whole_models_hidden_states() -> None:
    """2 ranks x 2 stages each of a five-block Qwen2 (stages 0-3: blocks 0-1, 2, 3, 4): rank 0 holds stages 0 and 2
    with the embedding, rank 1 stages 1 and 3 with the final norm and head; run in stage order they give the whole
    decoder's hidden states, and each parameter is on exactly one rank."""
    assert looped_stages(1, 2, 3) == [1, 3, 5]
    ids, pos = torch.randint(0, 128, (2, 12)), torch.arange(12).repeat(2, 1)
    with torch.no_grad():
        want = _tiny("qwen2").model(input_ids=ids, position_ids=pos, attention_mask=None).last_hidden_state
    ranks = [cut_looped(_tiny("qwen2"), r, 2, 2) for r in range(2)]
    assert [s.stage for s in ranks[0]] == [0, 2] and [s.blocks for s in ranks[1]] == [range(2, 3), range(4, 5)]
    h = ids
    with torch.no_grad():
        for stage in sorted((s for r in ranks for s in r), key=lambda s: s.stage):
            h = stage(h, pos)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    names = [set(dict(r[0].model.named_parameters())) for r in ranks]
    assert set.union(*names) == set(dict(_tiny("qwen2").named_parameters())) and not names[0] & names[1]
    assert ranks[0][0].model.lm_head is None and ranks[1][0].model.model.embed_tokens is None


def _checkpoint_keys(stage: int | None, flat: bool = False) -> dict[str, Any]:
    """The DCP keys (and values) a LoRA'd tiny Qwen2 after one AdamW step saves: the whole model's (`stage`
    None, under the loss module, as one process saves) or one of its 2 stages'."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from shardfit.train.checkpoint import TrainState
    from shardfit.train.loss import CausalLMLoss
    from shardfit.train.optim import build_optimizer

    model = get_peft_model(_tiny("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    module = CausalLMLoss(model) if stage is None else cut(model, stage, 2)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, 1e-2, 0.0)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    flat_sd, _ = flatten_state_dict({"train": TrainState(module, optimizer, flat=flat).state_dict()})
    return flat_sd


def test_a_stages_checkpoint_is_a_part_of_the_whole_models() -> None:
    """What a stage saves has one process's keys: the two stages' weights and AdamW moments together are the
    whole model's, each on one stage, and the param groups are by index on every stage, so DCP's load by name
    reshards a checkpoint between layouts (tested end to end below). The older flattened layout is told apart."""
    from shardfit.train.checkpoint import flat_optimizer

    whole, first, second = _checkpoint_keys(None), _checkpoint_keys(0), _checkpoint_keys(1)
    groups = {k for k in whole if k.startswith("train.optim.param_groups.")}
    assert "train.optim.param_groups.0.lr" in groups
    tensors = [{k for k, v in sd.items() if isinstance(v, torch.Tensor)} for sd in (whole, first, second)]
    assert tensors[1] | tensors[2] == tensors[0] and not tensors[1] & tensors[2]
    assert any(".layers.0." in k and "exp_avg_sq" in k for k in tensors[1])
    assert any(".layers.4." in k and k.startswith("train.model.") for k in tensors[2])
    for sd in (first, second):
        assert {k for k in sd if k.startswith("train.optim.param_groups.")} == groups
        assert not flat_optimizer(sd)
    assert flat_optimizer(_checkpoint_keys(1, flat=True)) and not flat_optimizer(whole)


def _run(tmp: Path, model: Path, data: Path, name: str, *flags: str, **over) -> Path:
    keys = dict(model=str(model), data=str(data), output_dir=str(tmp / name), precision="fp32", max_seq_len=192,
                micro_batch=2, grad_accum=2, lr=1e-2, log_steps=1, save_steps=2, max_steps=4, warmup_ratio=0.0,
                eval_split=0.1, eval_steps=2, lora={"rank": 4, "alpha": 8}, method="lora")
    keys.update(over)
    cfg = write_config(tmp / f"{name}.yaml", **keys)
    if not flags:
        train_here(cfg)
        return tmp / name
    r = run_cli("train", str(cfg), *flags, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / name


def _losses(run: Path) -> list[float]:
    return [m.get("loss", m.get("eval_loss")) for m in read_jsonl(run / "metrics.jsonl")]


def _same_weights(a: Path, b: Path, rtol: float) -> None:
    x, y = load_file(a), load_file(b)
    assert sorted(x) == sorted(y)
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=rtol, atol=rtol * float(x[k].abs().max()))


def _same_as_one_process(tmp: Path, model: Path, data: Path, **over) -> tuple[Path, Path]:
    """One process and 2 pipeline stages (grad_accum 2: two micro-batches through 1F1B) give the same train and
    eval losses, fp32, to 1e-5, and the same trained weights."""
    single = _run(tmp, model, data, "single", **over)
    pp = _run(tmp, model, data, "pp", "--nproc", "2", pipeline_parallel=2, **over)
    ref, got = _losses(single), _losses(pp)
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-5)
    summary = json.loads((pp / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resolved"]["pipeline_parallel"] == 2
    # The whole model's trainable parameters, summed over the stages.
    assert summary["trainable_params"] == json.loads((single / "summary.json").read_text())["trainable_params"]
    return single, pp


@pytest.mark.slow
@pytest.mark.heavy  # the interleaved case holds the schedule and the adapter; this adds export --merge
def test_qwen2_lora_over_two_stages(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """LoRA: the adapter has one process's keys and values, its config the same targets; export --merge gives
    the same model."""
    single, pp = _same_as_one_process(tmp_path, tiny_qwen2, small_data)
    _same_weights(single / "adapter" / "adapter_model.safetensors", pp / "adapter" / "adapter_model.safetensors",
                  1e-4)
    configs = [json.loads((r / "adapter" / "adapter_config.json").read_text()) for r in (single, pp)]
    assert sorted(configs[0]["target_modules"]) == sorted(configs[1]["target_modules"])
    for run in (single, pp):
        # fp32: export's default bf16 rounds two merges that agree to 1e-7 one ulp apart where a weight sits on a
        # rounding boundary, which says nothing of the pipeline
        r = run_cli("export", str(run), "--merge", "--dtype", "fp32", env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
    _same_weights(single / "model" / "model.safetensors", pp / "model" / "model.safetensors", 1e-5)


@pytest.mark.slow
@pytest.mark.heavy  # the LoRA case holds the schedule and the loss; this adds every weight training and resume
def test_qwen2_full_over_two_stages_resumes_on_its_layout(tmp_path: Path, tiny_qwen2: Path,
                                                           small_data: Path) -> None:
    """A full fine-tune: the same losses and model; a kill at step 3 resumes from step 2 to the same losses."""
    _, pp = _same_as_one_process(tmp_path, tiny_qwen2, small_data, method="full", lr=1e-3)
    keys = dict(model=str(tiny_qwen2), data=str(small_data), output_dir=str(tmp_path / "killed"),
                precision="fp32", max_seq_len=192, micro_batch=2, grad_accum=2, lr=1e-3, log_steps=1,
                save_steps=2, max_steps=4, warmup_ratio=0.0, eval_split=0.1, eval_steps=2, method="full",
                pipeline_parallel=2)
    cfg = write_config(tmp_path / "killed.yaml", **keys)
    r = run_cli("train", str(cfg), "--nproc", "2",
                env={"OMP_NUM_THREADS": "1", "SHARDFIT_TEST_FAULT": "raise:rank=1:step=3"})
    assert r.returncode != 0
    r = run_cli("train", str(cfg), "--nproc", "2", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(tmp_path / "killed") == pytest.approx(_losses(pp), rel=1e-5)


# Two ways to run the same global batch of 4 rows: 2 stages (one replica, 2 micro-batches through 1F1B), or zero3
# over 2 ranks (2 replicas, one micro-batch each); one process runs `_run`'s grad_accum 2.
_LAYOUTS = {"pp": {"pipeline_parallel": "2", "strategy": "ddp", "grad_accum": "2"},
            "zero3": {"pipeline_parallel": "1", "strategy": "zero3", "grad_accum": "1"},
            "one": {"pipeline_parallel": "1", "strategy": "auto", "grad_accum": "2"}}


def _resumed_on_another_layout(tmp: Path, model: Path, data: Path, saved: str, resumed: str) -> None:
    """A LoRA run on layout `saved`, rank 1 killed at step 3, resumes its step-2 checkpoint on layout `resumed` (2
    ranks, or one process for `one`): the train and eval losses and the adapter are the uninterrupted one
    process's (fp32)."""
    single = _run(tmp, model, data, "single")
    keys = dict(model=str(model), data=str(data), output_dir=str(tmp / "moved"), precision="fp32", max_seq_len=192,
                micro_batch=2, lr=1e-2, log_steps=1, save_steps=2, max_steps=4, warmup_ratio=0.0, eval_split=0.1,
                eval_steps=2, lora={"rank": 4, "alpha": 8}, method="lora")
    cfg = write_config(tmp / "moved.yaml", **keys)
    env = {"OMP_NUM_THREADS": "1"}

    def train(layout: str, fault: str | None = None) -> Any:
        sets = [arg for k, v in _LAYOUTS[layout].items() for arg in ("--set", f"{k}={v}")]
        return run_cli("train", str(cfg), "--nproc", "1" if layout == "one" else "2", *sets,
                       env={**env, "SHARDFIT_TEST_FAULT": fault} if fault else env)

    r = train(saved, "raise:rank=1:step=3")
    assert r.returncode != 0 and (tmp / "moved" / "checkpoints" / "step-2").is_dir(), r.stderr[-2000:]
    r = train(resumed)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "(step 2)" in r.stderr, r.stderr[-2000:]
    got, ref = _losses(tmp / "moved"), _losses(single)
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-5)
    _same_weights(single / "adapter" / "adapter_model.safetensors",
                  tmp / "moved" / "adapter" / "adapter_model.safetensors", 1e-4)


@pytest.mark.slow
@pytest.mark.heavy  # the resolver and stage tests above hold its ground without launching ranks
def test_a_named_zero3_over_lone_stages_trains_as_ddp_under_autocast(tmp_path: Path, tiny_qwen2: Path,
                                                                      small_data: Path) -> None:
    """strategy: zero3, 2 stages on 2 ranks, bf16: the run is ddp per stage under autocast, and says why."""
    run = _run(tmp_path, tiny_qwen2, small_data, "pp", "--nproc", "2", pipeline_parallel=2, strategy="zero3",
               precision="bf16", max_steps=2, save_steps=100, eval_steps=100)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["strategy"], summary["resolved"]["autocast"]) == ("ddp", "bf16")
    assert summary["resolved"]["why"][0].startswith("one rank per pipeline stage: strategy zero3 -> ddp")


@pytest.mark.slow
# test_a_stages_checkpoint_is_a_part_of_the_whole_models holds a stage's checkpoint, the interleaved run its training
@pytest.mark.heavy
def test_two_stages_resume_under_zero3(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """Saved by 2 pipeline stages, resumed with zero3 on 2 ranks: each stage's share of the weights and AdamW
    moments lands in FSDP2's shards by name, with the schedule's step and the data position."""
    _resumed_on_another_layout(tmp_path, tiny_qwen2, small_data, "pp", "zero3")


@pytest.mark.slow
@pytest.mark.heavy  # the reverse of the case above: FSDP2's shards into the stages
def test_zero3_resumes_over_two_stages(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    _resumed_on_another_layout(tmp_path, tiny_qwen2, small_data, "zero3", "pp")


@pytest.mark.slow
@pytest.mark.heavy  # the stages' checkpoint into one process: the zero3 case above holds the gathering by name
def test_two_stages_resume_in_one_process(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    _resumed_on_another_layout(tmp_path, tiny_qwen2, small_data, "pp", "one")


@pytest.mark.slow
@pytest.mark.heavy  # 4 ranks on a 2-core machine; the layout's groups are unit-tested in test_dims.py
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_stages_times_two_replicas(tmp_path: Path, tiny_qwen2: Path, small_data: Path, strategy: str) -> None:
    """4 ranks as 2 stages x 2 data-parallel replicas (the strategy over each stage's 2 ranks) give one process's
    losses for the same global batch (micro_batch 1 x grad_accum 2 x 2 replicas), and the same adapter. The
    clipping norm (0.1, below the gradients' ~0.25) is the one process's: over both stages, once per replica."""
    over = dict(micro_batch=1, max_steps=3, eval_steps=3, save_steps=3, max_grad_norm=0.1)
    single = _run(tmp_path, tiny_qwen2, small_data, "single", grad_accum=4, **over)
    pp = _run(tmp_path, tiny_qwen2, small_data, "ppdp", "--nproc", "4", pipeline_parallel=2, strategy=strategy,
              **over)
    ref, got = _losses(single), _losses(pp)
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=1e-5)
    summary = json.loads((pp / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["examples_per_step"] == 4
    _same_weights(single / "adapter" / "adapter_model.safetensors", pp / "adapter" / "adapter_model.safetensors",
                  1e-4)


@pytest.mark.slow
@pytest.mark.heavy  # 4 ranks, three runs; the LoRA case above holds the schedule under data parallelism
def test_full_zero3_stages_times_replicas_resume(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """A full fine-tune over 2 stages x 2 zero3 replicas: a rank killed at step 3 resumes from the step-2
    checkpoint (each stage's shards, under the whole model's names) to the uninterrupted run's losses and model."""
    keys = dict(model=str(tiny_qwen2), data=str(small_data), precision="fp32", max_seq_len=192, micro_batch=1,
                grad_accum=2, lr=1e-3, log_steps=1, save_steps=2, max_steps=4, warmup_ratio=0.0, eval_split=0.1,
                eval_steps=2, method="full", pipeline_parallel=2, strategy="zero3")
    env = {"OMP_NUM_THREADS": "1"}
    runs = {}
    for name, fault in (("whole", None), ("killed", "raise:rank=1:step=3")):
        cfg = write_config(tmp_path / f"{name}.yaml", output_dir=str(tmp_path / name), **keys)
        r = run_cli("train", str(cfg), "--nproc", "4", env={**env, "SHARDFIT_TEST_FAULT": fault} if fault else env)
        if fault:
            assert r.returncode != 0
            r = run_cli("train", str(cfg), "--nproc", "4", env=env)
            assert "resumed from" in r.stderr and "(step 2)" in r.stderr, r.stderr[-2000:]
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = tmp_path / name
    assert _losses(runs["killed"]) == _losses(runs["whole"]) and len(_losses(runs["whole"])) == 6
    _same_weights(runs["whole"] / "model" / "model.safetensors", runs["killed"] / "model" / "model.safetensors", 0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", pytest.param("zero_bubble", marks=pytest.mark.heavy)])
def test_looped_schedules_over_two_ranks(tmp_path: Path, tokenizer_dir: Path, small_data: Path,
                                         schedule: str) -> None:
    """A four-block Qwen2 as 2 ranks x 2 looped stages over 4 micro-batches, under interleaved 1F1B or torch's
    interleaved zero bubble (each backward split into input- and weight-gradient passes, the LoRA base frozen),
    gives one process's train and eval losses (fp32, 1e-5) and adapter."""
    model = make_tiny_model(tmp_path / "q4", tokenizer_dir, "qwen2", tie=False, layers=4)
    over = dict(max_steps=3, eval_steps=3, save_steps=3, grad_accum=4)
    single = _run(tmp_path, model, small_data, "single", **over)
    pp = _run(tmp_path, model, small_data, "pp", "--nproc", "2", pipeline_parallel=2, pipeline_schedule=schedule,
              **over)
    ref, got = _losses(single), _losses(pp)
    assert len(got) == len(ref) == 4
    assert got == pytest.approx(ref, rel=1e-5)
    _same_weights(single / "adapter" / "adapter_model.safetensors", pp / "adapter" / "adapter_model.safetensors",
                  1e-4)


def test_train_refuses_before_launching(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """More stages than the model's 2 blocks: exit 2 before any rank starts, naming the key. The refusal comes
    before the launch, so the CLI's `main` runs in this process with the launch recorded, never run."""
    launched: list[list[str]] = []
    monkeypatch.setattr(launch, "relaunch", lambda cmd, env: launched.append(cmd) or 0)
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_qwen2), data=str(small_data),
                       output_dir=str(tmp_path / "o"), grad_accum=4)
    code, _, err = run_here(capsys, "train", str(cfg), "--nproc", "4", "--set", "pipeline_parallel=4")
    assert code == 2 and "pipeline_parallel: 4" in err and "2 decoder blocks" in err, err
    assert not launched and "launching" not in err and "Traceback" not in err
