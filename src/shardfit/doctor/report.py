"""The doctor's report: findings in the `check` format, the rank map and the timed collectives; as JSON (`--json`:
docs/reference.md, `shardfit doctor --json`: check's fields with `ranks`, `links` and `backend`) and as text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardfit.check.findings import Finding, is_ok
from shardfit.doctor.facts import RankFacts
from shardfit.parallel.ranks import span

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Timing:
    """One collective at one size on one group of ranks; bandwidths in GB/s (1e9 bytes), as nccl-tests count them:
    algbw = bytes / time, busbw = algbw x 2(n-1)/n for all_reduce and x (n-1)/n for all_gather."""

    op: str
    link: str  # all ranks | same host | cross host
    ranks: list[int]
    hosts: list[str]
    backend: str
    size: int
    seconds: float
    algbw: float
    busbw: float


@dataclass
class Report:
    findings: list[Finding]
    ranks: list[RankFacts] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    backend: str | None = None  # what doctor timed on
    train_backend: str | None = None  # what `shardfit train` picks on these ranks
    launch: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return is_ok(self.findings)

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 3))

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "findings": [f.to_json() for f in self.sorted_findings()],
                "world": len(self.ranks) or None, "hosts": sorted({r.host for r in self.ranks}),
                "backend": self.backend, "train_backend": self.train_backend, "launch": self.launch,
                "ranks": [r.to_json() for r in self.ranks], "links": [asdict(t) for t in self.timings]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        return cls(findings=[Finding(**f) for f in data["findings"]],
                   ranks=[RankFacts.from_json(r) for r in data.get("ranks", [])],
                   timings=[Timing(**t) for t in data.get("links", [])], backend=data.get("backend"),
                   train_backend=data.get("train_backend"), launch=data.get("launch", {}))


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_text(report: Report) -> str:
    """What `shardfit doctor` prints without --json."""
    lines = []
    if report.ranks:
        hosts: dict[str, list[int]] = {}
        for r in report.ranks:
            hosts.setdefault(r.host, []).append(r.rank)
        where = "; ".join(f"{h}: rank{'s' if len(rs) > 1 else ''} {span(rs)}" for h, rs in hosts.items())
        lines.append(f"shardfit doctor: {len(report.ranks)} rank(s) on {len(hosts)} host(s) ({where}); "
                     f"train would use {report.train_backend}")
        rows = [["rank", "host", "node", "local", "device", "gpu", "pid", "address"]]
        for r in report.ranks:
            gpu = f"{r.gpu.name} {r.gpu.pci}" if r.gpu else "-"
            rows.append([str(r.rank), r.host, str(r.node), str(r.local_rank), r.device, gpu, str(r.pid),
                         r.address or "-"])
        lines += _table(rows)
    if report.timings:
        lines.append(f"collectives ({report.backend}; median time, bandwidth in GB/s as nccl-tests counts it):")
        rows = [["op", "link", "ranks", "hosts", "size", "time", "algbw", "busbw"]]
        for t in report.timings:
            rows.append([t.op, t.link, span(t.ranks), ",".join(dict.fromkeys(t.hosts)), human_bytes(t.size),
                         f"{t.seconds * 1e3:.2f} ms", f"{t.algbw:.3f}", f"{t.busbw:.3f}"])
        lines += _table(rows)
    findings = report.sorted_findings()
    if findings:
        lines.append(f"{len(findings)} finding(s):")
        for f in findings:
            lines.append(f"  [{f.severity:>7}] {f.rule} at {f.where}\n            {f.message}\n"
                         f"            fix: {f.fix}")
    errors = sum(1 for f in findings if f.severity == "error")
    lines.append("ok: the ranks can talk" if report.ok else
                 f"not healthy: {errors} error(s) above; `shardfit train` with this launch would fail or hang")
    return "\n".join(lines)
