"""A preflight finding (the schema of `check --json`, docs/reference.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardfit.errors import UserError


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


def refuse_unfixable(findings: list[Finding]) -> None:
    """A UserError listing the errors the preflight could not fix, if any."""
    if not is_ok(findings):
        bad = [f for f in findings if f.severity == "error" and not f.auto_fixed]
        raise UserError("preflight found errors it cannot fix:\n" + "\n".join(
            f"  {f.rule} at {f.where}: {f.message}\n    fix: {f.fix}" for f in bad))
