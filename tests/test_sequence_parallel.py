"""Sequence parallelism (Ulysses): the attention kernel on 2 gloo ranks against plain SDPA, and 2-rank CLI runs
against one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from shardfit.data.loader import collate
from shardfit.data.packing import PackedRow
from shardfit.data.tokenize import IGNORE
from shardfit.parallel.layout import Layout
from shardfit.parallel.sequence import shard_batch
from tests import sp_workers
from tests.families import make_family_model, tiny_text_config
from tests.helpers import free_port, read_jsonl, run_cli, save_with_tokenizer, train_here, write_config

CASES = [(2, True), (1, True), (4, False)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernel, routing and full fine-tune cases of tests/sp_workers.py on 2 gloo ranks, started once: their
    results' folder."""
    out = tmp_path_factory.mktemp("sp-kernel")
    mp.start_processes(sp_workers.attention_rank, args=(2, free_port(), CASES, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    return out


@pytest.mark.slow
def test_ulysses_attention_matches_sdpa(two_ranks: Path) -> None:
    """Forward and backward of each rank's slice equal the whole row's SDPA (fp32): GQA with key/value heads that
    split over the ranks, a single key/value head (repeated first), packed rows (a block-causal mask)."""
    for r in range(2):
        for (_, packed), got in zip(CASES, json.loads((two_ranks / f"rank-{r}.json").read_text()), strict=True):
            assert got["restarts"] is packed  # the mask is block-causal exactly where rows are packed
            assert got["out"] <= 1e-5 * got["scale"], got
            assert max(got["grads"]) <= 1e-5 * got["grad_scale"], got


def _run(tmp: Path, model: Path, data: Path, name: str, *flags: str, **over) -> Path:
    keys = dict(model=str(model), data=str(data), output_dir=str(tmp / name), precision="fp32", max_seq_len=192,
                micro_batch=4, grad_accum=1, lr=1e-2, log_steps=1, save_steps=100, max_steps=4, warmup_ratio=0.0,
                eval_split=0.1, eval_steps=2, lora={"rank": 4, "alpha": 8}, method="lora")
    keys.update(over)
    cfg = write_config(tmp / f"{name}.yaml", **keys)
    if not flags:
        train_here(cfg)
        return tmp / name
    r = run_cli("train", str(cfg), *flags, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / name


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Qwen3-MoE shrunk (2 blocks of 4 experts, top-2) with a load-balancing coefficient of 0.5, large enough that
    the loss the step trains on and the logged aux_loss show a slice's statistics taken for the row's."""
    config = tiny_text_config("Qwen3-MoE")
    config.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    return save_with_tokenizer(AutoModelForCausalLM.from_config(config), tmp_path_factory.mktemp("qwen3moe"),
                               tokenizer_dir)


def _figures(run: Path) -> tuple[list[float], list[float]]:
    lines = read_jsonl(run / "metrics.jsonl")
    return [m["loss"] for m in lines if "loss" in m], [m["eval_loss"] for m in lines if "eval_loss" in m]


def _same_as_one_process(tmp: Path, model: Path, data: Path, ranks: int = 2, **over) -> dict:
    """One process and `ranks` ranks in data groups of 2 splitting every row train and evaluate to the same
    losses, fp32, to 1e-5: the same global batch, the one process accumulating a micro-batch per data group."""
    single = _run(tmp, model, data, "single", grad_accum=ranks // 2, **over)
    split = _run(tmp, model, data, "split", "--nproc", str(ranks), sequence_parallel=2, **over)
    (ref, ref_eval), (got, got_eval) = _figures(single), _figures(split)
    assert len(got) == len(ref) == 4 and len(got_eval) == len(ref_eval) == 2
    for a, b in zip(ref + ref_eval, got + got_eval, strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    summary = json.loads((split / "summary.json").read_text())
    assert summary["world_size"] == ranks and summary["resolved"]["sequence_parallel"] == 2
    return summary


@pytest.mark.slow
def test_qwen2_lora_packed_rows_split_over_two_ranks(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """Qwen2 (4 heads, 2 key/value heads) with LoRA under DDP, packed rows (a block-causal mask across the split)."""
    summary = _same_as_one_process(tmp_path, tiny_qwen2, small_data, strategy="ddp")
    assert summary["packing"] is True


@pytest.mark.slow
@pytest.mark.heavy  # the Qwen2 case holds the split; this adds a full fine-tune, zero3 and checkpointing
def test_llama_full_checkpointed_split_over_two_ranks(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Llama, a full fine-tune sharded by zero3, with every block checkpointed (the all-to-all runs again in the
    recomputation)."""
    _same_as_one_process(tmp_path, tiny_llama, small_data, strategy="zero3", method="full", lr=1e-3,
                         grad_ckpt="full")


@pytest.mark.slow
@pytest.mark.heavy  # four ranks on the CI's cores; the 2-rank cases hold the same arithmetic
def test_two_data_groups_of_two_ranks(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """4 ranks under zero3: 2 data groups (each its own rows), each splitting its rows over 2 ranks."""
    _same_as_one_process(tmp_path, tiny_qwen2, small_data, ranks=4, strategy="zero3")


def test_a_rank_keeps_its_contiguous_slice_of_the_padded_rows() -> None:
    """Rows 7 wide over 2 ranks: padded to 8 (positions continue, no target), rank 1 keeps tokens 4-7 with their
    own positions and targets (the target of rank 0's last token is rank 1's first token, shifted before the
    cut), the labelled count is its slice's, and the attention gets the whole rows' positions."""
    rows = [PackedRow([10, 11, 12, 13, 14, 15, 16], [11, 12, 13, 14, 15, 16, IGNORE], [0, 1, 2, 3, 0, 1, 2]),
            PackedRow([20, 21, 22], [IGNORE, 22, 23], [0, 1, 2])]
    batch = collate(rows, pad_id=0)
    assert batch.restarts is True and batch.n_targets == 8
    parts = [shard_batch(batch, Layout(dp=1, dp_rank=0, sp=2, sp_rank=r)) for r in range(2)]
    assert parts[0].input_ids.tolist() == [[10, 11, 12, 13], [20, 21, 22, 0]]
    assert parts[0].targets[0].tolist() == [11, 12, 13, 14]
    assert parts[1].input_ids[0].tolist() == [14, 15, 16, 16]
    assert parts[1].position_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parts[1].targets.tolist() == [[15, 16, IGNORE, IGNORE], [IGNORE] * 4]
    assert [p.n_targets for p in parts] == [6, 2]
    assert parts[1].shard.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert parts[1].shard.restarts is True and parts[1].host_facts["sequence_shard"] is parts[1].shard
    whole = Layout(dp=2, dp_rank=1)
    assert shard_batch(batch, whole) is batch


@pytest.mark.slow
def test_load_balancing_loss_is_the_whole_rows(two_ranks: Path) -> None:
    """A mixture's load-balancing loss (the Switch form, nonlinear in the per-expert fractions) summed over the
    ranks of a split row, and its gradients and the expert load, are the whole row's (fp32), where each slice's
    own loss and load are not."""
    for r in range(2):
        got = json.loads((two_ranks / f"routing-{r}.json").read_text())
        assert got["aux"] <= 1e-5 * got["aux_scale"], got
        assert got["grads"] <= 1e-5 * got["grad_scale"], got
        assert got["load"] <= 1e-9, got
        # What the split would log and train on with each slice's own statistics: measurably another figure.
        assert got["slice_off"] > 1e-3 and got["slice_load"] != got["whole_load"], got


@pytest.mark.slow
def test_a_mixture_full_fine_tune_splits_where_a_slice_has_no_target(two_ranks: Path) -> None:
    """A full fine-tune of a tiny Qwen3-MoE (untied head, load-balancing loss on) on 2 gloo ranks, under DDP and
    under zero3 with checkpointing, rank 0's slices holding only prompt tokens: both ranks finish the step (each
    produced a gradient for every parameter, the head's too, so the engines' collectives stayed in step) and the
    gradients are one process's over the whole rows, fp32."""
    for r in range(2):
        got = json.loads((two_ranks / f"full-moe-{r}.json").read_text())
        assert got["untied"] and got["targets"] == (0 if r == 0 else 10), got
        for engine in ("ddp", "zero3"):
            assert got[engine]["missing"] == [], got
            assert got[engine]["err"] <= 1e-5 * got[engine]["scale"], got


MOE_FIGURES = ("aux_loss", "expert_load_min", "expert_load_max")


@pytest.mark.slow
@pytest.mark.heavy  # two runs of a mixture; GLM-4.5's attention is Qwen3-MoE's with a partial rotary and biases
def test_glm45_split_over_two_ranks(tmp_path: Path, tokenizer_dir: Path, small_data: Path) -> None:
    """GLM-4.5 (a dense first block, shared experts, balanced by a bias: no load-balancing loss) with LoRA under
    DDP, packed rows: one process's losses and expert load."""
    model = make_family_model("GLM-4.5", tmp_path / "glm45", tokenizer_dir)
    _same_as_one_process(tmp_path, model, small_data, strategy="ddp")
    ref, got = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("single", "split"))
    for k in MOE_FIGURES[1:]:
        a, b = [m[k] for m in ref if k in m], [m[k] for m in got if k in m]
        assert len(a) == 4 and b == pytest.approx(a, rel=1e-5), k


@pytest.mark.slow
@pytest.mark.heavy  # two runs of a mixture; the routing case of `two_ranks` holds the whole rows' statistics
def test_qwen3_moe_split_over_two_ranks_trains_the_whole_rows_balancing(tmp_path: Path, tiny_qwen3_moe: Path,
                                                                        small_data: Path) -> None:
    """Qwen3-MoE with LoRA under DDP, packed rows, its load-balancing loss on: the losses (which the loss the step
    trained on shapes), the load-balancing loss and the expert load are one process's, fp32, to 1e-5."""
    _same_as_one_process(tmp_path, tiny_qwen3_moe, small_data, strategy="ddp")
    ref, got = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("single", "split"))
    for k in MOE_FIGURES:
        a, b = [m[k] for m in ref if k in m], [m[k] for m in got if k in m]
        assert len(a) == 4 and b == pytest.approx(a, rel=1e-5), k


@pytest.mark.slow
@pytest.mark.heavy  # two runs of a mixture; the full fine-tune case of `two_ranks` holds the engines' gradients
def test_qwen3_moe_full_fine_tune_split_over_two_ranks(tmp_path: Path, tiny_qwen3_moe: Path,
                                                       small_data: Path) -> None:
    """A full fine-tune of Qwen3-MoE (untied head; some of rank 0's slices hold only prompt tokens) under zero3
    with every block checkpointed: one process's losses, load-balancing loss and expert load, fp32, to 1e-5."""
    _same_as_one_process(tmp_path, tiny_qwen3_moe, small_data, strategy="zero3", method="full", lr=1e-3,
                         grad_ckpt="full")
    ref, got = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("single", "split"))
    for k in MOE_FIGURES:
        a, b = [m[k] for m in ref if k in m], [m[k] for m in got if k in m]
        assert len(a) == 4 and b == pytest.approx(a, rel=1e-5), k


@pytest.mark.slow
@pytest.mark.heavy  # two runs of a mixture; the Qwen2 and routing cases hold the split's arithmetic
def test_qwen3_moe_qlora_split_over_two_ranks(tmp_path: Path, tiny_qwen3_moe: Path, small_data: Path) -> None:
    """QLoRA (torchao NF4: the attention's and the routed experts' weights) of Qwen3-MoE under zero3, packed
    rows: one process's losses, load-balancing loss and expert load, fp32, to 1e-5."""
    _same_as_one_process(tmp_path, tiny_qwen3_moe, small_data, strategy="zero3", method="qlora")
    ref, got = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("single", "split"))
    for k in MOE_FIGURES:
        a, b = [m[k] for m in ref if k in m], [m[k] for m in got if k in m]
        assert len(a) == 4 and b == pytest.approx(a, rel=1e-5), k


def test_the_families_balancing_loss_is_the_switch_form_of_the_summed_statistics() -> None:
    """`switch_loss` of `router_sums` is each family's own loss (so the sums may be added over a split row), less
    the tokens `keep` leaves out; a loss of another form is told apart (the rank then refuses the split)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_moe

    from shardfit.models.experts import AuxLoss, router_sums, switch_form, switch_loss

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, 8, generator=g) for _ in range(3))
    keep = torch.arange(10) < 7
    probs, counts = router_sums(logits, 2, keep=keep)
    for fn in (qwen3_moe, mixtral):
        assert switch_form(AuxLoss(fn, 8, 2, 0.01))
        assert switch_loss(probs, counts, 2) == pytest.approx(float(fn(tuple(x[:7] for x in logits), 8, 2)), rel=1e-6)
    assert not switch_form(AuxLoss(lambda *a: 2 * qwen3_moe(*a), 8, 2, 0.01))
