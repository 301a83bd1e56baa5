"""Input and output of `shardfit diagnose`: read the log, print the findings (text, or the JSON of
docs/reference.md)."""

from __future__ import annotations

import collections
import sys
import textwrap
from pathlib import Path
from typing import Any

from shardfit.diagnose.engine import Analysis, generic_steps
from shardfit.errors import UserError

# stdin may never end (`yes | shardfit diagnose`): it is read up to MAX_STDIN, and of a long input only its first
# and last KEEP bytes are kept, where a log's command line and its final error are.
MAX_STDIN = 256 << 20
KEEP = 32 << 20


def read_input(path: str | None, note: list[str] | None = None) -> bytes:
    """The raw log: a file's bytes, or stdin for None / "-" (bounded; what was left out is said in `note`). A
    missing file is a UserError (exit 2)."""
    if path in (None, "-"):
        if sys.stdin is None:  # started with stdin closed (`<&-`): Python leaves sys.stdin None
            raise UserError("diagnose: stdin is closed; pipe the log in (`... | shardfit diagnose -`), or name the "
                            "log file: shardfit diagnose FILE.")
        try:
            return read_stream(sys.stdin.buffer, note if note is not None else [])
        except OSError as e:  # stdin is a folder (`< /tmp`) or a device that refuses reads
            raise UserError(f"diagnose: cannot read stdin ({e.strerror or e}); pipe the log in, or name the log "
                            "file: shardfit diagnose FILE.") from None
    p = Path(path)
    if p.is_dir():  # a run's folder: shardfit keeps no log in it, and other tools' logs have no one name to look for
        raise UserError(f"diagnose: {p} is a folder; pass the log file itself (the launcher's output saved with "
                        "`2>&1 | tee train.log`, or a rank's log), or - to read the pasted log from stdin.")
    if not p.exists():
        raise UserError(f"diagnose: no such file {p}; pass a log file, or - to read the pasted log from stdin.")
    try:
        if p.is_file():
            return p.read_bytes()
        with p.open("rb") as stream:  # a pipe (`<(kubectl logs ...)`), read as stdin is: bounded
            return read_stream(stream, note if note is not None else [])
    except OSError as e:  # a file this user may not read: the OS's reason, not a traceback
        raise UserError(f"diagnose: cannot read {p} ({e.strerror or e}); give this user read access to it, or "
                        "paste the log on stdin (-).") from None


def read_stream(stream: Any, note: list[str], limit: int = MAX_STDIN, keep: int = KEEP) -> bytes:
    """At most `limit` bytes of `stream`, in bounded memory: the first `keep` and the last `keep` of them (the
    whole input when it is shorter than both). `note` gets a line saying what was not diagnosed."""
    head = bytearray()
    tail: collections.deque[bytes] = collections.deque()
    tail_bytes = total = 0
    while total < limit:
        chunk = stream.read(min(1 << 20, limit - total))
        if not chunk:
            break
        total += len(chunk)
        if len(head) < keep:
            take = keep - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        if chunk:
            tail.append(chunk)
            tail_bytes += len(chunk)
            while tail_bytes - len(tail[0]) >= keep:
                tail_bytes -= len(tail.popleft())
    ended = total < limit or not stream.read(1)
    if not ended:
        note.append(f"stopped reading stdin after {limit >> 20} MiB (it did not end); diagnosed its first and last "
                    f"{keep >> 20} MiB read. For a longer log, pass the file: shardfit diagnose FILE")
    elif total > 2 * keep:
        note.append(f"stdin was {total >> 20} MiB; diagnosed its first and last {keep >> 20} MiB")
    rest = b"".join(tail)
    if total > 2 * keep:
        return bytes(head) + b"\n" + rest[-keep:]
    return bytes(head) + rest


def to_json(a: Analysis) -> dict:
    """{"findings": [...six contract fields...]} plus the evidence per finding, the answer kind ("confident",
    "likely", "none") with the ranked likely causes (each with the check that tells it apart), what was parsed and
    similar reports."""
    out = {
        "findings": [f.to_json() for f in a.findings],
        "evidence": a.evidence,
        "answer": a.answer,
        "likely_causes": [x.to_json() for x in a.likely],
        "parsed": a.parsed.summary(),
        "similar": a.similar,
    }
    if not a.findings:
        out["next_steps"] = generic_steps(a.parsed)
    return out


