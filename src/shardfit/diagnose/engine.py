"""Score a parsed log against the known causes in causes.yaml, rank them, and attach a calibrated confidence.

Causes are data. Each cause lists `signatures` (at least one must match for the cause to be considered) and
`context` (adds to or, with a negative weight, subtracts from the score), and may list `veto` items that rule it
out. An item tests one field of the parsed log:

    phrase:   literal text, case- and whitespace-insensitive (survives wrapping and re-spacing); a list = any of them
    re:       a regex on the normalised log text (case-insensitive, multi-line)
    exc:      a regex on the final exception ("Type: message"); any_exc: on any exception in the log
    frame:    a regex on a traceback frame ("package/path/file.py:function")
    cut_frame: the same on the innermost frame of a traceback the paste cuts before its exception line
               (followed by a newline and the frame's source line, where the paste shows it)
    fact:     a named fact of the parse (`facts:` in causes.yaml, or computed: zero3, multi_rank, exit-9, ...)

plus `w` (weight) and optionally `when` / `unless` (facts that must / must not hold for the item to count) and
`check` (the check to show when this item decided the cause, instead of the cause's own).
The score of a cause is the sum of the weights of its matched items; the confidence shown is a calibrated mapping
of the score and of the margin over the runner-up (calibration.yaml, fitted on the dev part of the real corpus).

Short pastes (one line, a title, the last lines of a traceback) rarely carry a cause's specific signature. For them
each cause also lists `hints`: symptom-level items (an OOM, a CPU tensor, a timeout, "Killed", the reporter's own
words) that make it a candidate without making it a finding, and a `check`: the one thing to look at that tells it
apart from the causes sharing its symptom. `likely.py` ranks the candidates on signatures + context + hints (the
context being what the log shows of launcher, framework, model and strategy, see setting.py); the top three are the
"likely causes". When the top finding is confident (>= CONFIDENT) it stays first; otherwise the likely causes are the
answer, with the probability per rank fitted on dev (calibration.yaml, `likely`).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from shardfit.diagnose.facts import FactPattern, LineFilter, crosses_lines
from shardfit.diagnose.likely import likely_causes
from shardfit.diagnose.literals import Haystack
from shardfit.diagnose.model import Cause, Finding, Item, Likely, Scored
from shardfit.diagnose.parse import parse, squash
from shardfit.diagnose.parsed import Parsed
from shardfit.diagnose.regex import EXC_FLAGS, RE_FLAGS, Regex, regex
from shardfit.diagnose.similar import nearest
from shardfit.errors import UserError

HERE = Path(__file__).parent
MIN_SCORE = 2.0  # below this nothing is reported (the abstain path)
KINDS = ("phrase", "re", "exc", "any_exc", "frame", "cut_frame", "fact")


@dataclass
class Analysis:
    parsed: Parsed
    findings: list[Finding]
    evidence: list[list[str]]
    scores: list[tuple[str, float]]
    similar: list[dict] = field(default_factory=list)
    likely: list[Likely] = field(default_factory=list)
    answer: str = "none"  # "confident": findings[0] is the answer; "likely": the ranked list is; "none"


@dataclass(frozen=True)
class Knowledge:
    causes: tuple[Cause, ...]
    facts: dict[str, FactPattern]
    generic: tuple[tuple[Regex, str], ...]


def _read_yaml(path: Path) -> object:
    """A YAML data file, with libyaml's safe loader where PyYAML has it (causes.yaml is read on every run: the C
    loader saves a quarter of a second); both build plain data only, no objects."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _as_tuple(x) -> tuple[str, ...]:
    return (x,) if isinstance(x, str) else tuple(x or ())


def _item(raw: dict, where: str, brief: bool = False) -> Item:
    kinds = [k for k in KINDS if k in raw]
    if len(kinds) != 1 or "w" not in raw:
        raise UserError(f"{where}: an item needs exactly one of {', '.join(KINDS)} and a weight w: {raw!r}")
    kind = kinds[0]
    val = raw[kind]
    try:
        if kind == "phrase":
            phrases = [val] if isinstance(val, str) else list(val)
            value: object = tuple(squash(x) for x in phrases)
            label = f'"{phrases[0]}"'
        elif kind == "fact":
            value = (val,) if isinstance(val, str) else tuple(val)
            label = f"fact {'+'.join(value)}"
        else:
            value = regex(val, RE_FLAGS if kind == "re" else EXC_FLAGS)
            label = f"{kind} /{val}/"
    except (re.error, TypeError) as e:
        raise UserError(f"{where}: bad {kind} {val!r}: {e}") from None
    return Item(kind, value, float(raw["w"]), _as_tuple(raw.get("when")), _as_tuple(raw.get("unless")), label,
                " ".join(str(raw.get("check") or "").split()), brief,
                value.needles if isinstance(value, Regex) and kind == "re" else None)


