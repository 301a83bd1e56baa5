"""Turn a pasted log (any size, any framework, possibly mangled) into the fields diagnosis rules match on.

Three stages, each bounded so that no input size makes diagnosis slow:

1. `select_regions`: from a large input keep the head (launch command, config), the tail (where the failure is) and
   windows around the first and last error anchors in between. At most `REGION_BYTES` bytes go further.
2. `normalise`: strip ANSI codes, split `\\r` progress bars and lines glued to them, drop per-rank / per-node /
   timestamp prefixes and box-drawing borders, collapse whitespace, and fold repeated lines (eight ranks printing
   the same traceback count once).
3. `parse`: extract the exceptions (type + message, wrapped continuation lines re-joined), the traceback frames
   (file, function), launcher exit codes and signals and library versions into a `Parsed` record (parsed.py), then
   have facts.py gather the facts the rules test (ZeRO stage, device_map, world size, dtype, NCCL work items, ...).

The rules then see the normalised evidence text (at most `EVIDENCE_CHARS` characters; `Parsed.scanned_chars` says
how many), a whitespace-free lowercase copy of it (so a message wrapped or re-spaced by a terminal still matches
a phrase), and the structured fields.
"""

from __future__ import annotations

import re

from shardfit.diagnose.facts import FactPattern, gather_facts
from shardfit.diagnose.install_log import install_ok_end
from shardfit.diagnose.literals import squash_ascii
from shardfit.diagnose.parsed import LIBRARY_PATH, WRAPPER_TYPES, Exc, Parsed, match_frame
from shardfit.diagnose.setting import gpu_rows, read_setting

HEAD_BYTES = 64 * 1024
TAIL_BYTES = 512 * 1024
WINDOW_BYTES = 16 * 1024
EVIDENCE_CHARS = 256 * 1024  # hard cap on what the rule patterns see
MAX_LINE = 2000  # longer lines (binary junk, minified JSON) are cut into pieces of this size
# Hints, symptom facts (named sym_*) and the setting are read on the head and tail of the evidence only: what users
# paste around an error is the command and config above it and the lines at the end, and the many weak patterns
# stay cheap on a huge log.
BRIEF_LINES = (150, 300)
BRIEF_CHARS = 64 * 1024

# Markers of the failure region in the middle of a huge log (searched with bytes.find: fast, no regex). Each is long
# or punctuated enough not to occur by chance: a bare b"Error" turns up in 50 MB of base64 one time in twenty, and
# in names like ErrorHandler, and its first/last hit then takes the window meant for the real error line.
ANCHORS = (b"Traceback (most", b"Error:", b"error:", b"Exception", b"NCCL WARN", b"Killed", b"exitcode",
           b"out of memory")
REGION_BYTES = HEAD_BYTES + TAIL_BYTES + len(ANCHORS) * 2 * 2 * WINDOW_BYTES  # hard cap on what is decoded

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Break lines that a progress bar or another rank glued onto the previous output.
_GLUE = re.compile(
    r"(?:(?<=/s\])|(?<=/it\]))(?=\s*\S)"
    r"|(?<=\S)(?=Traceback \(most recent call last\))"
    r"|(?<=\S)(?=\[rank\d+\]:)"
    r"|(?<=\S)(?=(?:ERROR|WARNING):torch\.distributed)"
    r"|(?<=\])(?=\[[EWI]\s?\d*\s*[\w.]*ProcessGroupNCCL)"
    r"|(?<=\])(?=\[[EW] [\w.]+\.cpp:\d+\])")
