"""`shardfit doctor`: the rules on hand-made rank facts (fast), and real gloo launches of the CLI on this host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.doctor.bench import link_groups
from shardfit.doctor.facts import GpuFacts, RankFacts
from shardfit.doctor.launch import Launch, failure_findings, launch_rules
from shardfit.doctor.peers import GroupRecord, alone_findings, others, write
from shardfit.doctor.report import Report, Timing, format_text
from shardfit.doctor.rules import GIB, MIB, rank_rules
from shardfit.parallel.ranks import span
from tests.helpers import ROOT, free_port, run_cli, write_config

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3", "driver": "570.1",
            "shardfit": "0.1.0", "transformers": "5.23.0", "peft": "0.21.2"}


def rank(r: int, host: str = "a", node: int = 0, gpu: int | None = None, **kw) -> RankFacts:
    """Facts of rank `r`; `gpu` gives it that GPU of an 8-GPU host (uuid per host and index)."""
    g = GpuFacts(gpu, "NVIDIA H100 80GB HBM3", f"GPU-{host}-{gpu}", f"0000:{gpu:02x}:00", 79.2) \
        if gpu is not None else None
    base = dict(rank=r, world=kw.pop("world", 2), local_rank=kw.pop("local_rank", r), local_world=2, node=node,
                host=host, pid=1000 + r, address="10.0.0.1", gpus_visible=8 if gpu is not None else 0, gpu=g,
                versions=dict(VERSIONS), shm_total=64 * GIB, shm_free=64 * GIB, memlock=-1, cpus=64, threads=1,
                env={}, interfaces=["eth0", "lo"], infiniband=[])
    base.update(kw)
    return RankFacts(**base)


def rules_of(facts: list[RankFacts], output_dir: str | None = None) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in rank_rules(facts, output_dir):
        out.setdefault(f.rule, []).append(f)
    return out


def test_healthy_gpu_job_has_no_findings() -> None:
    facts = [rank(0, "a", 0, gpu=0), rank(1, "a", 0, gpu=1), rank(2, "b", 1, gpu=0, local_rank=0),
             rank(3, "b", 1, gpu=1, local_rank=1)]
    assert {f.rule for f in rank_rules(facts, None)} == {"output_dir_unchecked"}
    for f in facts:
        f.sees_output_dir = True
    assert rank_rules(facts, "/shared/run") == []


def test_rank_to_gpu_mapping() -> None:
    shared = rules_of([rank(0, gpu=0), rank(1, gpu=0, local_rank=1)])
    (f,) = shared["gpu_shared_by_ranks"]
    assert f.severity == "error" and "ranks 0-1" in f.message
    three = [rank(r, gpu=r, local_rank=r) for r in range(2)] + [rank(2, local_rank=2, gpus_visible=2, gpu=None)]
    for f in three:
        f.gpus_visible = 2
    found = rules_of(three)
    assert "3 ranks on a but 2 GPU(s)" in found["more_ranks_than_gpus"][0].message
    mixed = rules_of([rank(0, gpu=0), rank(1, "b", 1)])
    assert mixed["backend_mismatch"][0].severity == "error" and "rank 1" in mixed["backend_mismatch"][0].message
    cvd = rules_of([rank(0, gpu=0, env={"CUDA_VISIBLE_DEVICES": "0"}),
                    rank(1, gpu=1, env={"CUDA_VISIBLE_DEVICES": "1"})])
    assert "cuda_visible_devices_differ" in cvd


def test_topology_and_versions() -> None:
    loop = rules_of([rank(0, "a", env={"MASTER_ADDR": "127.0.0.1"}), rank(1, "b", 1, env={"MASTER_ADDR": "127.0.0.1"})])
    assert loop["master_addr_loopback"][0].severity == "error"
    same_host = rules_of([rank(0, "a", 0), rank(1, "a", 1)])
    assert "nodes 0-1 all run on a" in same_host["nodes_share_host"][0].message
    uneven = rules_of([rank(0, "a", 0), rank(1, "a", 0), rank(2, "b", 1)])
    assert "node 0: 2, node 1: 1" in uneven["uneven_ranks_per_node"][0].message
    other = rank(1, "b", 1)
    other.versions["torch"] = "2.12.0"
    other.versions["driver"] = "560.0"
    found = rules_of([rank(0, "a"), other])
    by_where = {f.where: f for f in found["version_mismatch"]}
    assert by_where["torch"].severity == "error" and "2.12.0 on rank 1" in by_where["torch"].message
    assert by_where["driver"].severity == "warning"


def test_shm_nccl_env_and_interfaces() -> None:
    small = [rank(r, gpu=r, shm_total=64 * MIB, shm_free=60 * MIB) for r in range(2)]
    assert rules_of(small)["shm_too_small"][0].severity == "error"
    medium = [rank(r, gpu=r, shm_total=512 * MIB, shm_free=500 * MIB) for r in range(2)]
    assert rules_of(medium)["shm_too_small"][0].severity == "warning"
    assert "shm_too_small" not in rules_of([rank(r, shm_total=64 * MIB, shm_free=60 * MIB) for r in range(2)])
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
    ib = dict(infiniband=["mlx5_0"], memlock=64 * 1024)
    found = rules_of([rank(0, "a", 0, gpu=0, env=env, **ib), rank(1, "b", 1, gpu=0, local_rank=0, env=env, **ib)])
    slow = {f.where: f.severity for f in found["nccl_env_slow_path"]}
    assert slow == {"NCCL_P2P_DISABLE": "warning", "NCCL_IB_DISABLE": "warning"}
    assert found["socket_ifname_loopback"][0].severity == "error"
    assert found["memlock_limited"][0].severity == "warning"
    cpu_only = rules_of([rank(0, env={"NCCL_P2P_DISABLE": "1"}), rank(1, env={"NCCL_P2P_DISABLE": "1"})])
    assert cpu_only["nccl_env_slow_path"][0].severity == "info"
    missing = rules_of([rank(0, "a", env={"GLOO_SOCKET_IFNAME": "eth1"}), rank(1, "b", 1)])
    assert "selects no interface on a" in missing["socket_ifname_missing"][0].message
    assert missing["env_differs_between_ranks"][0].where == "GLOO_SOCKET_IFNAME"
    not_lo = {"NCCL_SOCKET_IFNAME": "^lo,docker"}
    prefix = rules_of([rank(0, "a", env=not_lo), rank(1, "b", 1, env=not_lo)])
    assert "socket_ifname_missing" not in prefix and "socket_ifname_loopback" not in prefix


def test_cpu_oversubscription_and_output_dir() -> None:
    busy = rules_of([rank(r, threads=4, cpus=4) for r in range(2)])
    assert "OMP_NUM_THREADS=2" in busy["cpu_oversubscribed"][0].fix
    blind = [rank(0, "a", sees_output_dir=True), rank(1, "b", 1, sees_output_dir=False)]
    found = rules_of(blind, "/runs/x")
    (f,) = found["output_dir_not_shared"]
    assert f.severity == "error" and "rank 1 on b" in f.message
    assert rules_of(blind, None)["output_dir_unchecked"][0].severity == "info"


def test_data_files_must_match_on_every_node() -> None:
    same = {"data/train.jsonl": 4096}
    assert "data_differs_between_nodes" not in rules_of([rank(0, extra={"data_files": same}),
                                                         rank(1, "b", 1, extra={"data_files": dict(same)})])
    found = rules_of([rank(0, extra={"data_files": same}),
                      rank(1, "b", 1, extra={"data_files": {"data/train.jsonl": 4000}}),
                      rank(2, "c", 2, extra={"data_files": {"data/train.jsonl": None}})])
    (f,) = found["data_differs_between_nodes"]
    assert f.severity == "error" and f.where == "data/train.jsonl"
    assert "4096 bytes on rank 0 (a)" in f.message and "missing on rank 2 (c)" in f.message


def test_launch_rules_before_any_rank_starts() -> None:
    def resolve(host: str) -> list[str]:
        if host == "nowhere":
            raise socket.gaierror("Name or service not known")
        return {"node0": ["127.0.1.1"], "head": ["10.0.0.1"]}[host]

    found = launch_rules(Launch(2, nnodes=2), {}, resolve)
    assert [f.rule for f in found] == ["master_addr_loopback"] and "127.0.0.1 was assumed" in found[0].message
    assert launch_rules(Launch(2, 2, 1, "node0", 29500), {}, resolve)[0].severity == "error"
    assert launch_rules(Launch(2, 2, 0, "head", 29500), {}, resolve) == []
    assert launch_rules(Launch(2, 2, 1, "nowhere"), {}, resolve)[0].rule == "master_addr_unresolvable"
    alone = launch_rules(Launch(8), {"SLURM_JOB_NUM_NODES": "4"}, resolve)
    assert alone[0].rule == "nodes_train_alone" and "--nnodes 4" in alone[0].fix
    assert launch_rules(Launch(8), {"WORLD_SIZE": "16"}, resolve)[0].rule == "nodes_train_alone"
    assert launch_rules(Launch(8), {"SLURM_JOB_NUM_NODES": "1", "WORLD_SIZE": "8"}, resolve) == []


def test_failed_rendezvous_is_explained() -> None:
    launch = Launch(1, 2, 1, "127.0.0.1", 29612)
    log = "torch.distributed.DistNetworkError: The client socket has timed out after 10000ms while trying to connect"
    found = failure_findings(launch, log, [], 10, launch_rules(launch, {}))
    assert (found[0].rule, found[0].severity) == ("master_addr_loopback", "error")
    assert "within 10 s" in found[0].message
    far = Launch(1, 2, 0, "10.0.0.9", 29612)
    found = failure_findings(far, "DistStoreError: Timed out after 11 seconds waiting for clients. 1/2 clients joined.",
                             [], 10, [])
    assert found[0].rule == "rendezvous_failed" and "1/2 clients joined" in found[0].message
    err = {"key": "connect", "stage": "connecting", "rank": 2, "host": "b",
           "message": "RuntimeError: Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]:5"}
    found = failure_findings(far, "", [err], 10, [])
    assert found[0].rule == "ranks_cannot_connect" and "loopback address 127.0.0.1" in found[0].message
    assert failure_findings(far, "something else", [], 10, [])[0].rule == "doctor_launch_failed"


def test_lone_groups_see_each_other_through_output_dir(tmp_path: Path) -> None:
    t = time.time()
    a = GroupRecord("node0", 1, ["node0"], 8, t)
    b = GroupRecord("node1", 2, ["node1"], 8, t + 1)
    write(tmp_path, a)
    write(tmp_path, b)
    found = others(tmp_path, a, t + 3)
    assert [r.host for r in found] == ["node1"]
    finding = alone_findings(a, found, tmp_path)[0]
    assert finding.rule == "nodes_train_alone" and "--nnodes 2" in finding.fix
    earlier = GroupRecord("node2", 3, ["node2"], 8, t - 100, t - 90)
    write(tmp_path, earlier)
    assert [r.host for r in others(tmp_path, a, t + 3)] == ["node1"]  # a finished run is not a lone group
    together = GroupRecord("node0", 4, ["node0", "node1"], 16, t)
    assert others(tmp_path, together, t + 3) == []  # the other host was in this group


def test_link_groups_and_report_round_trip() -> None:
    facts = [rank(0, "a"), rank(1, "a"), rank(2, "b", 1), rank(3, "b", 1), rank(4, "c", 2)]
    assert link_groups(facts) == [("all ranks", [0, 1, 2, 3, 4]), ("same host", [0, 1]), ("same host", [2, 3]),
                                  ("cross host", [0, 2]), ("cross host", [0, 4])]
    assert link_groups(facts[:2]) == [("all ranks", [0, 1])]
    assert span([0, 1, 2, 4, 5, 7]) == "0-2,4-5,7"
    report = Report(rank_rules(facts, None), facts, [Timing("all_reduce", "cross host", [0, 2], ["a", "b"], "gloo",
                                                            2**20, 0.002, 0.524, 0.524)], "gloo", "gloo")
    back = Report.from_json(json.loads(json.dumps(report.to_json())))
    assert back.to_json() == report.to_json() and back.ok
    text = format_text(back)
    assert "5 rank(s) on 3 host(s)" in text and "cross host" in text and "1 MiB" in text


def test_doctor_bad_arguments_exit_2(capsys: pytest.CaptureFixture) -> None:
    for args, said in ((["--nproc", "0"], "--nproc: must be at least 1"),
                       (["--nproc", "1", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside 0..1"),
                       (["--sizes", "12XB"], "--sizes '12XB'"), (["--iters", "0"], "--iters must be at least 1"),
                       (["--nproc", "1", "--master-addr", "a", "--rdzv-endpoint", "a:1"], "not both")):
        try:
            code = main(["doctor", *args])
        except SystemExit as e:  # a number of the wrong kind stops in argparse, with the usage line
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


@pytest.mark.slow
def test_doctor_three_ranks_on_one_host(tmp_path: Path, small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model="HuggingFaceTB/SmolLM2-135M-Instruct", data=str(small_data),
                       output_dir=str(tmp_path / "run"))
    r = run_cli("doctor", str(cfg), "--nproc", "3", "--sizes", "64KiB,1MiB", "--iters", "2", "--peer-wait", "1",
                "--json", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["world"] == 3 and report["backend"] == "gloo"
    assert [x["rank"] for x in report["ranks"]] == [0, 1, 2] and {x["device"] for x in report["ranks"]} == {"cpu"}
    assert all(x["sees_output_dir"] for x in report["ranks"])
    assert all(x["extra"]["data_files"] == {str(small_data): small_data.stat().st_size} for x in report["ranks"])
    assert {f["severity"] for f in report["findings"]} <= {"warning", "info"}
    links = {(t["op"], t["link"], t["size"]) for t in report["links"]}
    assert links == {(op, link, size) for op in ("all_reduce", "all_gather") for link in ("all ranks", "same host")
                     for size in (65536, 1048576)}
    assert all(t["seconds"] > 0 and t["busbw"] > 0 for t in report["links"])


def _env_from(cwd: Path) -> dict[str, str]:
    """The environment for a CLI run in another folder: this checkout's sources first, whatever cwd is."""
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


