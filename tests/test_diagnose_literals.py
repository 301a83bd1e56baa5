"""The shortcuts that make diagnosis cheap must never change an answer: a regex skipped for lacking its required
words (diagnose/literals.py) would have found nothing, and the known-case index's sparse dot product is the plain
one to the last bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardfit.diagnose import setting
from shardfit.diagnose.engine import load_knowledge, score
from shardfit.diagnose.facts import LineFilter, _pattern_facts
from shardfit.diagnose.literals import Haystack, may_match, required_literals
from shardfit.diagnose.parse import parse, squash
from shardfit.diagnose.parsed import Parsed
from shardfit.diagnose.similar import INDEX, MIN_SIMILARITY, _index, _vector, nearest, tokens

CORPUS = sorted((Path(__file__).with_name("diagnose_corpus")).glob("*.log"))


@pytest.mark.parametrize(("pattern", "words"), [
    (r"out of memory", ("outofmemory",)),
    (r"timed? ?out\b", ("time",)),
    (r"(sav\w*|checkpoint)[^\n]{0,60}(timed? ?out|hang)", ("time", "hang")),  # the rarer side of the sequence
    (r"(?:ab)+c?", ("ab",)),
    (r"a?bc", ("bc",)),
    (r"x(?=needle)", ("x",)),  # a lookahead's words are not the match's
    (r"(ab|c?)d", ("d",)),  # an alternative that may be empty holds no word
    (r"\d+|foo", None),
    (r"x{0,3}", None),
    (r"ſave", ("ave",)),  # the long s matches an ASCII s under re.I: it ends a word, it is none
    (r"卡住|stuck", ("卡住", "stuck")),  # matches no ASCII character: in no ASCII haystack, rightly
])
def test_required_literals(pattern: str, words: tuple[str, ...] | None) -> None:
    assert required_literals(re.compile(pattern, re.I | re.M)) == words


def test_a_non_ascii_paste_is_never_short_cut() -> None:
    """re.I folds the long s to an s, which lower-casing does not: a non-ASCII paste offers no haystack."""
    rx = re.compile(r"saving", re.I)
    p = Parsed(text="ſaving checkpoint", brief="ſaving checkpoint")
    assert rx.search(p.text) and Haystack.of(p).text is None and may_match(required_literals(rx), None)


def _logs() -> list[str]:
    """Every second hand-written log (the check stays under a few seconds) and a paste of awkward spellings."""
    # one with non-ASCII text (no haystack: every regex runs) and its ASCII twin (the shortcut runs)
    awkward = "Error: the CUDA  out of\nmemory (\"OOM\") — 卡住 after upgrade to v4.45"
    return [f.read_text() for f in CORPUS[::2]] + [awkward, awkward.replace(" — 卡住", " -- stuck")]


def test_every_pattern_that_matches_keeps_its_words() -> None:
    """On every hand-written log: whenever a knowledge regex matches the text it is searched in, one of its
    required words is in that text's haystack (an extraction that drops a needed word fails here)."""
    k = load_knowledge()
    regexes = [(it.value, it.needles, it.brief) for c in k.causes
               for it in c.signatures + c.context + c.veto + c.hints if it.kind == "re"]
    regexes += [(f.pattern if isinstance(f, LineFilter) else f, None, name.startswith("sym_"))
                for name, f in k.facts.items()]
    regexes += [(rx, words, True) for _, rx, words in setting._LAUNCHER_RX + setting._FRAMEWORK_RX]
    regexes = [(rx, words if words is not None else required_literals(rx), brief) for rx, words, brief in regexes]
    checked = 0
    for log in _logs():
        p = parse(log, k.facts)
        hay = Haystack.of(p)
        for rx, words, brief in regexes:
            if rx.search(p.brief if brief else p.text):
                checked += 1
                assert may_match(words, hay.brief if brief else hay.text), (rx.pattern, words)
    assert checked > 200


def test_causes_and_facts_score_as_without_the_shortcut() -> None:
    k = load_knowledge()
    for log in _logs():
        p = parse(log, k.facts)
        hay = Haystack.of(p)
        for c in k.causes:
            assert score(c, p, hay) == score(c, p), c.id
        plain = Parsed(text=p.text, brief=p.brief, squashed=squash(p.text), lines=p.lines)
        _pattern_facts(plain, k.facts)
        assert plain.facts == {n for n, f in k.facts.items() if f.search(p.brief if n.startswith("sym_") else p.text)}


