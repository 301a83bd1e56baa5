"""Catch nodes that each rendezvoused alone: every doctor group leaves a small record in the shared output_dir, and
a group that finds a record of another host's group running at the same time knows the nodes did not join up.

A group of one node cannot see the others through the process group (that is the problem), but nodes that share
output_dir can see each other's files. Records stay in `<output_dir>/.shardfit-doctor/` (a few hundred bytes each;
those older than a day are removed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardfit.check.findings import Finding

DIR = ".shardfit-doctor"
KEEP_S = 86400.0
CLOCK_SKEW_S = 2.0


@dataclass
class GroupRecord:
    host: str
    pid: int
    hosts: list[str]  # the hosts of this record's group
    world: int
    start: float  # wall clock (time.time()): records are compared across hosts
    end: float | None = None

    def overlaps(self, start: float, end: float) -> bool:
        mine_end = self.end if self.end is not None else end
        return self.start <= end + CLOCK_SKEW_S and start <= mine_end + CLOCK_SKEW_S


def _path(output_dir: str | Path, rec: GroupRecord) -> Path:
    return Path(output_dir) / DIR / f"{rec.host}-{rec.pid}.json"


def write(output_dir: str | Path, rec: GroupRecord) -> None:
    """Write (or update) this group's record; remove stale ones of any host."""
    folder = Path(output_dir) / DIR
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in folder.glob("*.json"):
        try:
            if now - old.stat().st_mtime > KEEP_S:
                old.unlink()
        except OSError:
            continue  # another node removed it first
    tmp = folder / f".{rec.host}-{rec.pid}.tmp"
    tmp.write_text(json.dumps(asdict(rec)))
    os.replace(tmp, _path(output_dir, rec))


def others(output_dir: str | Path, me: GroupRecord, now: float) -> list[GroupRecord]:
    """Records of groups on hosts outside `me`'s group that ran while `me` did."""
    out = []
    for p in sorted((Path(output_dir) / DIR).glob("*.json")):
        try:
            rec = GroupRecord(**json.loads(p.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # half-written by a node right now, or not ours
        if rec.host not in me.hosts and rec.overlaps(me.start, now):
            out.append(rec)
    return out


def alone_findings(me: GroupRecord, found: list[GroupRecord], output_dir: str | Path) -> list[Finding]:
    """`nodes_train_alone` when another host's group ran at the same time as this one."""
    if not found:
        return []
    other = ", ".join(f"{r.host} (world size {r.world})" for r in found[:4])
    return [Finding(
        "nodes_train_alone", "error", "rendezvous",
        f"while this group ({', '.join(me.hosts)}, world size {me.world}) ran, {other} ran a group of its own on the "
        f"same output_dir {output_dir}: the nodes did not rendezvous together and would each train alone",
        f"launch every node with --nnodes {len(me.hosts) + len({r.host for r in found})} --node-rank <i> "
        "--master-addr <node 0's address> (the same on every node)")]
