"""Nearest known reports: public issue threads whose parsed error looks like the pasted one.

known_cases.json holds, for every case of the real corpus (tests/diagnose_real) and of the first public set
(tests/diagnose_public), its URL, its label and the tokens of its parsed error (exception type and message words,
frame functions, a few facts). A pasted log is tokenised the same way and compared by TF-IDF cosine similarity.
This is shown to the user as "similar reports"; it does not change the ranking of causes.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from functools import cache
from pathlib import Path

from shardfit.diagnose.parsed import Parsed

INDEX = Path(__file__).with_name("known_cases.json")
MIN_SIMILARITY = 0.3
_WORD = re.compile(r"[a-z][a-z_]{2,30}")
_STOP = frozenset("the and for with this that you are not was from have has but can use using error errors line "
                  "file most recent call last traceback none true false self".split())
_ERRORISH = re.compile(r"error|fail|warn|killed|timeout|signal", re.I)
_FACTS = ("zero3", "fsdp", "deepspeed", "offload", "lora", "quant", "fp16", "bf16", "multi_rank", "device_map",
          "grad_ckpt", "omni", "vision", "data_prep", "saving", "oom")


def tokens(p: Parsed) -> list[str]:
    """The words that characterise a parsed error (what similar reports are matched on)."""
    out: list[str] = []
    # IPython's header names the type its last line states again: a type counts once unless no line states it
    stated = [e for e in p.exceptions if not e.header]
    for e in (stated or p.exceptions)[-4:]:
        out.append("exc:" + e.type.lower())
        out += [w for w in _WORD.findall(e.message.lower()) if w not in _STOP]
    out += ["fn:" + f.rsplit(":", 1)[-1].lower() for f in p.frames[-12:]]
    out += ["fact:" + f for f in _FACTS if f in p.facts] * 3  # the setup tells apart reports with one message
    if not p.exceptions:  # no exception: the error-looking lines carry the signal
        for line in p.lines[-40:]:
            if _ERRORISH.search(line):
                out += [w for w in _WORD.findall(line.lower()) if w not in _STOP]
    return out


@cache
def _index(path: str) -> tuple[list[dict], dict[str, float], dict[str, list[tuple[int, float]]]]:
    """The known cases with their vectors, the tokens' IDF, and for each token the cases holding it with its weight
    there (so a paste is compared only with the cases it shares a token with); built once per process."""
    f = Path(path)
    if not f.is_file():
        return [], {}, {}
    cases = json.loads(f.read_text())["cases"]
    df = Counter(t for c in cases for t in set(c["tokens"]))
    n = len(cases)
    idf = {t: math.log((1 + n) / (1 + k)) + 1 for t, k in df.items()}
    postings: dict[str, list[tuple[int, float]]] = {}
    for i, c in enumerate(cases):
        c["_vec"] = _vector(c["tokens"], idf)
        for t, w in c["_vec"].items():
            postings.setdefault(t, []).append((i, w))
    return cases, idf, postings


def _vector(toks: list[str], idf: dict[str, float]) -> dict[str, float]:
    tf = Counter(toks)
    vec = {t: (1 + math.log(k)) * idf.get(t, 1.0) for t, k in tf.items()}
    norm = math.sqrt(sum(v * v for v in vec.values())) or 1.0
    return {t: v / norm for t, v in vec.items()}


def nearest(p: Parsed, k: int = 3, index: Path | None = None, prefer: str | None = None) -> list[dict]:
    """Up to k known reports most similar to the parsed log: url, category, similarity (0..1). Reports of the
    category `prefer` (the top finding) come first among those similar enough."""
    cases, idf, postings = _index(str(index or INDEX))
    toks = tokens(p)
    if not cases or not toks:
        return []
    # each case's products in the query's token order, as the plain dot product adds them (the terms of tokens a case
    # lacks are zeros, which change no sum): the same similarity to the last bit
    terms: dict[int, list[float]] = {}
    for t, v in _vector(toks, idf).items():
        for i, w in postings.get(t, ()):
            terms.setdefault(i, []).append(v * w)
    scored = []
    for i in sorted(terms):
        sim = sum(terms[i])
        if sim >= MIN_SIMILARITY:
            scored.append((sim, cases[i]))
    scored.sort(key=lambda x: (x[1]["label"] != prefer, -x[0]) if prefer else -x[0])
    return [{"url": c["url"], "category": c["label"], "similarity": round(s, 2)} for s, c in scored[:k]]
