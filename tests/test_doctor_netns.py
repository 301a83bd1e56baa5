"""`shardfit doctor` across two hosts: two network namespaces on a veth pair (tests/netns.py), each node a real
torchrun agent with gloo ranks. The healthy launch, and the two classic mistakes: a loopback MASTER_ADDR on several
nodes, and nodes that each rendezvous alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port
from tests.netns import TwoHosts

UNAVAILABLE = TwoHosts.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"two hosts: {UNAVAILABLE}")]


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as h:
        yield h


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}



def _both(hosts: TwoHosts, args: list[list[str]], timeout: float = 240) -> list[tuple[int, str, str, float]]:
    """`shardfit doctor <args[i]>` on host i, started together; (exit code, stdout, stderr, seconds) each."""
    t0 = time.monotonic()
    procs = [hosts.popen(i, [sys.executable, "-m", "shardfit", "doctor", *a], _env()) for i, a in enumerate(args)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            raise AssertionError(f"doctor did not finish within {timeout} s:\n{stderr[-3000:]}") from None
        out.append((p.returncode, stdout, stderr, time.monotonic() - t0))
    return out


def test_two_hosts_healthy(hosts: TwoHosts, tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--nnodes", "2", "--master-addr", hosts.addrs[0], "--master-port", port, "--output-dir", str(tmp_path),
              "--sizes", "64KiB", "--iters", "2", "--timeout", "30", "--peer-wait", "0", "--json"]
    results = _both(hosts, [["--nproc", "2", "--node-rank", "0", *common],
                            ["--nproc", "1", "--node-rank", "1", *common]])
    for code, _, err, _ in results:
        assert code == 0, err[-3000:]
    report, other = json.loads(results[0][1]), json.loads(results[1][1])
    assert report.pop("launch")["node_rank"] == 0 and other.pop("launch")["node_rank"] == 1
    assert report == other  # every node prints the same report
    assert report["ok"] and report["world"] == 3 and report["hosts"] == ["node0", "node1"]
    assert [(r["rank"], r["host"], r["node"]) for r in report["ranks"]] == [(0, "node0", 0), (1, "node0", 0),
                                                                            (2, "node1", 1)]
    assert [r["address"] for r in report["ranks"]] == [hosts.addrs[0], hosts.addrs[0], hosts.addrs[1]]
    assert {t["link"] for t in report["links"]} == {"all ranks", "same host", "cross host"}
    cross = [t for t in report["links"] if t["link"] == "cross host"]
    assert all(t["ranks"] == [0, 2] and t["hosts"] == ["node0", "node1"] and t["busbw"] > 0 for t in cross)
    rules = {f["rule"]: f for f in report["findings"]}
    assert rules["uneven_ranks_per_node"]["severity"] == "warning"
    # The namespaces' host names resolve to nothing: gloo would advertise 127.0.0.1; doctor and train fix that.
    assert rules.get("hostname_not_routable", {"auto_fixed": True})["auto_fixed"] is True


@pytest.mark.heavy  # test_two_hosts_healthy holds two hosts; test_doctor the loopback rule
def test_loopback_master_addr_on_two_hosts(hosts: TwoHosts) -> None:
    port = str(free_port())
    common = ["--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--timeout", "5"]
    results = _both(hosts, [["--node-rank", "0", *common, "--json"], ["--node-rank", "1", *common, "--json"]])
    for code, out, err, took in results:
        assert code == 1, err[-3000:]
        (finding,) = json.loads(out)["findings"]
        assert finding["rule"] == "master_addr_loopback" and finding["severity"] == "error"
        assert "loopback" in finding["message"] and "--master-addr" in finding["fix"]
        assert took < 120  # bounded by --timeout, not by torchrun's 600 s default


def test_nodes_that_each_rendezvous_alone(hosts: TwoHosts, tmp_path: Path) -> None:
    """Each node launched as a single node (no --nnodes) on the same shared output_dir."""
    args = ["--nproc", "1", "--output-dir", str(tmp_path), "--peer-wait", "4", "--json"]
    for i, (code, out, err, _) in enumerate(_both(hosts, [args, args])):
        assert code == 1, err[-3000:]
        rules = {f["rule"]: f for f in json.loads(out)["findings"]}
        alone = rules["nodes_train_alone"]
        assert alone["severity"] == "error" and f"node{1 - i} (world size 1)" in alone["message"]
        assert "--nnodes 2" in alone["fix"]
