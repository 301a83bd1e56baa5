"""`strategy: auto` and sequence_parallel (resolve/decide.py `_auto_sequence_parallel`): when one row does not fit
on a GPU under any strategy, the smallest N of 2, 4, 8 that divides the ranks and the heads and makes the job fit;
rows stay whole otherwise."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.choose import plan_for_config
from shardfit.plan.hardware import parse_gpus
from shardfit.resolve import DeviceFacts, decide, resolve_job
from shardfit.resolve.decide import job_hardware_of, settled

GPU = DeviceFacts("cuda", True)
H100 = parse_gpus("8xH100")


def _long(seq: int, **over) -> Config:
    """Qwen3-8B LoRA, one row per micro-batch, every block checkpointed: only the row's own length can stop it."""
    keys = dict(model="Qwen/Qwen3-8B", method="lora", max_seq_len=seq, micro_batch=1, grad_ckpt="full",
                packing=False)
    keys.update(over)
    return Config(**keys)


def test_a_row_too_long_for_one_gpu_is_split_over_the_fewest_ranks_that_fit() -> None:
    """139,264 tokens on 8 x H100: no strategy fits the whole row on a GPU; split over 2 ranks it fits, and auto
    says so, with the global batch it then takes."""
    job, plan = resolve_job(_long(139264), H100, GPU)
    assert job.sequence_parallel == 2 and job.world == 8 and job.dims.dp == 4
    assert plan is not None and plan.workload.sequence_parallel == 2 and plan.fits(job.strategy)
    assert job.why[0].startswith("sequence_parallel auto -> 2: one 139,264-token row does not fit")
    assert "micro_batch x grad_accum x 4 examples" in job.why[0]
    assert settled(_long(139264), job).sequence_parallel == 2  # what config.yaml records and the ranks read
    # The choice is the smallest: the whole row does not fit under any multi-rank strategy.
    whole = plan_for_config(dataclasses.replace(_long(139264), precision="bf16", compile=False),
                            job_hardware_of(H100, None, 8, 1))
    assert whole is not None and not any(c.fits for c in whole.candidates if c.strategy in ("ddp", "zero3"))


@pytest.mark.parametrize("seq,n", [(196608, 4), (229376, 8)])
def test_a_longer_row_needs_more_ranks(seq: int, n: int) -> None:
    """Longer rows: 2 ranks no longer hold them; the choice grows to the next N that fits."""
    job, _ = resolve_job(_long(seq), H100, GPU)
    assert job.sequence_parallel == n and job.strategy in ("ddp", "zero2", "zero3", "zero3_offload")
    assert f"split over {n} ranks it takes" in job.why[0] and f"under {job.strategy}" in job.why[0]


def test_nothing_fits_past_the_last_n() -> None:
    """262,144 tokens: even 8 ranks do not hold one row; auto says nothing fits (exit 3), as without the split."""
    with pytest.raises(DoesNotFitError):
        resolve_job(_long(262144), H100, GPU)


@pytest.mark.parametrize("cfg", [
    _long(4096),  # fits whole: rows stay whole
    _long(131072, strategy="zero3"),  # an explicit strategy: the user's layout, refused by the plan if it must be
    _long(131072, sequence_parallel=4),  # an explicit split: kept as given
])
def test_rows_stay_as_configured_where_auto_has_nothing_to_decide(cfg: Config) -> None:
    try:
        job, _ = resolve_job(cfg, H100, GPU)
    except DoesNotFitError:
        assert cfg.strategy != "auto"
        return
    assert job.sequence_parallel == cfg.sequence_parallel
    assert not any(w.startswith("sequence_parallel auto") for w in job.why)


def test_a_batch_too_large_is_not_a_reason_to_split_rows() -> None:
    """4,096-token rows with micro-batch 64 and no checkpointing do not fit, but micro-batch 1 would: a smaller
    batch is the fix, so auto keeps the rows whole (and says nothing fits)."""
    cfg = _long(4096, micro_batch=64, grad_ckpt="none")
    with pytest.raises(DoesNotFitError):
        resolve_job(cfg, H100, GPU, nproc=8)


