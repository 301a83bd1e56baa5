"""`shardfit diagnose` on real error reports from public issue threads (tests/diagnose_real/cases.yaml).

The corpus is split per thread (SHA-256 of the URL, split.py) into a dev part, used to write the rules and fit the
confidence calibration, and a test part that was not looked at while doing so. The held-out thresholds below are
the acceptance criteria of issue 20; docs/diagnose.md reports the numbers.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from shardfit.diagnose.engine import HERE, analyze, diagnose, load_causes
from tests.diagnose_real.build import render
from tests.diagnose_real.evaluate import docs_prose, docs_rows, evaluate, percent, synthetic_cases
from tests.diagnose_real.split import load_cases, read_corpus, split_of
from tests.helpers import run_cli

TESTS = Path(__file__).parent
CORPUS = TESTS / "diagnose_corpus"


@cache
def _metrics(part: str, variant: str = "full") -> dict:
    return evaluate(synthetic_cases() if part == "synthetic" else load_cases(part), variant)


def test_corpus_is_complete_and_well_formed() -> None:
    cases = load_cases()
    ids = {c.id for c in load_causes()}
    assert len(cases) >= 250
    urls = [c["url"] for c in cases]
    assert len(set(urls)) == len(urls)
    public = {c["url"] for c in read_corpus(TESTS / "diagnose_public" / "cases.yaml")}
    assert not public & set(urls), "a case of the tuned public set is reused"
    for c in cases:
        assert set(c) >= {"url", "repo", "label", "resolved", "note", "log"}, c["url"]
        assert c["label"] in ids | {"none"}, (c["url"], c["label"])
        assert c["resolved"] in ("confirmed", "likely")
        assert re.match(rf"https://github\.com/{re.escape(c['repo'])}/(issues|pull)/\d+$", c["url"]), c["url"]
        assert c["log"].strip()
    assert sum(c["label"] == "none" for c in cases) >= 40
    assert len({c["repo"] for c in cases}) >= 100
    assert len({c["label"] for c in cases}) >= 30


def test_split_is_by_thread_hash_and_balanced() -> None:
    cases = load_cases()
    assert all(c["split"] == split_of(c["url"]) for c in cases)
    share = sum(c["split"] == "test" for c in cases) / len(cases)
    assert 0.4 <= share <= 0.6
    assert split_of("https://github.com/a/b/issues/1") == split_of("https://github.com/a/b/issues/1")


def test_held_out_part_meets_the_acceptance_thresholds() -> None:
    """Issue 20's done-when, on the part no rule was written for: top-1 >= 90% and top-3 >= 95% on known causes,
    abstaining on >= 90% of unrelated errors, and fewer than 5% wrong among findings shown at >= 0.8."""
    m = _metrics("test")
    assert m["known"] >= 90 and m["unrelated"] >= 15
    assert m["findings_top1"] >= 0.90, m["findings_top1"]
    assert m["top1"] >= 0.90, m["top1"]
    assert m["top3"] >= 0.95, m["top3"]
    assert m["findings_abstain_unrelated"] >= 0.90, m["findings_abstain_unrelated"]
    assert m["wrong_at_08"] < 0.05, m["wrong_at_08"]


@pytest.mark.parametrize("variant", ["tail", "line"])
def test_held_out_short_pastes_rank_their_cause(variant: str) -> None:
    """Issue 46's target for short and bare pastes, on the held-out part cut to its last lines or its one error
    line: the right cause among the three likely causes in >= 90% of known cases, under 5% of confident answers
    wrong, no confident answer on unrelated errors."""
    m = _metrics("test", variant)
    assert m["top3"] >= 0.90, m["top3"]
    assert m["wrong_at_08"] < 0.05, m["wrong_at_08"]
    assert m["unconfident_unrelated"] == 1.0, m["unconfident_unrelated"]


def test_dev_part_and_hand_written_corpus_stay_right() -> None:
    """Regression guard on what the rules were written for (the dev part, the synthetic logs, the public set)."""
    dev, syn = _metrics("dev"), _metrics("synthetic")
    assert dev["top1"] >= 0.95 and dev["findings_abstain_unrelated"] >= 0.95 and dev["wrong_at_08"] < 0.03
    assert dev["abstain_unrelated"] >= 0.95
    assert syn["top1"] >= 0.98
    for variant in ("tail", "line"):
        short = _metrics("dev", variant)
        assert short["top3"] >= 0.95 and short["wrong_at_08"] < 0.03, (variant, short["top3"], short["wrong_at_08"])
        assert short["unconfident_unrelated"] == 1.0 and short["abstain_unrelated"] >= 0.85


# The category ids of docs/reference.md (`shardfit diagnose --json`; issue 20 added ten): never renamed, never
# removed. The reference lists what causes.yaml holds now; this list keeps the ids it promised.
CONTRACT_IDS = """
device_map_auto_in_distributed device_map_auto_cross_device zero3_device_map_conflict zero3_cpu_submodule
zero3_cpu_buffer_rotary zero3_save_empty_params oom_full_replica_per_rank oom_activation_not_sharded host_ram_oom
fsdp_lora_requires_grad fsdp_mixed_dtype fsdp_qlora_quant_storage fsdp_tied_embeddings gc_ddp_reentrant
gc_remote_code_old_api gc_inputs_no_grad ddp_unused_parameters dataparallel_accidental quantized_model_device_placement
meta_device_loading meta_device_offload fp16_unscale nccl_timeout_save nccl_timeout_preprocessing nccl_p2p_hang
env_deepspeed_op_build resume_world_size_mismatch fp16_nan_loss extension_abi_mismatch tokenizer_embedding_mismatch
shm_too_small more_ranks_than_gpus nccl_env_setup library_version_regression dist_port_in_use
gpu_arch_unsupported""".split()


def test_category_ids_are_kept_and_documented() -> None:
    ids = [c.id for c in load_causes()]
    assert len(ids) == len(set(ids))
    assert set(CONTRACT_IDS) <= set(ids), set(CONTRACT_IDS) - set(ids)
    doc = (TESTS.parent / "docs" / "diagnose.md").read_text()
    assert all(f"| {i} " in doc or f"| **{i}** " in doc for i in ids), [i for i in ids if f"{i} " not in doc]


def test_every_cause_has_a_hand_written_log() -> None:
    logged = {p.name.split(".")[0] for p in CORPUS.glob("*.log")}
    assert {c.id for c in load_causes()} <= logged


def test_shipped_calibration_and_similar_index_are_up_to_date() -> None:
    cal, idx = render()
    assert (HERE / "calibration.yaml").read_text() == cal, "run: PYTHONPATH=src python -m tests.diagnose_real.build"
    assert (HERE / "known_cases.json").read_text() == idx, "run: PYTHONPATH=src python -m tests.diagnose_real.build"
    points = yaml.safe_load(cal)["points"]
    ys = [points[k] for k in sorted(points)]
    assert ys == sorted(ys) and all(0 < y < 1 for y in ys)


@pytest.mark.parametrize("log, expected", [
    # the classes of misses issue 20 lists, each in a wording the old rules did not cover
    ("ValueError: Parameter 'lm_head.weight' is shared with a parameter already managed by another FSDP group. "
     "For shared/tied\nparameters, use fully_shard([module_a, module_b])", "fsdp_tied_embeddings"),
    ("[INFO] [launch.py:319:sigkill_handler] Killing subprocess 4411\n[ERROR] [launch.py:325:sigkill_handler] "
     "['python', '-u', 'train.py', '--local_rank=1'] exits with return code = -9", "host_ram_oom"),
    ("ds_z3_config.json\nRuntimeError: indices should be either on cpu or on the same device as the indexed tensor "
     "(cpu)", "zero3_cpu_buffer_rotary"),
    ("deepspeed zero2\nAssertionError: The parameter 12 has already been reduced. Gradient computed twice for this "
     "partition. Multiple gradient reduction is currently not supported", "gc_ddp_reentrant"),
    ("  File \".../deepspeed/__init__.py\", line 171, in initialize\nRuntimeError: You can't move a model that has "
     "some modules offloaded to cpu or disk.", "device_map_auto_in_distributed"),
    ("deepspeed/ops/csrc/adam/cpu_adam.cpp\nfatal error: Python.h: No such file or directory",
     "env_deepspeed_op_build"),
    ("Running tokenizer on dataset:  47%|████▊ | 1695000/3634744 [30:09<33:25, 967.30 examples/s]Traceback (most "
     "recent call last):\n  File \".../transformers/training_args.py\", line 2035, in main_process_first",
     "nccl_timeout_preprocessing"),
    ("zero_stage: 3\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB",
     "oom_activation_not_sharded"),
    ("zero_optimization stage 3, offload_optimizer device cpu\n  File \".../deepspeed/runtime/zero/stage3.py\", line "
     "2117, in unscale_and_clip_grads\nRuntimeError: Expected all tensors to be on the same device, but found at "
     "least two devices, cuda:0 and cpu!", "library_version_regression"),
    ("deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 16 but "
     "the current world size is 8.", "resume_world_size_mismatch"),
    ("--fp16 True\n{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.1}", "fp16_nan_loss"),
    ("ImportError: .../flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi",
     "extension_abi_mismatch"),
    ("Indexing.cu:1289: indexSelectLargeIndex: block: [1,0,0] Assertion `srcIndex < srcSelectDimSize` failed.",
     "tokenizer_embedding_mismatch"),
    ("RuntimeError: DataLoader worker (pid 13) is killed by signal: Bus error.", "shm_too_small"),
    ("torchrun --nproc_per_node 8 train.py\nRuntimeError: CUDA error: invalid device ordinal", "more_ranks_than_gpus"),
    ("NCCL WARN dlopen failed : libnvidia-ml.so.1: cannot open shared object file: No such file or directory",
     "nccl_env_setup"),
    ("TypeError: MyTrainer.compute_loss() got an unexpected keyword argument 'num_items_in_batch'",
     "library_version_regression"),
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
     "(errno: 98 - Address already in use)", "dist_port_in_use"),
    ("RuntimeError: FlashAttention only supports Ampere GPUs or newer.", "gpu_arch_unsupported"),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [127.0.1.1]:41233: Connection refused",
     "rendezvous_unreachable"),
    ("  [  error] master_addr_loopback at --master-addr", "rendezvous_unreachable"),
    ("shardfit: watchdog: evaluation after step 40 has run 650 s (over the watchdog's 300 s): rank 1 is in the "
     "forward (evaluation; 649.0 s); rank 0 waits in all_reduce", "watchdog_stuck_rank"),
    ("shardfit: rank 2: stopping because rank 0 on gpu-07 failed: torch.OutOfMemoryError: CUDA out of memory.",
     "peer_rank_failed"),
])
def test_issue_classes(log: str, expected: str) -> None:
    findings = diagnose(log)
    assert findings and findings[0].category == expected, [(f.category, f.confidence) for f in findings]


def test_frames_beat_a_bare_device_line() -> None:
    """The stage3 unscale regression is not 'a submodule stayed on the CPU', however ZeRO-3 the log looks."""
    log = (CORPUS / "library_version_regression.1.log").read_text()
    cats = [f.category for f in diagnose(log)]
    assert cats[0] == "library_version_regression" and "zero3_cpu_submodule" not in cats


def test_zero3_oom_is_never_a_full_replica() -> None:
    for log in ("zero_stage: 3\ntorch.OutOfMemoryError: CUDA out of memory.",
                "--deepspeed ds_z3_config.json Qwen2-72B\ntorch.OutOfMemoryError: CUDA out of memory."):
        assert "oom_full_replica_per_rank" not in [f.category for f in diagnose(log)]


@pytest.mark.parametrize("log", [
    "KeyError: 'instruction'",
    "ModuleNotFoundError: No module named 'einops'",
    "jinja2.exceptions.TemplateError: Conversation roles must alternate user/assistant/user/assistant/...",
    "OSError: You are trying to access a gated repo.",
    "json.decoder.JSONDecodeError: Extra data: line 2 column 1 (char 694)",
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "everything is fine, loss=0.42 at step 100",
])
def test_unrelated_errors_abstain(log: str) -> None:
    assert diagnose(log) == []


def test_abstain_still_reports_what_was_parsed(tmp_path: Path) -> None:
    log = tmp_path / "err.log"
    log.write_text('Traceback (most recent call last):\n  File "/x/site-packages/datasets/arrow_dataset.py", '
                   "line 3450, in _map_single\nKeyError: 'instruction'\ntransformers 4.41.2\n")
    r = run_cli("diagnose", str(log), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["findings"] == []
    assert out["parsed"]["exception"] == "KeyError: 'instruction'"
    assert out["parsed"]["failing_frame"] == "datasets/arrow_dataset.py:_map_single"
    assert out["parsed"]["versions"] == {"transformers": "4.41.2"}
    assert any("column" in s for s in out["next_steps"])
    r = run_cli("diagnose", str(log), timeout=60)
    assert r.returncode == 0 and "No known cause matched" in r.stdout and "KeyError" in r.stdout


def test_json_extends_the_contract(tmp_path: Path) -> None:
    r = run_cli("diagnose", str(CORPUS / "shm_too_small.1.log"), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"findings", "parsed", "similar", "evidence"} <= set(out)
    f = out["findings"][0]
    assert set(f) == {"category", "confidence", "title", "root_cause", "fix", "prevented_by"}
    assert f["category"] == "shm_too_small" and len(out["evidence"]) == len(out["findings"])
    assert all(s["url"].startswith("https://github.com/") for s in out["similar"])


def test_similar_reports_point_to_known_threads() -> None:
    case = next(c for c in load_cases("dev") if c["label"] == "resume_world_size_mismatch")
    a = analyze(case["log"])
    assert a.similar and a.similar[0]["category"] == "resume_world_size_mismatch"
    assert analyze("everything is fine").similar == []


def test_big_file_through_the_cli(tmp_path: Path) -> None:
    big = tmp_path / "big.log"
    with big.open("wb") as f:
        f.write(b"accelerate launch --config_file fsdp.yaml train.py\n")
        f.write(b"step 1 loss 2.31 lr 1e-5 tokens/s 18211\n" * 1_300_000)  # ~50 MB
        f.write(b"ValueError: Must flatten tensors with uniform requires_grad when use_orig_params=False\n")
    assert big.stat().st_size > 50_000_000
    r = run_cli("diagnose", str(big), "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["findings"][0]["category"] == "fsdp_lora_requires_grad"
    assert out["parsed"]["scanned_chars"] < 1_000_000 < out["parsed"]["input_chars"]


def test_mangled_dev_logs_still_diagnosed() -> None:
    """The dev logs hard-wrapped at 79 columns, rank-prefixed, coloured and interleaved with \\r progress bars."""
    from tests.diagnose_real.perturb import mangle

    m = evaluate([dict(c, log=mangle(c["log"], i)) for i, c in enumerate(load_cases("dev"))])
    assert m["top1"] >= 0.95 and m["findings_abstain_unrelated"] >= 0.95 and m["wrong_at_08"] < 0.03


# The ninth dev corpus (tests/diagnose_dev9): real threads collected on 2026-11-29, split by repository before round 8
# was written; `holdout: true` was scored only once round 8 was done (the same figures before and after it).
DEV9 = read_corpus(TESTS / "diagnose_dev9" / "cases.yaml")


def test_dev9_is_well_formed_and_split_by_repository() -> None:
    ids = {c.id for c in load_causes()} | {"none"}
    for c in DEV9:
        assert set(c) >= {"url", "repo", "label", "resolved", "note", "log"}, c["url"]
        assert c["label"] in ids and c["resolved"] in ("confirmed", "likely") and c["log"].strip(), c["url"]
    assert len({c["url"] for c in DEV9}) == len(DEV9) >= 40
    parts = {c["repo"]: bool(c.get("holdout")) for c in DEV9}
    assert all(parts[c["repo"]] == bool(c.get("holdout")) for c in DEV9)  # no repository on both sides
    held = [c for c in DEV9 if c.get("holdout")]
    assert 0.4 <= len(held) / len(DEV9) <= 0.6 and any(c["label"] == "none" for c in held)
    others = {c["url"] for c in load_cases()}
    for name in ("diagnose_outsiders", "diagnose_public"):
        others |= {c["url"] for c in read_corpus(TESTS / name / "cases.yaml")}
    assert not others & {c["url"] for c in DEV9}


@pytest.mark.parametrize(("holdout", "variant", "top3"), [
    (False, "full", 1.0), (False, "line", 1.0),  # in-sample: round 8 was written looking at this part
    (True, "full", 0.75), (True, "line", 0.68),  # held out: 12 and 11 of 16 known causes, as measured
])
def test_dev9_floors(holdout: bool, variant: str, top3: float) -> None:
    m = evaluate([c for c in DEV9 if bool(c.get("holdout")) == holdout], variant)
    assert m["top3"] >= top3, m["top3"]
    assert m["wrong_confident"] == 0 and m["unconfident_unrelated"] == 1.0
    assert m["abstain_unrelated"] >= (0.66 if holdout else 1.0), m["abstain_unrelated"]
    # docs/diagnose.md's latest before -> after table holding dev9 (the earlier rounds' tables are their record):
    # the figure after each arrow is the one measured now
    name = "dev9, held out" if holdout else "dev9, dev"
    doc = (TESTS.parent / "docs" / "diagnose.md").read_text().splitlines()
    row = [x for x in doc if x.startswith(f"| {name} | {variant} |")][-1]
    stated = [cell.split("->")[-1].strip() for cell in row.strip(" |").split("|")[3:]]
    measured = [percent(m["top1"]), percent(m["top3"]), percent(m["answered"]), f"{m['abstain_unrelated']:.0%}",
                f"{m['wrong_confident']} of {m['confident']}"]
    assert stated == measured, (row, measured)


MAIN_TABLE_HEADER = "| part | form | known / unrelated | top-1 | top-3 | confident-wrong | abstain on unrelated |"


def main_table_diff(doc: str, rows: list[str]) -> list[str]:
    """How docs/diagnose.md's main table differs from `rows`, the rows measured now: "+ row" for one the page shows
    and the corpus no longer gives (a stale row), "- row" for one it lacks; empty when the two are the same table,
    row for row and in order. The table is the lines from its header to the first line that is not a row."""
    lines = doc.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith(MAIN_TABLE_HEADER)), None)
    if start is None:
        return ["- the main table (its header is missing)"]
    table = []
    for x in lines[start + 2:]:  # past the header and its |---| line
        if not x.startswith("|"):
            break
        table.append(x)
    if table == rows:
        return []
    return [f"+ {r}" for r in table if r not in rows] + [f"- {r}" for r in rows if r not in table] or [
        "the rows are the measured ones in another order"]


def test_a_stale_extra_or_missing_row_of_the_main_table_is_noticed() -> None:
    rows = ["| dev (in-sample) | full | 1 / 0 | 100% | 100% | 0 of 1 | - | 100% |",
            "| dev (in-sample) | line | 1 / 0 | 50.0% | 100% | 0 of 1 | - | 50.0% |"]
    page = [MAIN_TABLE_HEADER + " `findings` top-1 |", "|---|---|---|---|---|---|---|---|", *rows]
    assert main_table_diff("\n".join(["# Diagnose", "", *page, "", "Under the table."]), rows) == []
    stale = "| dev, round 8 (in-sample) | full | 1 / 0 | 90.0% | 100% | 0 of 1 | - | 90.0% |"
    assert main_table_diff("\n".join([*page, stale, ""]), rows) == [f"+ {stale}"]
    assert main_table_diff("\n".join(page[:-1]), rows) == [f"- {rows[1]}"]
    assert main_table_diff("\n".join([*page[:2], rows[1], rows[0]]), rows)
    assert main_table_diff("no table here", rows)


def test_docs_main_table_and_its_figures_are_measured_now() -> None:
    """docs/diagnose.md's main table (whole logs, last lines, one line) and the sentences quoting it, as
    `python -m tests.diagnose_real.evaluate docs` prints them from the corpus now: the whole table, so a row the
    corpus no longer gives fails as a missing one does."""
    doc = (TESTS.parent / "docs" / "diagnose.md").read_text()
    diff = main_table_diff(doc, docs_rows())
    assert not diff, "run `python -m tests.diagnose_real.evaluate docs`; the page's table differs:\n" + "\n".join(diff)
    flat = " ".join(doc.split())
    for sentence in docs_prose():
        assert sentence in flat, sentence


def test_the_confident_wrong_bound_is_the_rule_of_three_only_with_none_wrong() -> None:
    from tests.diagnose_real.evaluate import _bound_name, _upper
    assert _upper({"confident": 100, "wrong_confident": 0}) == "3.0%"
    assert _bound_name({"confident": 100, "wrong_confident": 0}) == "95%, rule of three"
    # 2 wrong of 100: the rule of three's 3% would be below what 2 wrong already suggest
    assert float(_upper({"confident": 100, "wrong_confident": 2}).rstrip("%")) > 6
    assert _bound_name({"confident": 100, "wrong_confident": 2}) == "95%, Wilson upper bound"
