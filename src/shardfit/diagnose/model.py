"""The typed objects of diagnosis: rule items, causes, scored causes, findings and likely causes."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from shardfit.diagnose.literals import Haystack, Needles, may_match
from shardfit.diagnose.parsed import Parsed


@dataclass(frozen=True)
class Item:
    kind: str
    value: object  # compiled regex, tuple of squashed phrases, or tuple of fact names
    weight: float
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    label: str = ""
    check: str = ""  # the check to show when this item decided the cause (else the cause's own check)
    brief: bool = False  # a hint: `re` items search Parsed.brief (head and tail), not the whole evidence text
    needles: Needles | None = None  # of a `re` item: words one of which any match holds (literals.py)

    def matches(self, p: Parsed, hay: Haystack | None = None) -> bool:
        """Whether the item holds for the parsed log; `hay` (the log squashed, see literals.py) only saves time."""
        facts = p.facts
        if (self.when and not facts.issuperset(self.when)) or (self.unless and not facts.isdisjoint(self.unless)):
            return False
        if self.kind == "phrase":
            return any(ph in p.squashed for ph in self.value)
        if self.kind == "re":
            if hay is not None and not may_match(self.needles, hay.brief if self.brief else hay.text):
                return False
            return self.value.search(p.brief if self.brief else p.text) is not None
        if self.kind == "exc":
            return p.exception is not None and self.value.search(str(p.exception)) is not None
        if self.kind == "any_exc":
            return any(self.value.search(str(e)) for e in p.exceptions)
        if self.kind == "frame":
            return any(self.value.search(f) for f in p.frames)
        if self.kind == "cut_frame":
            return any(self.value.search(f) for f in p.cut_frames)
        return facts.issuperset(self.value)


@dataclass(frozen=True)
class Cause:
    id: str
    title: str
    signatures: tuple[Item, ...]
    context: tuple[Item, ...]
    veto: tuple[Item, ...]
    root_cause: str
    fix: str
    prevented_by: str
    check: str = ""
    hints: tuple[Item, ...] = ()
    quote: re.Pattern | None = None  # a line of the log worth repeating in the finding (shardfit's own prediction)


@dataclass
class Finding:
    category: str
    confidence: float
    title: str
    root_cause: str
    fix: str
    prevented_by: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Scored:
    cause: Cause
    score: float  # signatures + context: what findings are decided on (0 when only hints matched)
    strongest: float
    evidence: list[str]
    total: float = 0.0  # score + hints (+ context when only hints matched): what likely causes are ranked on
    specific: bool = True  # a signature matched, not only hints
    check: str = ""  # the check that tells this cause apart, given what matched


@dataclass
class Likely:
    """One of the ranked likely causes: what it is, how likely, and the one check that tells it apart."""

    category: str
    confidence: float
    title: str
    check: str
    root_cause: str
    fix: str
    evidence: list[str]

    def to_json(self) -> dict:
        return asdict(self)