_PREFIXES = re.compile(
    r"^(?:\[rank\s*\d+\]:\s?"                       # torch >= 2.2 per-rank prefix
    r"|\[default\d+\]:\s?"                          # torchrun --tee / accelerate
    r"|\[\d+,\d+\]<std(?:out|err)>:\s?"             # mpirun
    r"|\((?:\w+\s+)?pid=\d+(?:,\s*ip=[\d.]+)?\)\s?"  # ray workers
    r"|std(?:out|err):\s?"
    r"|\d{1,3}(?:\.\d{1,3}){3}:\s"                  # pdsh / deepspeed multi-node host prefix
    r"|node\d+:\s"
    r"|\[\d{1,7}\]\s(?=\S)"                         # log viewers' line numbers
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z?\s"  # container runtime timestamps
    r"|>\s?"                                        # quoted in a reply
    r"|[│┃|]\s)"                                    # rich / box borders
)
_BOX_TAIL = re.compile(r"\s[│┃]\s*$")
_BOX_ONLY = re.compile(r"^[\s│┃╭╰╮╯─━═]*$")
_SPACES = re.compile(r"[ \t\f\v\u00a0]+")
# CJK text glued to Latin words ("报OOM", "运行train.py报错：'X' object ..."): CJK letters are word characters, so
# patterns anchored on word boundaries (\bOOM\b) miss them. A space goes between the scripts and full-width
# punctuation becomes ASCII, so the error quoted inside a non-English sentence reads like an English one.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
_CJK_EDGE = re.compile(rf"(?<=[{_CJK}])(?=[A-Za-z0-9'\"`_-])|(?<=[A-Za-z0-9'\"`_.)-])(?=[{_CJK}])")
_FULLWIDTH = str.maketrans({"：": ": ", "，": ", ", "（": " (", "）": ") ", "；": "; ", "！": "! ", "？": "? ",
                            "＜": "<", "＞": ">", "＝": "="})
# An NCCL line copied from a rendered page whose markdown read the underscores of a setting as emphasis: the page shows
# NCCL_P2P_DISABLE as NCCL*P2P*DISABLE (TORCH_NCCL_... as TORCH*NCCL*...), NCCL_DEBUG=INFO as NCCL*DEBUG*=INFO, a bare
# NCCL as _NCCL_ or *NCCL*. The setting's own spelling comes back, so the rules that name it match.
_MD_NCCL_WORD = re.compile(r"(?<![\w*])[*_]{1,2}(NCCL\w*?)[*_]{1,2}(?![\w*])")
_MD_NCCL_TOKEN = re.compile(r"[\w*=]*NCCL[\w*=]*")
_MD_JOIN = re.compile(r"(?<=[A-Z0-9])\*(?=[A-Z0-9])")
_MD_TAIL = re.compile(r"(?<=[A-Z0-9])\*(?==|$)")
_RANKED = re.compile(r"\[rank\d+\]|\[default\d+\]:|\[\d+,\d+\]<std|local_rank")
_DEDUP_KEY = re.compile(r"[\d█▏▎▍▌▋▊▉#]+")

# `SomeError: message` at the start of a (prefix-stripped) line; dotted module paths allowed.
_EXC = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*"
    r"([A-Z][A-Za-z0-9_]*(?:Error|Exception|Exit|Failure|Interrupt|Warning)|Exception|StopIteration|KeyboardInterrupt)"
    r"(?:\((\w+(?:Error|Exception))\))?(?:\s*:\s?(.*)|\s*$)")  # RayTaskError(DistBackendError): the cause's type
# how a traceback can end other than in a Python exception line: the process died (the shell or loader says so), or
# an exception class whose name _EXC does not know (dynamo's BackendCompilerFailed, triton's OutOfResources)
_END_NOT_EXC = re.compile(
    r"Segmentation fault|core dumped|Bus error|^Aborted\b|^Killed\b|Fatal Python error|exitcode\s*:\s*-\d+|"
    r"^(?:[A-Za-z_]\w*\.)*[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+(?:\([\w.]+\))?:\s")
_FRAMEISH = re.compile(r'^(?:File "|File \S+\.py|\S+\.py:\d+ in |Traceback|During handling|The above exception|'
                       r'\^+$|~+$|\[\w+\]|\d{4}-\d\d-\d\d|[IWEF]\d{4} )')
_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)|return code\s*=\s*(-?\d+)|exit(?:ed with)? code\s*:?\s*(-?\d+)"
                   r"|exit status\s*(-?\d+)", re.I)