def test_a_job_the_split_refuses_is_never_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preference objective, which sequence_parallel refuses (resolve/sequence.py): no N is tried, and the job
    does not fit (exit 3). Were the rules not asked, auto would pick 4 ranks and the split's rule would then refuse
    the job it chose (exit 2)."""
    cfg = _long(131072, objective="dpo")
    with pytest.raises(DoesNotFitError):
        resolve_job(cfg, H100, GPU, nproc=8)
    monkeypatch.setattr(decide, "_split_allowed", lambda *_: True)
    with pytest.raises(UserError, match="sequence_parallel: 4 trains objective sft only"):
        resolve_job(cfg, H100, GPU, nproc=8)


def test_plan_suggests_the_split_auto_would_choose(capsys: pytest.CaptureFixture[str]) -> None:
    """`shardfit plan` of a row that fits no GPU: the first alternative is the split, with its flag; not for a
    preference objective, which the split refuses."""
    flags = ["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "8xH100", "--seq", "131072", "--batch", "1",
             "--grad-ckpt", "full"]
    assert main(flags) == 3
    out = capsys.readouterr().out
    first = out.split("Nearest alternatives:\n")[1].splitlines()[0]
    assert first.startswith("  - every row split over 2 GPUs (--sequence-parallel 2): ") and "GiB per GPU" in first
    assert main([*flags, "--sequence-parallel", "2"]) == 0  # as suggested: it fits
    capsys.readouterr()
    main([*flags, "--objective", "dpo"])
    assert "--sequence-parallel" not in capsys.readouterr().out


def test_a_split_that_cannot_divide_the_ranks_names_the_nodes_it_needs(capsys: pytest.CaptureFixture) -> None:
    """70B full at 64k tokens fits 2 nodes of 8x24.0GB split 16 ways, but 3 such nodes (24 ranks) found no split (16
    does not divide 24; 8 does not fit) and said nothing fits even with 16x the GPUs. The plan now names the node
    count the fitting split can be laid out on."""
    flags = ["plan", "--model", "meta-llama/Llama-3.1-70B", "--gpus", "8x24.0GB", "--method", "full", "--seq",
             "65536", "--batch", "1"]
    assert main([*flags, "--nodes", "3"]) == 3
    first = capsys.readouterr().out.split("Nearest alternatives:\n")[1].splitlines()[0]
    assert first.startswith("  - every row split over 16 GPUs, on 2 node(s) (16 does not divide the 24 ranks of 3 "
                            "nodes") and "(--nodes 2 --sequence-parallel 16): zero3_offload" in first, first
    assert main([*flags, "--nodes", "2", "--sequence-parallel", "16"]) == 0  # as suggested: it fits


def test_check_and_train_name_the_nodes_a_split_that_fits_needs() -> None:
    """The same 70B job as resolved by check and train (strategy auto): on 2 nodes auto splits 16 ways and fits;
    on 3 nodes no split of the 24 ranks fits and the refusal said "none found". It now names the 2-node layout in
    config overrides."""
    cfg = Config(model="meta-llama/Llama-3.1-70B", method="full", max_seq_len=65536, micro_batch=1,
                 grad_ckpt="full")
    node = parse_gpus("8x24.0GB")
    job, _ = resolve_job(cfg, node, GPU, nnodes=2)
    assert job.sequence_parallel == 16 and job.world == 16
    with pytest.raises(DoesNotFitError) as e:
        resolve_job(cfg, node, GPU, nnodes=3)
    said = str(e.value)
    assert "every row split over 16 GPUs, on 2 node(s) (16 does not divide the 24 ranks of 3 nodes" in said, said
    assert "(--nnodes 2 --set sequence_parallel=16)" in said and said.count("on 2 node(s)") == 1, said
