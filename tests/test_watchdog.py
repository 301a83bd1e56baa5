"""The watchdog and the uneven-work guards: the hang summary, stack reading, the watchdog protocol over a real
TCPStore (in one process), spawned gloo ranks for evaluation and agreement, and a real two-node run in which one
rank stalls (named by the watchdog) and then raises (the other node stops in seconds, pointing at it)."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardfit.data.loader import BatchSchedule
from shardfit.data.tokenize import Encoded
from shardfit.errors import UserError
from shardfit.parallel import faults
from shardfit.parallel.env import DistEnv
from shardfit.parallel.hang import RankState, summarize
from shardfit.parallel.sidechannel import SideChannel
from shardfit.parallel.stacks import where_is
from shardfit.parallel.watchdog import PeerFailure, Watchdog, WatchdogSettings
from shardfit.train.evaluate import evaluate
from tests import dist_workers
from tests.helpers import ROOT, free_port, write_config


def _until(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def state(rank: int, where: str | None = "backward", enqueued: int | None = 41, pending: str | None = None,
          collective: str | None = None, phase: str = "step 4") -> RankState:
    seq = enqueued if enqueued is not None else 0
    return RankState(rank, "h", 100 + rank, phase, where, 12.0, collective, "shardfit/train/recipe.py:250 in fit",
                     [{"op": pending, "seq": seq, "pg": "0"}] if pending else [],
                     {"0": enqueued} if enqueued is not None else {})


# -- the summary ------------------------------------------------------------------------------------------------
def test_summary_names_the_rank_that_is_behind() -> None:
    """The issue's example: rank 3 still gathers block 17's parameters while the others wait in reduce_scatter."""
    states = {r: state(r, pending="reduce_scatter_tensor_coalesced") for r in range(8)}
    states[3] = state(3, where="forward", enqueued=40, pending="all_gather_into_tensor",
                      collective="all_gather of model.layers.17's parameters (FSDP)")
    s = summarize(states)
    assert s.verdict == "behind" and s.stuck == [3] and s.waiting == [0, 1, 2, 4, 5, 6, 7]
    assert s.headline.startswith("rank 3 is in all_gather of model.layers.17's parameters (FSDP) #40 (step 4")
    assert "ranks 0-2,4-7 wait in reduce_scatter_tensor_coalesced #41 (backward, step 4)" in s.headline


def test_summary_without_flight_recorder_and_other_verdicts() -> None:
    states = {0: state(0, enqueued=None, collective="all_reduce"), 1: state(1, "data loader", enqueued=None)}
    s = summarize(states)
    assert (s.verdict, s.stuck) == ("not_in_collective", [1])
    assert s.headline.startswith("rank 1 is in the data loader (step 4; 12.0 s;")
    assert "rank 0 waits in all_reduce (backward, step 4)" in s.headline
    mixed = summarize({0: state(0, pending="all_reduce"), 1: state(1, pending="broadcast", phase="evaluation")})
    assert mixed.verdict == "mismatched_collectives" and "different collectives" in mixed.headline
    stalled = summarize({r: state(r, pending="all_reduce") for r in range(4)})
    assert stalled.verdict == "collective_stalled" and "shardfit doctor" in stalled.headline
    slow = summarize({0: state(0, "forward", enqueued=None), 1: state(1, "forward", enqueued=None)})
    assert slow.verdict == "slow_everywhere"
    one = summarize({0: state(0, "data loader", enqueued=None)})
    assert one.verdict == "single_rank" and one.headline.startswith("rank 0 is in the data loader (step 4;")
    silent = summarize({0: state(0, pending="all_reduce", enqueued=9), 1: None, 2: state(2, "data loader", enqueued=8)})
    assert silent.stuck == [2] and silent.silent == [1] and "rank 1 did not answer" in silent.headline


# -- reading a live stack ------------------------------------------------------------------------------------------
def _fake_torch_module(path: str, source: str) -> dict:
    """Code compiled under a torch file name: the stack reader goes by file names, as it does for torch's own."""
    scope: dict = {}
    exec(compile(source, f"/venv/lib/python3.11/site-packages/{path}", "exec"), scope)
    return scope