def load_knowledge(path: Path | None = None) -> Knowledge:
    """Parse a causes file (the bundled one by default); errors name the cause and the item."""
    return _load(str(path or HERE / "causes.yaml"))


def load_causes(path: Path | None = None) -> list[Cause]:
    return list(load_knowledge(path).causes)


@cache
def _load(path: str) -> Knowledge:
    raw = _read_yaml(Path(path))
    if isinstance(raw, list):  # the v1 format: a bare list of causes
        raw = {"causes": raw}
    facts = {}
    for name, pat in (raw.get("facts") or {}).items():
        try:
            facts[name] = regex(pat, RE_FLAGS)
        except re.error as e:
            raise UserError(f"{path}: fact {name}: bad regex: {e}") from None
    for name, keys in (raw.get("fact_keys") or {}).items():
        if name not in facts or not isinstance(keys, list) or not keys or not all(
                isinstance(k, str) and k.strip() for k in keys):
            raise UserError(f"{path}: fact_keys {name}: needs a fact of that name under facts: and a list of "
                            f"non-empty words, e.g. {name}: [upgrad, version]") from None
        crossing = crosses_lines(facts[name])
        if crossing:
            raise UserError(f"{path}: fact {name}: has fact_keys, so its regex is tried line by line, but it holds "
                            f"{crossing}: write [^\\w\\n] for \\W, [ \\t] for \\s, [^x\\n] for [^x]") from None
        facts[name] = LineFilter(facts[name], tuple(k.lower() for k in keys))
    causes = []
    ids = set()
    for i, entry in enumerate(raw.get("causes") or []):
        where = f"{path}: cause {entry.get('id', i)}"
        for key in ("id", "title", "signatures", "root_cause", "fix", "prevented_by", "check"):
            if key not in entry:
                raise UserError(f"{where}: missing '{key}'")
        if entry["id"] in ids:
            raise UserError(f"{where}: duplicate id")
        ids.add(entry["id"])
        items = {k: tuple(_item(x, where, brief=k == "hints") for x in entry.get(k) or [])
                 for k in ("signatures", "context", "veto", "hints")}
        try:
            quote = regex(entry["quote"], RE_FLAGS) if entry.get("quote") else None
        except re.error as e:
            raise UserError(f"{where}: bad quote regex: {e}") from None
        causes.append(Cause(entry["id"], entry["title"], items["signatures"], items["context"], items["veto"],
                            " ".join(entry["root_cause"].split()), " ".join(entry["fix"].split()),
                            entry["prevented_by"], " ".join(entry["check"].split()), items["hints"], quote))
    generic = tuple((regex(g["exc"], EXC_FLAGS), " ".join(g["step"].split())) for g in raw.get("generic") or [])
    return Knowledge(tuple(causes), facts, generic)


def score(cause: Cause, p: Parsed, hay: Haystack | None = None) -> Scored | None:
    """Matched weight of a cause (None when neither a signature nor a hint matches, or a veto does); `hay`, the log
    squashed once for all causes, lets items skip regexes whose words it lacks (the same answer, sooner)."""
    sig = [it for it in cause.signatures if it.matches(p, hay)]
    hints = [it for it in cause.hints if it.matches(p, hay)]
    if (not sig and not hints) or any(it.matches(p, hay) for it in cause.veto):
        return None
    ctx = [it for it in cause.context if it.matches(p, hay)]
    base = sum(it.weight for it in sig) + sum(it.weight for it in ctx)
    evidence = [f"{it.label} (+{it.weight:g})" for it in sig] + [f"{it.label} ({it.weight:+g})" for it in ctx]
    evidence += [f"hint {it.label} ({it.weight:+g})" for it in hints]
    total = base + sum(it.weight for it in hints)
    # the check of the strongest matched item that has one, else the cause's general check
    check = next((it.check for it in sorted(sig + hints, key=lambda it: -it.weight) if it.check), cause.check)
    if not sig:
        return Scored(cause, 0.0, 0.0, evidence, total, specific=False, check=check)
    return Scored(cause, base, max(it.weight for it in sig), evidence, total, check=check)


@cache
def _calibration_table(path: str) -> dict:
    f = Path(path)
    return (_read_yaml(f) or {}) if f.is_file() else {}


def _calibration(path: str) -> tuple[list[float], list[float]]:
    pts = sorted((float(k), float(v)) for k, v in (_calibration_table(path).get("points") or {}).items())
    return [x for x, _ in pts], [y for _, y in pts]


def per_rank_probabilities(calibration: Path | None = None) -> list[float]:
    """calibration.yaml `likely`: the probability that a hinted (non-finding) likely cause at rank 1, 2, 3 is right."""
    table = _calibration_table(str(calibration or HERE / "calibration.yaml")).get("likely")
    return [float(x) for x in table] if isinstance(table, list) else []


