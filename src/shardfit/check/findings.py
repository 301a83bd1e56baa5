"""A preflight finding (the schema of `check --json`, docs/reference.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Finding:
    rule: str
    severity: str  # error | warning | info
    where: str
    message: str
    fix: str
    auto_fixed: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def is_ok(findings: list[Finding]) -> bool:
    """False while an error remains that was not fixed."""
    return not any(f.severity == "error" and not f.auto_fixed for f in findings)