def test_where_is_reads_the_collective_from_another_thread() -> None:
    c10d = _fake_torch_module("torch/distributed/distributed_c10d.py",
                              "def all_gather_object(ev):\n    return all_gather(ev)\n"
                              "def all_gather(ev):\n    ev.wait(20)\n")
    fsdp = _fake_torch_module("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py",
                              "class FSDPParamGroup:\n    _module_fqn = 'model.layers.17'\n"
                              "    def wait_for_unshard(self, ev):\n        ev.wait(20)\n")
    cases = [(lambda ev: c10d["all_gather_object"](ev), "all_gather_object"),
             (lambda ev: fsdp["FSDPParamGroup"]().wait_for_unshard(ev), "all_gather of model.layers.17's parameters"),
             (lambda ev: ev.wait(20), None)]
    for target, expected in cases:
        ev = threading.Event()
        t = threading.Thread(target=target, args=(ev,), daemon=True)
        t.start()
        time.sleep(0.1)
        where = where_is(sys._current_frames()[t.ident])
        ev.set()
        t.join()
        assert (where.collective or "").startswith(expected or "") and (expected or where.collective is None)
        assert where.frame is not None and "test_watchdog.py" in where.frame
        assert where.stack[-1].split(" in ")[-1] in ("all_gather", "wait_for_unshard", "wait")


def test_fault_spec() -> None:
    got = faults.from_env({faults.VARIABLE: "stall:rank=1:step=3:seconds=9,raise:rank=1:step=5"})
    assert got == [faults.Fault("stall", 1, 3, 9.0), faults.Fault("raise", 1, 5)]
    assert faults.from_env({}) == []
    with pytest.raises(UserError, match="SHARDFIT_TEST_FAULT=hang:rank=1"):
        faults.from_env({faults.VARIABLE: "hang:rank=1:step=2"})
    with pytest.raises(RuntimeError, match="rank 1 raises at step 5"):
        faults.inject(got, 1, 5)
    faults.inject(got, 0, 5)  # not this rank: nothing happens


# -- the watchdog protocol, two ranks in one process over a real store -----------------------------------------
class _Rank(Watchdog):
    """A watchdog whose exits are recorded instead of ending the test process."""

    def __init__(self, env: DistEnv, side: SideChannel | None, **kw):
        super().__init__(env, side, poll_s=0.02, side_poll_s=0.05, answer_wait_s=5.0, stream=io.StringIO(), **kw)
        self.exits = 0
        self.in_collective: str | None = None

    def _exit(self) -> None:
        self.exits += 1
        self._stop.set()  # os._exit would end the thread too

    def state(self) -> RankState:
        s = super().state()
        s.collective = self.in_collective
        return s


@pytest.fixture
def two_ranks(tmp_path: Path):
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    ranks = []
    for r in range(2):
        side = SideChannel(dist.PrefixStore("t", store), r, 2)
        wd = _Rank(DistEnv(r, 2, 0, torch.device("cpu"), "gloo"), side)  # one rank per "node"
        wd.configure(tmp_path, WatchdogSettings(factor=5, min_s=0.3, action="wait"))
        ranks.append(wd)
    yield ranks
    for wd in ranks:
        wd.stop()