_SIGNAL = re.compile(r"terminated with signal (SIG\w+)|Signal \d+ \((SIG\w+)\) received"
                     r"|killed by signal: ([\w ]+?)[.\n]|received signal (SIG\w+)|^(Killed)\s*$"
                     r"|(Segmentation fault)|(Bus error)", re.I | re.M)

_VERSION_NAMES = {
    "torch": "torch", "pytorch": "torch", "transformers": "transformers", "deepspeed": "deepspeed",
    "accelerate": "accelerate", "peft": "peft", "trl": "trl", "flash-attn": "flash-attn", "flash_attn": "flash-attn",
    "flashattn": "flash-attn", "bitsandbytes": "bitsandbytes", "vllm": "vllm", "datasets": "datasets",
    "xformers": "xformers", "llamafactory": "llamafactory", "nccl": "nccl", "cuda": "cuda", "triton": "triton",
    "unsloth": "unsloth", "ms-swift": "ms-swift", "driver": "driver",
}
_VERSION = re.compile(
    r"(?<![\w/.-])`?(pytorch|torch|transformers|deepspeed|accelerate|peft|trl|flash[-_]?attn|bitsandbytes|vllm|datasets"
    r"|xformers|llamafactory|nccl|cuda|triton|unsloth|ms-swift|driver)`?"
    r"(?:\s*\(GPU\?\))?(?:\s+info)?(?:[\s:=]*version)?[\s:=(]*v?(\d+\.\d+(?:\.\d+)?(?:[.+][\w.]*)?)", re.I)


def select_regions(data: bytes) -> bytes:
    """Head, tail and windows around the first/last error anchors of `data`; `data` itself when it is small."""
    if len(data) <= REGION_BYTES:
        return data
    mid_lo, mid_hi = HEAD_BYTES, len(data) - TAIL_BYTES
    spans = [(0, HEAD_BYTES)]
    for anchor in ANCHORS:
        for pos in (data.find(anchor, mid_lo, mid_hi), data.rfind(anchor, mid_lo, mid_hi)):
            if pos >= 0:
                spans.append((max(mid_lo, pos - WINDOW_BYTES), min(mid_hi, pos + WINDOW_BYTES)))
    spans.append((mid_hi, len(data)))
    spans.sort()
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return b"\n".join(data[lo:hi] for lo, hi in merged)


def _decode(data: bytes | str) -> tuple[str, int]:
    if isinstance(data, str):
        n = len(data)
        if n > REGION_BYTES:  # a huge str: treat it like bytes so the same bounds apply
            data = select_regions(data.encode("utf-8", "replace"))
        else:
            return data, n
    else:
        n = len(data)
        data = select_regions(data)
    return data.decode("utf-8", "replace"), n


def unwrap(lines: list[str]) -> list[str]:
    """Re-join lines a fixed-width terminal wrapped: when no line is longer than some width W >= 60 and several lines
    are exactly W long, a line of length W continues on the next one (possibly mid-word)."""
    lengths = [len(x) for x in lines if len(x) >= 60]
    if len(lengths) < 2:
        return lines
    width = max(lengths)
    if lengths.count(width) < 2 or width > MAX_LINE:
        return lines
    out: list[str] = []
    carry = ""
    for line in lines:
        # a box border (a rich traceback's right edge or its bottom corner) ends its own line: the width is the box's
        if len(line) == width and not line.rstrip().endswith(("│", "┃", "|", "╯", "╮", "─")):
            carry += line
            continue
        out.append(carry + line)
        carry = ""
    if carry:
        out.append(carry)
    return out