@pytest.mark.slow
@pytest.mark.heavy  # train refuses the same (test_distributed.py); doctor shares the rule
def test_doctor_two_nodes_without_shared_output_dir(tmp_path: Path) -> None:
    """Two torchrun nodes on this host whose relative output_dir lands in different folders (as on local disks)."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shardfit", "doctor", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--output-dir", "run", "--sizes", "64KiB",
             "--iters", "1", "--peer-wait", "0", "--timeout", "60", "--json"], cwd=cwd, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env_from(cwd)))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 1, err[-3000:]
        report = json.loads(out)
        rules = {f["rule"]: f for f in report["findings"]}
        blind = rules["output_dir_not_shared"]
        assert blind["severity"] == "error" and "rank 1" in blind["message"]
        assert rules["nodes_share_host"]["severity"] == "warning"
        assert rules["master_addr_loopback"]["severity"] == "warning"  # loopback works here: both nodes are this host
        assert {t["link"] for t in report["links"]} == {"all ranks"}


def test_train_warns_of_the_same_launch_traps(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x"}\n')  # a bad row: train stops at its data, exit 2
    cfg = write_config(tmp_path / "c.yaml", data=str(tmp_path / "bad.jsonl"), output_dir=str(tmp_path / "run"))
    assert main(["train", str(cfg), "--nproc", "1"]) == 2  # the data error still decides
    assert "nodes_train_alone" in caplog.text and "shardfit doctor" in caplog.text