def _parsed_lines(a: Analysis) -> list[str]:
    s = a.parsed.summary()
    lines = []
    if s["exception"]:
        lines.append(f"exception:     {textwrap.shorten(s['exception'], 220, placeholder=' ...')}")
    if s["failing_frame"]:
        lines.append(f"failing frame: {s['failing_frame']}")
    if s["exit_codes"] or s["signals"]:
        bits = [f"exit code {c}" for c in s["exit_codes"]] + list(s["signals"])
        lines.append(f"launcher:      {', '.join(bits)}")
    if s["versions"]:
        lines.append("versions:      " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    setup = []
    if s["zero_stage"] is not None:
        setup.append(f"ZeRO stage {s['zero_stage']}")
    if s["world_size"]:
        setup.append(f"{s['world_size']} processes")
    if s["device_map"]:
        setup.append(f"device_map={s['device_map']}")
    if s["dtype"]:
        setup.append(s["dtype"])
    setup += [f for f in ("fsdp", "offload", "lora", "quant", "grad_ckpt") if f in s["facts"]]
    if setup:
        lines.append("setup:         " + ", ".join(setup))
    st = s["setting"]
    bits = [f"{k.replace('_', ' ')} {st[k]}" for k in ("launcher", "framework", "strategy", "model") if k in st]
    if "gpus_visible" in st:
        bits.append(f"{st['gpus_visible']} GPUs visible")
    if "replica_gib" in st:
        bits.append(f"one replica ~{st['replica_gib']:g} GiB" + (f" on {st['gpu_mem_gib']:g} GiB GPUs"
                                                                 if "gpu_mem_gib" in st else ""))
    if bits:
        lines.append("setting:       " + ", ".join(bits))
    if s["input_chars"] > s["scanned_chars"] * 2:
        lines.append(f"read:          {s['scanned_chars']:,} of {s['input_chars']:,} characters (head, tail and the "
                     "regions around the errors)")
    return lines


def _findings_text(a: Analysis, wrap: textwrap.TextWrapper) -> list[str]:
    """The confident answer: the findings, each with its check, then the other likely causes in one line each."""
    out: list[str] = []
    checks = {x.category: x.check for x in a.likely}
    for i, (f, ev) in enumerate(zip(a.findings, a.evidence, strict=True), 1):
        out.append(f"{i}. {f.title}  [{f.category}, confidence {f.confidence:.2f}]")
        out.append(wrap.fill(f"   cause: {f.root_cause}"))
        out.append(wrap.fill(f"   fix:   {f.fix}"))
        out.append(wrap.fill(f"   shardfit: {f.prevented_by}"))
        out.append(wrap.fill(f"   seen:  {'; '.join(ev[:5])}"))
        if checks.get(f.category):
            out.append(wrap.fill(f"   check: {checks[f.category]}"))
        out.append("")
    others = [x for x in a.likely if x.category not in {f.category for f in a.findings}]
    if others:
        out.append("also possible:")
        out += [wrap.fill(f"  - {x.title} [{x.category}]: {x.check}") for x in others]
        out.append("")
    return out


def _likely_text(a: Analysis, wrap: textwrap.TextWrapper) -> list[str]:
    """No confident answer: the ranked likely causes, each with the one check that tells it apart."""
    out = ["Likely causes (the log does not settle it; the check under each tells them apart):", ""]
    for i, x in enumerate(a.likely, 1):
        out.append(f"{i}. {x.title}  [{x.category}, likely {x.confidence:.2f}]")
        out.append(wrap.fill(f"   check: {x.check}"))
        out.append(wrap.fill(f"   cause: {x.root_cause}"))
        out.append(wrap.fill(f"   fix:   {x.fix}"))
        out.append(wrap.fill(f"   seen:  {'; '.join(x.evidence[:5])}"))
        out.append("")
    return out


def format_text(a: Analysis) -> str:
    """The human-readable report printed by `shardfit diagnose FILE`."""
    out: list[str] = []
    wrap = textwrap.TextWrapper(width=118, subsequent_indent="          ")
    if a.answer != "none":
        out += _findings_text(a, wrap) if a.answer == "confident" else _likely_text(a, wrap)
        parsed = _parsed_lines(a)
        if parsed:
            out.append("parsed from the log:")
            out += [f"  {x}" for x in parsed]
    else:
        out.append("No known cause matched. Rather than guess, here is what was understood of the log:")
        parsed = _parsed_lines(a) or ["(no exception, traceback or launcher message found)"]
        out += [f"  {x}" for x in parsed]
        out.append("")
        out.append("Next steps:")
        step_wrap = textwrap.TextWrapper(width=118, initial_indent="  - ", subsequent_indent="    ")
        out += [step_wrap.fill(s) for s in generic_steps(a.parsed)]
    if a.similar:
        out.append("")
        out.append("similar reports:")
        out += [f"  {s['url']}  ({s['category']}, similarity {s['similarity']:.2f})" for s in a.similar]
    return "\n".join(out).rstrip() + "\n"