def evidence_strength(top: float, runner_up: float) -> float:
    """The quantity confidence is calibrated on: the top score, discounted when a rival cause is close."""
    margin = top - runner_up
    return top - max(0.0, 1.5 - margin)


def confidence(strength: float, calibration: Path | None = None) -> float:
    """Piecewise-linear map of evidence strength to the probability the finding is right (calibration.yaml)."""
    xs, ys = _calibration(str(calibration or HERE / "calibration.yaml"))
    if not xs:
        return round(max(0.05, min(0.97, strength / 8)), 2)
    if strength <= xs[0]:
        return ys[0]
    if strength >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, strength)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return round(y0 + (y1 - y0) * (strength - x0) / (x1 - x0), 2)


def candidates(p: Parsed, knowledge: Knowledge) -> list[Scored]:
    """Every cause a signature or a hint of which matches (and no veto), in the order of causes.yaml."""
    hay = Haystack.of(p)
    return [s for c in knowledge.causes if (s := score(c, p, hay)) is not None]


def rank(p: Parsed, knowledge: Knowledge, scored: list[Scored] | None = None) -> list[Scored]:
    """The causes with a matching signature, best first (what findings are taken from)."""
    scored = [s for s in (candidates(p, knowledge) if scored is None else scored) if s.specific]
    order = {c.id: i for i, c in enumerate(knowledge.causes)}
    scored.sort(key=lambda s: (-s.score, -s.strongest, order[s.cause.id]))
    return scored


def analyze(data: bytes | str, knowledge: Knowledge | None = None, limit: int = 3,
            calibration: Path | None = None) -> Analysis:
    """Parse a log and rank the known causes; findings is empty when nothing reaches MIN_SCORE (abstain)."""
    knowledge = knowledge or load_knowledge()
    p = parse(data, knowledge.facts)
    scored = candidates(p, knowledge)
    ranked = rank(p, knowledge, scored)
    findings: list[Finding] = []
    evidence: list[list[str]] = []
    for i, s in enumerate(ranked[:limit]):
        if s.score < MIN_SCORE:
            break
        best_other = max((o.score for j, o in enumerate(ranked) if j != i), default=0.0)
        rival = best_other if i == 0 else ranked[0].score
        strength = evidence_strength(s.score, rival) if i == 0 else min(s.score, rival) - 1.5
        c = s.cause
        findings.append(Finding(c.id, confidence(strength, calibration), c.title, _with_quote(c, p), c.fix,
                                c.prevented_by))
        evidence.append(s.evidence)
    for i in range(1, len(findings)):  # ranked best first: a lower finding never shows more confidence
        findings[i].confidence = min(findings[i].confidence, findings[i - 1].confidence)
    answer, likely = likely_causes(scored, findings, [c.id for c in knowledge.causes],
                                   per_rank_probabilities(calibration))
    prefer = likely[0].category if likely else None
    return Analysis(p, findings, evidence, [(s.cause.id, round(s.score, 2)) for s in ranked[:8]],
                    nearest(p, prefer=prefer), likely, answer)


def _with_quote(c: Cause, p: Parsed) -> str:
    """The cause's root cause, followed by the log's own line its `quote` names (the last one), if any."""
    found = c.quote.findall(p.text) if c.quote is not None else []
    if not found:
        return c.root_cause
    line = found[-1] if isinstance(found[-1], str) else found[-1][0]
    return f"{c.root_cause} The log says: {line.strip()[:600]}"


def generic_steps(p: Parsed, knowledge: Knowledge | None = None) -> list[str]:
    """What to do next when no known cause matched: hints keyed on the exception, then the general checklist."""
    knowledge = knowledge or load_knowledge()
    steps = []
    if p.exception:
        steps += [step for pat, step in knowledge.generic if pat.search(str(p.exception))]
    steps += [
        "Find the FIRST error in the log: with several ranks the last lines are usually the launcher stopping the "
        "other ranks (SIGTERM, ChildFailedError, 'Killing subprocess'), not the cause.",
        "Rerun on one GPU (CUDA_VISIBLE_DEVICES=0, no launcher) to tell a model/data error from a distributed one.",
        "For hangs and NCCL errors: NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL; for CUDA errors: "
        "CUDA_LAUNCH_BLOCKING=1 to get the failing op.",
        "Paste the whole log (launch command, versions, the first traceback) to `shardfit diagnose -`.",
    ]
    return steps


def diagnose(text: bytes | str, causes: list[Cause] | None = None, limit: int = 3) -> list[Finding]:
    """Ranked findings for a pasted log, best first; an empty list when no known cause matches."""
    knowledge = load_knowledge()
    if causes is not None:
        knowledge = Knowledge(tuple(causes), knowledge.facts, knowledge.generic)
    return analyze(text, knowledge, limit).findings
