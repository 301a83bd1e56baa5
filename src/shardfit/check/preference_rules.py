"""`check` on a preference run's data (objective dpo, orpo, simpo or kto): read and tokenised as `train` reads it
(data/preference.py), and what would train differently than written, each a finding with its fix: answers cut at
max_seq_len (and pairs dropped because an answer keeps no token), and KTO data of one kind only."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.data.dataset import DataStats, encode_all, refuse_lost_rows
from shardfit.data.preference import Pair, PrefSplit, encode_pairs, encode_preference_split, read_preference_split
from shardfit.data.vision import VisionProcessor
from shardfit.models.build import load_tokenizer
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model


def preference_data_rules(cfg: Config, whole: bool = True) -> list[Finding]:
    """The findings of a preference config's data. A bad row, a file of the wrong layout, or more rows lost than
    max_bad_rows allows stop here as they stop `train` (exit 2); the chat template and max_seq_len are checked when
    the model's tokenizer is local. Not `whole` (a data file is not here): KTO's balance and the other rules over
    every row are not judged on part of them (check/run.py `part_of_data`)."""
    split = read_preference_split(cfg)
    out = kto_balance_rules(cfg, split) if whole else []
    source = resolve_model(cfg.model)
    if not source.is_local:
        return out
    tokenizer = load_tokenizer(source, cfg.trust_remote_code)
    vision = load_vision_processor(source, cfg, tokenizer)
    if out or not whole:  # train would refuse one-sided KTO data (the finding says so), or part is not here
        pairs = [p for convs in (split.train, split.eval)
                 for p in encode_pairs(tokenizer, split, convs, cfg.max_seq_len, cfg.skip_bad_rows, vision)]
        if not whole:
            refuse_lost_rows(split.stats, cfg.max_bad_rows, "preference rows")
    else:
        train, evals = encode_preference_split(cfg, tokenizer, split, vision)
        pairs = train + evals
    return out + truncation_rules(cfg, tokenizer, split, pairs, vision)


def kto_balance_rules(cfg: Config, split: PrefSplit) -> list[Finding]:
    """KTO weighs desirable answers against undesirable ones: training rows of one kind only leave nothing to
    weigh against (train refuses them)."""
    if cfg.objective != "kto" or not split.train:
        return []
    kinds = {split.rows[c.where].desirable for c in split.train}
    if len(kinds) == 2:
        return []
    only = "desirable" if kinds == {True} else "undesirable"
    other = "undesirable (label: false, or kto_tag: false)" if only == "desirable" else \
        "desirable (label: true, or kto_tag: true)"
    return [Finding(
        "kto_one_kind", "error", f"data: {split.train[0].where}",
        f"all {len(split.train)} training rows are {only}: KTO's loss pulls desirable answers up and undesirable "
        f"ones down against each other, so with one kind there is no contrast, and train refuses the data",
        f"add {other} rows to the data; or, with a good and a bad answer to the same prompts, write them as "
        "prompt/chosen/rejected pairs and set objective: dpo")]


def truncation_rules(cfg: Config, tokenizer: Any, split: PrefSplit, pairs: list[Pair],
                     vision: VisionProcessor | None) -> list[Finding]:
    """Pairs whose prompt + answer exceed max_seq_len: an answer cut short (either side), or a pair dropped because
    an answer keeps no token. Both answers follow the same prompt, so a long prompt cuts both."""
    cut = [p.where for p in pairs if any(side.truncated for side in p.sides)]
    dropped = split.stats.dropped_where
    if not cut and not dropped:
        return []
    order = {c.where: i for i, c in enumerate(split.train + split.eval)}
    flagged = sorted(set(cut) | set(dropped), key=lambda w: order.get(w, len(order)))
    longest = longest_side(tokenizer, split, flagged, vision)
    what = "row" if cfg.objective == "kto" else "pair"

    def count(n: int) -> str:
        return f"{n} {what}{'s' if n != 1 else ''} {'has' if n == 1 else 'have'}"

    parts = ([f"{count(len(cut))} an answer cut at max_seq_len={cfg.max_seq_len}"] if cut else []) + \
        ([f"{count(len(dropped))} been dropped: an answer keeps no token within it"] if dropped else [])
    return [Finding(
        "preference_answers_cut", "warning", f"data: {flagged[0]}",
        f"{' and '.join(parts)} (prompt + answer longer than max_seq_len); a cut answer is compared on its first "
        f"tokens only, and the longest answer of these {what}s is {longest} tokens with its prompt",
        f"max_seq_len: {longest} (each answer of a pair is its own sequence of up to max_seq_len tokens), or "
        "shorten those prompts")]


def longest_side(tokenizer: Any, split: PrefSplit, wheres: list[str], vision: VisionProcessor | None) -> int:
    """The most tokens one answer of these rows takes with its prompt, encoded without a length limit."""
    convs = {c.where: c for c in split.train + split.eval}
    longest = 0
    for where in wheres:
        pref = split.rows[where]
        sides = [pref.chosen] + ([pref.rejected] if pref.rejected is not None else [])
        full = [dataclasses.replace(convs[where], messages=pref.prompt + side) for side in sides]
        encoded = encode_all(tokenizer, full, sys.maxsize, DataStats(), True, vision)
        longest = max([longest, *(len(e.input_ids) for e in encoded)])
    return longest