def test_stuck_phase_is_named_and_dumped(two_ranks, tmp_path: Path) -> None:
    r0, r1 = two_ranks
    r0.in_collective = "all_reduce"  # rank 0 waits in a collective; rank 1 is in its data loader
    for wd in two_ranks:
        wd.start()
    with r0.phase("step 3", step=True), r1.phase("step 3", step=True):
        r0.at("backward")
        r1.at("data loader")
        assert _until(lambda: r0.events, 10)
    out = r0.stream.getvalue()
    assert "shardfit: watchdog: step 3 has run" in out and "rank 1 is in the data loader (step 3;" in out
    assert "rank 0 waits in all_reduce (backward, step 3)" in out and "step 3 finished after" in out
    assert r1.stream.getvalue() == ""  # one summary, from rank 0
    event = tmp_path / "watchdog" / "event-1"
    assert {p.name for p in event.iterdir()} == {"rank-0.txt", "rank-1.txt", "summary.json"}
    assert json.loads((event / "summary.json").read_text())["summary"]["stuck"] == [1]
    assert "MainThread" in (event / "rank-1.txt").read_text() and r0.exits == r1.exits == 0


def test_abort_stops_every_rank(two_ranks) -> None:
    r0, r1 = two_ranks
    r0.settings = WatchdogSettings(factor=5, min_s=0.3, action="abort")
    r0.in_collective = "all_reduce"
    for wd in two_ranks:
        wd.start()
    with r0.phase("step 2", step=True), r1.phase("step 2", step=True):
        r1.at("forward")
        assert _until(lambda: r0.exits and r1.exits, 10)
    assert "aborting the run" in r0.stream.getvalue()
    assert "stopping because rank 0" in r1.stream.getvalue() and "watchdog abort: rank 1 is in the forward" \
        in r1.stream.getvalue()


