"""diagnose's parser: what survives mangled pastes (ANSI, \\r progress bars, rank prefixes, wrapped and glued lines),
what is extracted (exception, frames, launcher codes, versions, setup facts), and that input size is bounded:
the size tests count the characters that reach the rule patterns instead of timing anything."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.diagnose.engine import analyze, diagnose, load_knowledge
from shardfit.diagnose.facts import LineFilter
from shardfit.diagnose.parse import EVIDENCE_CHARS, REGION_BYTES, normalise, parse, select_regions
from shardfit.errors import UserError


def _parse(text: str):
    return parse(text, load_knowledge().facts)


def test_ansi_carriage_returns_and_rank_prefixes_are_removed() -> None:
    raw = ("\x1b[32mMap: 10%|█         | 1/10 [00:01<00:09]\rMap: 20%|██        | 2/10 [00:02<00:08]\r"
           "[rank3]: \x1b[31mRuntimeError: boom\x1b[0m\n")
    p = _parse(raw)
    assert str(p.exception) == "RuntimeError: boom"
    assert "multi_rank" in p.facts
    assert not any("\x1b" in line or line.startswith("[rank") for line in p.lines)


def test_repeated_rank_lines_are_folded_and_glued_lines_split() -> None:
    err = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=1, NumelOut=1, " \
          "Timeout(ms)=1800000) ran for 1800079 milliseconds before timing out."
    raw = "".join(f"[rank{r}]:[E1104 07:31:02 ProcessGroupNCCL.cpp:632] [Rank {r}] {err}\n" for r in range(8))
    raw = "Running tokenizer on dataset:  41%|████ | 410000/1000000 [29:58<43:10, 227.6 examples/s]" + raw
    lines = normalise(raw)
    assert sum("Watchdog" in x for x in lines) == 1
    assert lines[0].startswith("Running tokenizer") and "Watchdog" not in lines[0]
    assert diagnose(raw)[0].category == "nccl_timeout_preprocessing"


def test_wrapped_message_matches_as_if_unwrapped() -> None:
    wrapped = ("ValueError: Parameter 'model.embed_tokens.weight' is shared with a parameter already managed by\n"
               "another FSDP group. For shared/tied\nparameters, use fully_shard([module_a, module_b]) to place them "
               "in the same FSDP group.\n")
    assert diagnose(wrapped)[0].category == "fsdp_tied_embeddings"
    hard_wrapped = "stderr: [rank0]: an exception occurred : ('Ca\nnnot copy out of meta tensor; no data!',).\n"
    assert diagnose(hard_wrapped)[0].category == "meta_device_loading"


def test_exception_message_continuation_is_rejoined() -> None:
    p = _parse("RuntimeError: DataLoader worker (pid 47) is killed by signal: Bus\nerror. It is possible that "
               "dataloader's workers are out of shared\nmemory. Please try to raise your shared memory limit.\n")
    assert p.exception.message.endswith("raise your shared memory limit.")
    assert _parse("RuntimeError: boom!\nNext line of the log\n").exception.message == "boom!"


def test_primary_exception_skips_launcher_wrappers_and_warnings() -> None:
    p = _parse('UserWarning: None of the inputs have requires_grad=True\n'
               'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
               "ModuleNotFoundError: No module named 'einops'\n"
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert p.exception.type == "ModuleNotFoundError"
    assert [e.type for e in p.exceptions] == ["UserWarning", "ModuleNotFoundError", "ChildFailedError"]


def test_frames_exit_codes_signals_versions() -> None:
    p = _parse(
        'File "/opt/conda/lib/python3.10/site-packages/deepspeed/runtime/zero/stage3.py", line 2117, in '
        "unscale_and_clip_grads\n"
        "│ /root/env/lib/python3.10/site-packages/transformers/trainer.py:2784 in compute_loss │\n"
        "E0629 00:06:24.298000 torch/distributed/elastic/multiprocessing/api.py:826] failed (exitcode: -9) "
        "local_rank: 2 (pid: 29736) of binary: /opt/conda/bin/python3.10\n"
        "[ERROR] [launch.py:321:sigkill_handler] ['python', 'train.py'] exits with return code = -7\n"
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGKILL\n"
        "[2025-03-07] [INFO] [logging.py:128:log_dist] [Rank 0] DeepSpeed info: version=0.16.3, git-hash=unknown\n"
        "torch==2.6.0  - `transformers` version: 4.31.0  NCCL version 2.19.3+cuda12.4  flash-attn 2.6.3\n")
    assert "deepspeed/runtime/zero/stage3.py:unscale_and_clip_grads" in p.frames
    assert "transformers/trainer.py:compute_loss" in p.frames
    assert {-9, -7} <= set(p.exit_codes) and "SIGKILL" in p.signals
    assert p.versions == {"deepspeed": "0.16.3", "torch": "2.6.0", "transformers": "4.31.0",
                          "nccl": "2.19.3+cuda12.4", "flash-attn": "2.6.3"}
    assert {"exit-9", "exit-7", "zero3"} <= p.facts


def test_setup_facts() -> None:
    p = _parse('deepspeed --num_gpus 8 train.py --deepspeed ds_z3_offload_config.json --bf16 True\n'
               '"offload_optimizer": {\n    "device": "cpu",\nmodel = AutoModelForCausalLM.from_pretrained(p, '
               'device_map="auto")  # Qwen2-VL-72B-Instruct\n')
    assert p.zero_stage == 3 and p.world_size == 8 and p.device_map == "auto" and p.dtype == "bf16"
    assert {"zero3", "offload", "deepspeed", "launcher", "device_map_split", "big_model", "multi_rank"} <= p.facts
    assert _parse('"zero_optimization": {"stage": 2}').zero_stage == 2
    assert _parse("--deepspeed examples/deepspeed/ds_z2_config.json").zero_stage == 2


def test_half_traceback_and_single_line_pastes() -> None:
    assert diagnose("exits with return code = -9")[0].category == "host_ram_oom"
    assert diagnose("Gradient computed twice for this partition.")[0].category == "gc_ddp_reentrant"
    assert diagnose("    raise ZeRORuntimeException(\nThe checkpoint being loaded used a DP world size of 8 but the "
                    "current world size is 4.")[0].category == "resume_world_size_mismatch"


def _b64_lines(n_bytes: int, seed: int = 0) -> bytes:
    """n_bytes of unique 76-character lines (base64 of random bytes, seeded so a run can be repeated)."""
    return base64.encodebytes(random.Random(seed).randbytes(n_bytes * 3 // 4))[:n_bytes]


def test_50mb_log_reads_bounded_regions_and_finds_errors_anywhere() -> None:
    head = b"torchrun --nproc_per_node 8 train.py --deepspeed ds_z3_config.json\n"
    middle = b"RuntimeError: indices should be either on cpu or on the same device as the indexed tensor (cpu)\n"
    data = head + _b64_lines(25_000_000) + middle + _b64_lines(25_000_000, seed=1)
    assert len(data) > 50_000_000
    region = select_regions(data)
    assert len(region) <= REGION_BYTES + 64  # joins between regions
    a = analyze(data)
    # The whole text does not go through the patterns: at most EVIDENCE_CHARS, under 1% of the input.
    assert a.parsed.scanned_chars <= EVIDENCE_CHARS and a.parsed.scanned_chars < len(data) / 100
    assert a.parsed.input_chars == len(data)
    assert a.findings and a.findings[0].category == "zero3_cpu_buffer_rotary"  # head (ZeRO-3) + middle (error)
    tail_err = b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    b = analyze(_b64_lines(50_000_000, seed=2) + tail_err)
    assert b.findings and b.findings[0].category.startswith("oom_")
    assert b.parsed.scanned_chars <= EVIDENCE_CHARS


def test_huge_str_input_is_bounded_like_bytes() -> None:
    text = "x" * 30_000_000 + "\nRuntimeError: CUDA error: invalid device ordinal\n"
    a = analyze(text)
    assert a.findings[0].category == "more_ranks_than_gpus"
    assert a.parsed.scanned_chars <= EVIDENCE_CHARS


def test_binary_garbage_is_handled() -> None:
    a = analyze(random.Random(7).randbytes(50_000_000))
    assert a.parsed.scanned_chars <= EVIDENCE_CHARS
    assert a.findings == [] or a.findings[0].confidence < 0.8
    assert analyze(b"").findings == [] and analyze("\x00\x01\x02\xff").findings == []


def test_fixed_width_terminal_wrapping_is_undone() -> None:
    msg = ("ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32 while "
           "wrapping model.layers.0 with FullyShardedDataParallel (use_orig_params=False, "
           "sharding_strategy=FULL_SHARD)")
    wrapped = "\n".join(msg[i:i + 79] for i in range(0, len(msg), 79))
    assert max(len(x) for x in wrapped.splitlines()) == 79 and len(wrapped.splitlines()) == 3
    assert diagnose(wrapped)[0].category == "fsdp_mixed_dtype"
    assert normalise(wrapped) == [msg]
    # lines of varied length are left alone (no width to undo)
    assert normalise("a" * 70 + "\n" + "b" * 90 + "\nshort") == ["a" * 70, "b" * 90, "short"]


def test_words_that_contain_error_do_not_take_the_window_of_the_real_error() -> None:
    # A name like ErrorHandler before and after the one real error line: the window must still land on the error.
    noise = b"INFO registered ErrorHandler for rank 3\n"
    middle = b"RuntimeError: indices should be either on cpu or on the same device as the indexed tensor (cpu)\n"
    data = (b"torchrun --nproc_per_node 8 train.py --deepspeed ds_z3_config.json\n" + _b64_lines(5_000_000, seed=3)
            + noise + _b64_lines(20_000_000, seed=4) + middle + _b64_lines(20_000_000, seed=5) + noise
            + _b64_lines(5_000_000, seed=6))
    assert middle.strip() in select_regions(data)
    assert analyze(data).findings[0].category == "zero3_cpu_buffer_rotary"


_TIMED = """
import json, random, sys, time
from shardfit.diagnose.engine import analyze, load_knowledge
load_knowledge()
analyze("warm-up")
rng = random.Random(5)
head = "Traceback (most recent call last):\\nRuntimeError: loss is nan\\n"
words = "the trainer loads each shard then starts its loop on every rank and logs what it saw".split()
def grow(row):
    rows, n = [], len(head)
    while n < SIZE:
        rows.append(row()); n += len(rows[-1]) + 1
    return head + "\\n".join(rows) + "\\n"