def normalise(text: str) -> list[str]:
    """Clean lines of the log in order, repeated lines folded (first position, last wording)."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CTRL.sub("", text)
    text = _GLUE.sub("\n", text)
    out: list[str] = []
    index: dict[str, int] = {}
    for raw in unwrap(text.split("\n")):
        for start in range(0, max(len(raw), 1), MAX_LINE):
            line = raw[start:start + MAX_LINE]
            for _ in range(4):
                stripped = _PREFIXES.sub("", line.lstrip(" \t"), count=1)
                if stripped == line.lstrip(" \t"):
                    break
                line = stripped
            line = _BOX_TAIL.sub("", line)
            if "NCCL" in line and ("*" in line or "_NCCL" in line):
                line = _md_nccl(line)
            if not line.isascii():
                line = _CJK_EDGE.sub(" ", line.translate(_FULLWIDTH))
            line = _SPACES.sub(" ", line).strip()
            if not line or _BOX_ONLY.match(line):
                continue
            key = _DEDUP_KEY.sub("#", line)
            if key in index:
                out[index[key]] = line
            else:
                index[key] = len(out)
                out.append(line)
    return out


def _md_nccl(line: str) -> str:
    """`line` with the markdown emphasis taken out of its NCCL settings (see _MD_NCCL_WORD)."""
    line = _MD_NCCL_WORD.sub(r"\1", line)
    return _MD_NCCL_TOKEN.sub(lambda m: _MD_TAIL.sub("", _MD_JOIN.sub("_", m.group())), line)


def _evidence(lines: list[str]) -> list[str]:
    """At most EVIDENCE_CHARS characters: everything when it fits, else the head, the error-like lines, the tail."""
    if sum(len(x) + 1 for x in lines) <= EVIDENCE_CHARS:
        return lines
    salient = re.compile(r"error|exception|traceback|warn|fail|killed|signal|nccl|cuda|deepspeed|zero|fsdp|launch|"
                         r"exit|memory|timeout|nan\b|stage|offload|device|version|assert|denied|refused|fault|"
                         r"File \"|\.py\b|--\w|:\s*(true|false|\d)", re.I)
    head, tail = lines[:200], lines[-400:]
    middle = [x for x in lines[200:-400] if salient.search(x)]
    budget = EVIDENCE_CHARS - sum(len(x) + 1 for x in head + tail)
    keep: list[str] = []
    for line in reversed(middle):
        budget -= len(line) + 1
        if budget < 0:
            break
        keep.append(line)
    out = head + keep[::-1] + tail
    while sum(len(x) + 1 for x in out) > EVIDENCE_CHARS and len(out) > 1:  # pathological: huge head/tail lines
        out.pop(len(out) // 2)
    return out


def squash(text: str) -> str:
    """Lowercase without any whitespace: phrases match regardless of wrapping, indentation or spacing."""
    if text.isascii():
        return squash_ascii(text)
    return re.sub(r"[\s`'\"\u2018\u2019\u201c\u201d]+", "", text).lower()


# IPython's (and Jupyter's) traceback opens with the exception's type beside the banner, the message only at its end
_IPY_HEADER = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z][A-Za-z0-9_]*(?:Error|Exception|Exit|Failure|Interrupt)|Exception|"
                         r"StopIteration|KeyboardInterrupt) Traceback \(most recent call last\)$")


def _exceptions(lines: list[str]) -> list[Exc]:
    found: list[Exc] = []
    seen: set[str] = set()
    for i, line in enumerate(lines):
        if h := _IPY_HEADER.match(line):
            found.append(Exc(h.group(1), "", i, header=True))
            continue
        m = _EXC.match(line)
        if not m or line.startswith(("raise ", "File ")):
            continue
        etype, msg = m.group(2) or m.group(1), (m.group(3) or "").strip()
        # A message wrapped over following lines (a terminal, or NCCL's "Last error:" block) is re-joined.
        j = i + 1
        while j < len(lines) and j <= i + 6 and not _FRAMEISH.match(lines[j]) and not _EXC.match(lines[j]):
            nxt = lines[j]
            if len(msg) > 600 or re.match(r"^(\w+ \d+|\[?\d{4}-|[A-Z]\d{4}|\w+:\d+:\d+ \[\d+\]|\[|.*%\|)", nxt):
                break
            # a wrapped message continues: the line so far is cut mid-sentence, or the next one starts lowercase
            if msg and re.search(r"[.!?)\]'\"`]$", msg) and not re.match(r"[a-z(]", nxt):
                break
            msg = f"{msg} {nxt}".strip() if msg else nxt
            j += 1
        key = f"{etype}: {msg[:200]}"
        if key in seen:
            continue
        seen.add(key)
        found.append(Exc(etype, msg[:1000], i))
    return found


# An exception quoted inside a sentence: an issue title ("ms-swift 3.x: AttributeError: ..."), "fails with X: ...".
_EMBEDDED_EXC = re.compile(r"(?:^|[\s:>(\[-])((?:[A-Za-z_]\w*\.)*([A-Z][A-Za-z0-9_]*(?:Error|Exception)))\s*:\s?(\S.*)")
SHORT_PASTE_LINES = 3  # a paste this short is a title or one error line, where an exception may sit mid-sentence


def _embedded_exceptions(lines: list[str]) -> list[Exc]:
    """Exceptions that do not start their line, read only when a short paste has none that does (a title or a
    sentence quoting the error); in a whole log a mid-line "Error:" is usually a logger's word, not the failure."""
    if len(lines) > SHORT_PASTE_LINES:
        return []
    found = []
    for i, line in enumerate(lines):
        m = _EMBEDDED_EXC.search(line)
        if m and not line.lstrip().startswith(("raise ", "File ")):
            found.append(Exc(m.group(2), m.group(3).strip()[:1000], i))
    return found