def test_nearest_is_the_plain_dot_product() -> None:
    cases, idf, _ = _index(str(INDEX))
    for log in _logs():
        p = parse(log, load_knowledge().facts)
        q = _vector(tokens(p), idf)
        plain = [(sum(v * c["_vec"].get(t, 0.0) for t, v in q.items()), c) for c in cases]
        plain = sorted(((s, c) for s, c in plain if s >= MIN_SIMILARITY), key=lambda x: -x[0])[:3]
        want = [{"url": c["url"], "category": c["label"], "similarity": round(s, 2)} for s, c in plain]
        assert nearest(p) == want


def test_the_bundled_table_is_what_the_knowledge_file_gives() -> None:
    """literals.json (every pattern's required words, read without compiling) is a fresh reading of causes.yaml:
    after an edit, `python -m shardfit.diagnose.regex --write` must be run, or this fails."""
    import json

    import yaml

    from shardfit.diagnose.regex import TABLE, fresh_table

    fresh = fresh_table(yaml.safe_load((TABLE.parent / "causes.yaml").read_text()))
    assert json.loads(TABLE.read_text()) == fresh, "run: python -m shardfit.diagnose.regex --write"


def test_a_pattern_is_compiled_only_when_searched() -> None:
    """Loading the knowledge compiles nothing of the bundled file; a one-line paste compiles only the few regexes
    whose words it holds, and every answer equals the compiled regex's."""
    from shardfit.diagnose.engine import analyze
    from shardfit.diagnose.regex import Regex

    k = load_knowledge()
    regexes = [i.value for c in k.causes for part in (c.signatures, c.context, c.veto, c.hints) for i in part
               if isinstance(i.value, Regex)]
    regexes += [p.pattern if isinstance(p, LineFilter) else p for p in k.facts.values()]
    assert len(regexes) > 300
    before = sum(r._compiled is not None for r in regexes)
    analyze("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    after = sum(r._compiled is not None for r in regexes)
    assert after - before < len(regexes) / 4, (before, after, len(regexes))
    text = CORPUS[0].read_text()
    for r in regexes[:60]:
        plain = re.compile(r.pattern, r.flags).search(text)
        assert (r.search(text) is None) == (plain is None) and (plain is None or r.search(text).span() == plain.span())


def test_a_causes_file_of_ones_own_is_read_and_checked_at_load(tmp_path: Path) -> None:
    """A pattern the table does not hold is compiled and read at load: its words are the regex's own, and a bad
    one is refused there, naming the cause."""
    from shardfit.errors import UserError

    base = ("causes:\n- id: mine\n  title: t\n  root_cause: r\n  fix: f\n  prevented_by: p\n  check: c\n"
            "  signatures:\n  - {{re: '{}', w: 3}}\n")
    good = tmp_path / "good.yaml"
    good.write_text(base.format("zebra[0-9]+ stripes"))
    item = load_knowledge(good).causes[0].signatures[0]
    assert item.value._compiled is not None and item.needles == ("stripes",)
    bad = tmp_path / "bad.yaml"
    bad.write_text(base.format("zebra(unclosed"))
    with pytest.raises(UserError, match="cause mine.*bad re"):
        load_knowledge(bad)


def test_loading_the_bundled_file_compiles_nothing() -> None:
    """Every pattern of the bundled file is in the table: a fresh load compiles none of them (an ignored or stale
    table would compile them all, answering the same, only slower)."""
    from shardfit.diagnose import engine
    from shardfit.diagnose.regex import Regex

    k = engine._load.__wrapped__(str(engine.HERE / "causes.yaml"))
    regexes = [i.value for c in k.causes for part in (c.signatures, c.context, c.veto, c.hints) for i in part
               if isinstance(i.value, Regex)]
    regexes += [p.pattern if isinstance(p, LineFilter) else p for p in k.facts.values()]
    regexes += [c.quote for c in k.causes if c.quote is not None] + [rx for rx, _ in k.generic]
    assert regexes and not [r for r in regexes if r._compiled is not None]
    assert k == engine._load.__wrapped__(str(engine.HERE / "causes.yaml"))  # two loads compare equal


@pytest.mark.parametrize("text", ["null", "[1, 2]", '{"2:x": "abc"}', '{"2:x": [""]}', '{"2:x": [3]}', "{not json"])
def test_a_damaged_table_is_ignored(tmp_path: Path, text: str) -> None:
    """A table of the wrong shape would hand a regex words it does not need (a string read as its letters) and skip
    it wrongly: it is ignored whole, and every pattern is compiled and read at load."""
    from shardfit.diagnose.regex import _table

    bad = tmp_path / "literals.json"
    bad.write_text(text)
    assert _table.__wrapped__(bad) == {}