u = rng.random
# fixed-width key=value metrics: the terminal-wrap undo glues them into 2000-char lines ("...=004.189step=000002")
dense = grow(lambda: f"step={rng.randrange(10**6):06d} loss={u():.6f} lr={u() * 1e-5:.6e} grad_norm={u():.6f} "
                     f"tokens/s={u() * 1e4:09.2f} mem_gb={u() * 10:07.3f}")
tensor = grow(lambda: "        [" + ", ".join(f"{u() * 6 - 3: .4e}" for _ in range(8)) + "],")
plain = grow(lambda: " ".join(rng.choice(words) for _ in range(16)))
def cpu(text):
    t = time.process_time(); analyze(text); return time.process_time() - t
print(json.dumps({"plain": min(cpu(plain) for _ in range(2)), "dense": cpu(dense), "tensor": cpu(tensor)}))
"""


def test_number_dense_logs_parse_about_as_fast_as_plain_ones() -> None:
    """A log full of numbers (a metrics dump, a printed tensor) is no slower to read than prose of the same size,
    up to a generous factor: no pattern backtracks over the digits (a glued "a=1b=2" once split two ways per token,
    exponential on a 2000-char line). Timed in a child process, so a runaway pattern fails by its timeout."""
    code = _TIMED.replace("SIZE", str(112_000))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    t = json.loads(r.stdout)
    assert t["dense"] <= 3 * t["plain"] and t["tensor"] <= 3 * t["plain"], t


# the same three logs; the version fact searched alone on each one's head and tail, against reading the plain log
_VERSION_TIMED = _TIMED.split("def cpu(text):")[0] + """
from shardfit.diagnose.parse import parse
fact = load_knowledge().facts["sym_version"]
def alone(text):
    brief = parse(text).brief
    t = time.process_time()
    for _ in range(20):
        fact.search(brief)
    return (time.process_time() - t) / 20