def _primary(excs: list[Exc]) -> Exc | None:
    """The exception that explains the failure: the last one that is neither a warning nor a launcher wrapper; the
    type of an IPython traceback's header only when no line of the paste states an exception of its own."""
    stated = [e for e in excs if not e.header]
    excs = stated if any(not e.type.endswith("Warning") for e in stated) else excs
    for pred in (lambda e: e.type not in WRAPPER_TYPES and not e.type.endswith("Warning"),
                 lambda e: not e.type.endswith("Warning"), lambda e: True):
        cands = [e for e in excs if pred(e)]
        if cands:
            return cands[-1]
    return None


def _frames(text: str) -> list[str]:
    frames: list[str] = []
    for line in text.split("\n"):
        if ".py" in line and (m := match_frame(line)):
            f = m.group("file").replace("\\", "/")
            parts = re.split(r"(?:site|dist)-packages/", f)
            f = parts[-1] if len(parts) > 1 else "/".join(f.split("/")[-3:])
            # IPython names a method by its qualified name (Accelerator.prepare_model), python by its own name
            frames.append(f"{f}:{m.group('func').rsplit('.', 1)[-1]}")
    return frames


_CARETS = re.compile(r"[\^~\s]+")  # python 3.11's markers under a frame's source line
CUT_TAIL_LINES = 2  # after a cut traceback's last frame: its source line and, at most, one more
# IPython / Jupyter print each frame as a header ("File ~/.../x.py:171, in f(args)", or "/.../x.py in f(args)" before
# IPython 8) over a numbered excerpt of its source, the running line marked by an arrow ("--> 171 ..."); the excerpt
# holds IPython's context lines (five by default, more with %xmode), so a cut after it ends further from its frame
_IPY_SOURCE = re.compile(r"^(?:-*>\s?)?\d{1,6}(?: |$)")
_IPY_ARROW = re.compile(r"^-*>\s?\d{1,6}(?: (.*)|$)")
IPY_CONTEXT_LINES = 12


def _cut_frames(p: Parsed) -> list[str]:
    """The innermost frame of a traceback that the paste cuts before its exception line (the last frame is among the
    paste's last lines and the paste holds no exception but a launcher's wrapper or a warning), in a library's code;
    empty for a complete traceback or one cut in the user's own code. Only the innermost frame: the frames above it
    (DDP's forward, the Trainer's loop) are on the path of every error raised below them. The frame is followed by
    its source line ("file.py:func\nsource"), where the paste shows it: what the frame was calling when the paste
    ends (DDP's __init__ in its first collective, init_process_group in its rendezvous) tells a frame of a cause's
    own mechanism from one every error of that call passes through."""
    last = _last_cut_frame(p.lines)
    # an exception anywhere (quoted above the traceback, or folded away as a repeat of that quote) is the error
    if last is None or any(e.type not in WRAPPER_TYPES and not e.type.endswith("Warning") and not e.header
                           for e in p.exceptions):
        return []
    if any(_EXC.match(x) or _END_NOT_EXC.search(x) or (_FRAMEISH.match(x) and not _CARETS.fullmatch(x))
           for x in p.lines[last + 1:]):
        return []
    # cut in the user's own code, the frames above it name only what the user called, not where it failed
    if not LIBRARY_PATH.search(match_frame(p.lines[last]).group("file").replace("\\", "/")):
        return []
    source = _cut_source(p.lines[last + 1:])
    return [f"{f}\n{source}" if source else f for f in _frames(p.lines[last])]


