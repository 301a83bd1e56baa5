"""The literal text a regex cannot match without: a cheap test that lets most of the knowledge's regexes be skipped.

Hundreds of patterns (causes' items, named facts) are searched on every paste, and most of them find nothing there:
a regex engine that tries an alternation at every position of the text pays for that in full. But nearly every
pattern holds literal words one of which any match must contain ("checkpoint", "timed out"). `required_literals`
reads them from the regex's parsed form; `Haystack` holds the paste squashed (parse.squash: lower case, no
whitespace or quotes), and a pattern none of whose words is in it is known not to match, without running it.

Exact by construction, not by corpus: a word is taken only from a run of literal characters that every match
contains, squashed the way the paste is (squashing maps each character on its own, so a word of the match is a word
of the squashed paste); and a haystack is offered only for an ASCII paste, where lower-casing agrees with the
regex's case-insensitive matching (non-ASCII characters such as the long s fold to ASCII letters under re.I). A word
may hold a non-ASCII character that matches no ASCII one (a Chinese alternative): it is then in no haystack, and
rightly so, since that alternative cannot match an ASCII paste.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

try:  # the regex's parsed form (re._parser from Python 3.11)
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_parse  # type: ignore[no-redef]

if TYPE_CHECKING:  # parsed.py imports setting.py, which reads its tables through this module
    from shardfit.diagnose.parsed import Parsed

Needles = tuple[str, ...]
# characters that squashing removes, among the ASCII ones (parse.squash's class, asked of the regex engine itself)
_SQUASHED_OUT = re.compile(r"[\s`'\"\u2018\u2019\u201c\u201d]")
ASCII_SQUASH = {c: None for c in range(128) if _SQUASHED_OUT.match(chr(c))}
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def squash_ascii(text: str) -> str:
    """parse.squash of an ASCII text, by a translation table (a regex substitution costs twenty times more)."""
    return text.translate(ASCII_SQUASH).lower()


def _squashed(run: list[int]) -> str:
    return "".join(chr(c) for c in run).translate(ASCII_SQUASH).lower()


@cache
def _never_ascii(code: int) -> bool:
    """A non-ASCII character that matches no ASCII one even case-insensitively (the long s and the Kelvin sign
    do): a word holding it is in no ASCII haystack, so an alternative that needs it cannot match an ASCII paste."""
    one = re.compile(re.escape(chr(code)), re.I)
    return code >= 128 and not any(one.match(chr(a)) for a in range(128))


def _best(options: list[Needles]) -> Needles | None:
    """The most selective of several word sets each of which a match must meet: the longest shortest word."""
    useful = [o for o in options if o and min(map(len, o)) > 0]
    return max(useful, key=lambda o: (min(map(len, o)), -len(o))) if useful else None


def _of_sequence(items) -> Needles | None:
    """Words one of which every match of a sequence of regex pieces contains (None when nothing is certain)."""
    options: list[Needles] = []
    run: list[int] = []
    for op, av in items:
        name = str(op)
        if name == "LITERAL" and (av < 128 or _never_ascii(av)):
            run.append(av)
            continue
        if run:
            options.append((_squashed(run),))
            run = []
        found = _of_piece(name, av)
        if found:
            options.append(found)
    if run:
        options.append((_squashed(run),))
    return _best(options)


def _of_piece(name: str, av) -> Needles | None:
    """Words one of which every match of one regex piece contains: a group's, a branch's (one word of each
    alternative) or a repeat's of at least one; nothing from lookarounds, sets, references or optional parts."""
    if name == "SUBPATTERN":
        return _of_sequence(av[-1])
    if name == "ATOMIC_GROUP":
        return _of_sequence(av)
    if name in _REPEATS:
        return _of_sequence(av[2]) if av[0] >= 1 else None
    if name == "BRANCH":
        words: list[str] = []
        for alternative in av[1]:
            found = _of_sequence(alternative)
            if not found:
                return None
            words += [w for w in found if w not in words]
        return tuple(words)
    return None


def required_literals(pattern: re.Pattern) -> Needles | None:
    """Squashed words one of which every match of `pattern` contains, in any case; None when the regex has none."""
    try:
        return _of_sequence(sre_parse.parse(pattern.pattern, pattern.flags))
    except Exception:  # a parser's detail that differs between Python versions: then no shortcut, never a wrong one
        return None


@dataclass(frozen=True)
class Haystack:
    """A paste's evidence text and its head and tail (Parsed.brief) squashed, each None when it is not ASCII."""

    text: str | None
    brief: str | None

    @classmethod
    def of(cls, p: Parsed) -> Haystack:
        text = ascii_squashed(p.text)
        return cls(text, text if p.brief is p.text else ascii_squashed(p.brief))


def ascii_squashed(text: str) -> str | None:
    """The haystack of one text: squashed when it is ASCII, else None (no regex is skipped on it)."""
    return squash_ascii(text) if text.isascii() else None


def may_match(needles: Needles | None, hay: str | None) -> bool:
    """False only when no word of `needles` is in the squashed text `hay`: then the regex cannot match it."""
    return needles is None or hay is None or any(w in hay for w in needles)