def cpu(text):
    t = time.process_time(); analyze(text); return time.process_time() - t
print(json.dumps({"version_plain": min(alone(plain) for _ in range(2)), "version_dense": alone(dense),
                  "version_tensor": alone(tensor), "plain": min(cpu(plain) for _ in range(2))}))
"""


def test_the_version_fact_skips_lines_without_its_words() -> None:
    """The version wordings (a long alternation tried at every position) cost more than any other fact on a big
    paste; tried only on the lines that hold one of its words, they cost a sliver of reading a plain log of the same
    size, on prose, a metrics dump and a printed tensor alike. Timed in a child process, as a ratio."""
    code = _VERSION_TIMED.replace("SIZE", str(112_000))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    t = json.loads(r.stdout.splitlines()[-1])
    assert max(t["version_plain"], t["version_dense"], t["version_tensor"]) <= 0.02 * t["plain"], t


# version wordings a terminal or the user broke across lines: the plain regex and the filtered one must both stop at
# the line break (a question on one line and the version on the next, a requirement wrapped before its operator, a
# lookahead whose refusal sits on the next line)
CROSS_LINE = ["Which version did you use? I'm using\n v4.45", "requires torch\n>=2.4",
              "please update to main\ncheckpoint loading still fails",
              "RuntimeError: CUDA error: an illegal memory access was encountered\nWhat version of liger-kernel did "
              "you use in the paper? I'm using\n0.3.1 with the recipe's config"]


def _all_logs() -> list[str]:
    from tests.diagnose_real.evaluate import synthetic_cases
    from tests.diagnose_real.split import load_cases, read_corpus

    logs = [c["log"] for c in load_cases() + synthetic_cases()] + CROSS_LINE
    for name in ("diagnose_short", "diagnose_outsiders"):
        corpus = read_corpus(Path(__file__).with_name(name) / "cases.yaml")
        logs += [c["log"] for c in corpus if isinstance(c, dict) and c.get("log")]
    return logs


def test_a_filtered_fact_answers_as_its_plain_regex_on_every_corpus() -> None:
    """A fact with keys (causes.yaml `fact_keys`) is tried only on lines holding one of them: that must never change
    its answer. On every line of every corpus's pastes, and on each paste's head and tail as a whole, the filtered
    search agrees with the plain one; an alternative added to the regex without a key fails here."""
    k = load_knowledge()
    filtered = {name: f for name, f in k.facts.items() if isinstance(f, LineFilter)}
    assert "sym_version" in filtered
    for log in _all_logs():
        brief = parse(log, k.facts).brief
        for name, f in filtered.items():
            assert bool(f.search(brief)) == bool(f.pattern.search(brief)), (name, brief[-300:])
            for line in brief.split("\n"):
                assert bool(f.search(line)) == bool(f.pattern.search(line)), (name, line)


def test_fact_keys_name_a_fact_and_list_words(tmp_path: Path) -> None:
    base = "facts:\n  x: 'abc'\ncauses: []\n"
    for bad in ("fact_keys:\n  y: [abc]\n", "fact_keys:\n  x: []\n", "fact_keys:\n  x: abc\n"):
        f = tmp_path / f"c{len(bad)}.yaml"
        f.write_text(base + bad)
        with pytest.raises(UserError, match="fact_keys"):
            load_knowledge(f)
    f = tmp_path / "ok.yaml"
    f.write_text(base + "fact_keys:\n  x: [ABC]\n")
    assert load_knowledge(f).facts["x"].keys == ("abc",)


def test_a_keyed_fact_that_can_cross_a_line_is_refused(tmp_path: Path) -> None:
    """A keyed fact is searched line by line, so a regex piece that matches a line break (\\s, \\W, [^x]) would
    answer otherwise than the plain search: the loader names the fact and the fix."""
    for i, pat in enumerate((r"abc\s*x", r"abc\W{0,3}x", r"abc[^x]y", r"abc(?!\s*x)")):
        f = tmp_path / f"c{i}.yaml"
        f.write_text(f"facts:\n  x: '{pat}'\nfact_keys:\n  x: [abc]\ncauses: []\n")
        with pytest.raises(UserError, match="fact x: has fact_keys.*line break"):
            load_knowledge(f)
    f = tmp_path / "ok.yaml"
    f.write_text("facts:\n  x: 'abc[ \\t]*[^\\w\\n]x[^\\n]{0,9}'\nfact_keys:\n  x: [abc]\ncauses: []\n")
    assert load_knowledge(f).facts["x"].keys == ("abc",)