def test_failing_rank_stops_the_others_with_its_error(two_ranks) -> None:
    r0, r1 = two_ranks
    r0.start()
    err = RuntimeError("CUDA out of memory in rank 1's forward")
    assert r1.failed(err) is err  # the first failure is raised as it is, and posted
    assert _until(lambda: r0.exits, 10)
    assert "rank 0: stopping because rank 1 on" in r0.stream.getvalue() and "CUDA out of memory" in r0.stream.getvalue()
    assert r0.failed(err) is err  # the same error on this rank too: raised as it is
    consequence = r0.failed(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
    assert isinstance(consequence, PeerFailure) and "rank 1 on" in str(consequence) and "failed first" in str(
        consequence) and "Connection closed by peer" in str(consequence)


def test_rank_whose_request_goes_unanswered_reports_itself(two_ranks, tmp_path: Path) -> None:
    r0, r1 = two_ranks  # rank 0's watchdog never runs: as if rank 0 were stuck in native code holding the GIL
    r1.answer_wait_s = 0.2
    r1.start()
    with r1.phase("step 7", step=True):
        r1.at("backward")
        assert _until(lambda: "opened no report" in r1.stream.getvalue(), 10)
    assert "this rank is in the backward (step 7;" in r1.stream.getvalue()
    assert (tmp_path / "watchdog" / "event-rank1-alone" / "rank-1.txt").is_file()


def test_slow_phase_that_ends_is_not_aborted(tmp_path: Path) -> None:
    wd = _Rank(DistEnv(0, 1, 0, torch.device("cpu"), None), None)
    wd.configure(tmp_path, WatchdogSettings(factor=5, min_s=0.2, action="abort"))
    wd.answer_wait_s = 0
    slow_state = wd.state

    def state_then_finish() -> RankState:  # the phase ends while the ranks answer
        s = slow_state()
        wd._phase = None
        return s

    wd.state = state_then_finish
    wd.start()
    with wd.phase("step 1", step=True):
        assert _until(lambda: wd.events, 10)
    wd.stop()
    assert "slow, not stuck: step 1 ended" in wd.stream.getvalue() and wd.exits == 0


def test_threshold_follows_the_recent_median() -> None:
    wd = Watchdog(DistEnv(0, 1, 0, torch.device("cpu"), None), None)
    wd.configure(Path("."), WatchdogSettings(factor=10, min_s=2, window=3))
    assert wd.threshold() == 2
    for took in (0.1, 0.5, 0.5, 0.5):
        wd._steps.append(took)
    assert wd.threshold() == pytest.approx(5.0)


# -- uneven work, prevented by construction ----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_the_same_number_of_full_micro_batches(world: int) -> None:
    for n_rows in (1, 5, 7, 13):
        rows = [Encoded([i], [i]) for i in range(n_rows)]
        for mb, accum in ((1, 1), (2, 3), (3, 2)):
            per_rank = [BatchSchedule(rows, mb, accum, world, r, seed=0) for r in range(world)]
            assert len({s.steps_per_epoch for s in per_rank}) == 1
            for step in range(2 * per_rank[0].steps_per_epoch):
                shapes = [[len(m) for m in s.step(step).micro_batches] for s in per_rank]
                assert all(shape == [mb] * accum for shape in shapes), (n_rows, mb, accum, step)


@pytest.mark.slow
def test_uneven_work_on_three_gloo_ranks(tmp_path: Path) -> None:
    """Evaluation of 7 rows in micro-batches of 2 (4 batches) over 3 ranks: every rank runs 2 forwards (the padded
    one uncounted) and gets the single-process loss. Ranks whose data differ refuse to start, all of them."""
    want = evaluate(dist_workers.CollectiveLoss(), dist_workers.eval_rows(7), 2, 0,
                    DistEnv(0, 1, 0, torch.device("cpu"), None), contextlib.nullcontext())
    mp.start_processes(dist_workers.uneven_work_rank, args=(3, free_port(), 7, 2, str(tmp_path)), nprocs=3,
                       start_method="spawn", join=True)
    for r in range(3):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert got["loss"] == pytest.approx(want)
        said = got["refused"]
        assert said and "ranks 0-1 on" in said and "rank 2 on" in said and "train_rows=60" in said
        assert "Put the same data on every node" in said


# -- a real run on two nodes --------------------------------------------------------------------------------------
def _node_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


@pytest.mark.slow
# the gloo-rank cases above hold the stuck phase, the abort and the failing rank
@pytest.mark.heavy
def test_two_nodes_stalled_then_failing_rank(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Rank 1 (node 1) stalls 14 s in its data loader at step 3: the watchdog names it and the run goes on. At step
    5 it raises: node 0's rank stops within seconds, naming rank 1's error, instead of waiting in its collective."""
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=100,
                       eval_steps=100, max_steps=6, strategy="ddp", warmup_ratio=0.0, lora={"rank": 4, "alpha": 8},
                       watchdog_factor=4, watchdog_min_s=4, output_dir=str(tmp_path / "run"))
    port = str(free_port())
    fault = "stall:rank=1:step=3:seconds=14,raise:rank=1:step=5"
    procs = []
    for node in (0, 1):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shardfit", "train", str(cfg), "--nproc", "1", "--nnodes", "2", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", port], text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=_node_env(**({faults.VARIABLE: fault} if node == 1 else {}))))
    outs, ended = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("the two nodes did not finish") from None
        ended.append(time.monotonic())
    (_, err0), (_, err1) = outs
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert "injected fault (SHARDFIT_TEST_FAULT): rank 1 raises at step 5" in err1
    said = re.search(r"shardfit: watchdog: step 3 has run \d+ s \(over the watchdog's \d+ s\): (.*)", err0)
    assert said, err0[-4000:]
    assert said.group(1).startswith("rank 1 is in the data loader (step 3;") and "rank 0 waits in" in said.group(1)
    assert "step 3 finished after" in err0
    stop = re.search(r"rank 1 on \S+ failed(?: first)?: RuntimeError: injected fault", err0)
    assert stop, err0[-4000:]
    assert abs(ended[0] - ended[1]) < 60  # node 0 did not wait out a collective timeout
    # The stall's event (a slow first step on a loaded machine may have opened an earlier one).
    (event,) = [e for e in (tmp_path / "run" / "watchdog").glob("event-*")
                if "faults.py" in (e / "rank-1.txt").read_text()]
    assert {p.name for p in event.iterdir()} == {"rank-0.txt", "rank-1.txt", "summary.json"}
    assert json.loads((event / "summary.json").read_text())["summary"]["stuck"] == [1]