def _last_cut_frame(lines: list[str]) -> int | None:
    """The index of the frame a paste ends in: among its last CUT_TAIL_LINES + 1 lines, or (IPython's layout) the
    frame just above the numbered source excerpt the paste ends with; None when the paste ends elsewhere."""
    end = len(lines)
    while end > 0 and len(lines) - end < IPY_CONTEXT_LINES and _IPY_SOURCE.match(lines[end - 1]):
        end -= 1
    if end < len(lines) and end > 0 and ".py" in lines[end - 1] and match_frame(lines[end - 1]):
        return end - 1  # an IPython excerpt under its frame's header
    return next((i for i in range(len(lines) - 1, max(-1, len(lines) - 2 - CUT_TAIL_LINES), -1)
                 if ".py" in lines[i] and match_frame(lines[i])), None)


def _cut_source(after: list[str]) -> str:
    """The source line of a cut traceback's last frame: IPython's arrowed line (the one running), else the first
    line under the frame that is not python's carets, without IPython's line number."""
    for x in after:
        if m := _IPY_ARROW.match(x):
            return (m.group(1) or "").strip()
    first = next((x.strip() for x in after if x.strip() and not _CARETS.fullmatch(x)), "")
    return _IPY_SOURCE.sub("", first, count=1).strip() if _IPY_SOURCE.match(first) else first


def _versions(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in _VERSION.finditer(text):
        name = _VERSION_NAMES.get(m.group(1).lower().replace("_", "-"), m.group(1).lower())
        ver = m.group(2).rstrip(".")
        if name in ("torch", "transformers", "deepspeed") and int(ver.split(".")[0]) > 9:
            continue  # a path or another number, not this library's version
        out.setdefault(name, ver)
    return out


def parse(data: bytes | str, fact_patterns: dict[str, FactPattern] | None = None) -> Parsed:
    """Everything the rules need, from at most REGION_BYTES of input and EVIDENCE_CHARS of normalised text."""
    text, n = _decode(data)
    lines = _evidence(normalise(text))
    p = Parsed(input_chars=n, lines=lines)
    if _RANKED.search(text):
        p.facts.add("multi_rank")
    p.text = "\n".join(lines)
    p.scanned_chars = len(p.text)
    p.squashed = squash(p.text)
    head, tail = BRIEF_LINES
    p.brief = p.text if len(lines) <= head + tail else "\n".join(lines[:head] + lines[-tail:])
    if len(p.brief) > BRIEF_CHARS:
        p.brief = p.brief[:BRIEF_CHARS // 4] + "\n" + p.brief[-3 * BRIEF_CHARS // 4:]
    p.exceptions = _exceptions(lines) or _embedded_exceptions(lines)
    p.exception = _primary(p.exceptions)
    p.frames = _frames(p.text)
    p.cut_frames = _cut_frames(p)
    for m in _EXIT.finditer(p.text):
        p.exit_codes.append(int(next(g for g in m.groups() if g is not None)))
    for m in _SIGNAL.finditer(p.text):
        p.signals.append(next(g for g in m.groups() if g is not None).strip())
    p.versions = _versions(p.text)
    gather_facts(p, fact_patterns or {})
    if install_ok_end(lines, _EXC):
        p.facts.add("install_ok_end")
    raw = text if len(text) <= 2 * HEAD_BYTES else text[:HEAD_BYTES] + "\n" + text[-HEAD_BYTES:]
    p.setting = read_setting(p.brief, p.facts, p.zero_stage, p.model_size_b, gpu_rows(_ANSI.sub("", raw)),
                             p.world_size)
    return p
