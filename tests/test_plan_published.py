"""bench/plan_vs_published.py and bench/published_memory.yaml: the structure of the published cases, the fixed
dev/test split, and that every case is predicted. Accuracy is reported by the script, not asserted here."""


from __future__ import annotations

import hashlib

import yaml

from tests import helpers


def load_bench():
    return helpers.load_bench("plan_vs_published")


def test_split_is_sha256_parity_of_the_source_name() -> None:
    """A source is dev when the first hex digit of sha256(name) is even: the rule fixed before any error."""
    mod = load_bench()
    for name in ("unsloth-context", "qwen1-profiling", "torchtitan-fsdp", "x", "y"):
        digit = int(hashlib.sha256(name.encode()).hexdigest()[0], 16)
        assert mod.part(name) == ("dev" if digit % 2 == 0 else "test")


def test_published_cases_are_complete() -> None:
    """Every source names its URL and family; every case has what its kind needs; every key is either read by
    the comparison, a Workload field, or recorded as not modelled; each part has several families."""
    mod = load_bench()
    data = yaml.safe_load(mod.CASES.read_text())
    allowed = mod.CASE_KEYS | mod.WORKLOAD_KEYS | mod.RECORDED_ONLY
    families: dict[str, set[str]] = {"dev": set(), "test": set()}
    total = 0
    for name, src in data["sources"].items():
        assert "https://" in src["text"] and src["family"], name
        families[mod.part(name)].add(src["family"])
        for case in src["cases"]:
            c = {**src["defaults"], **case}
            assert set(c) <= allowed, (name, set(c) - allowed)
            assert c["kind"] in ("measured", "max_context", "oom") and "model" in c and "gpu" in c
            if c["kind"] == "measured":
                assert c["peak"] > 0 and c["unit"] in mod.UNITS
            total += 1
    assert total >= 70
    assert len(families["dev"]) >= 3 and len(families["test"]) >= 3


def test_every_case_is_predicted_and_summarised() -> None:
    """The script predicts every case, gives each a verdict (OOM rows: whether the planner says it does not fit)
    and summarises each part per family. How often it is right is the bench's measurement, not asserted here."""
    mod = load_bench()
    data = yaml.safe_load(mod.CASES.read_text())
    result = mod.evaluate(data)
    assert len(result["cases"]) == sum(len(src["cases"]) for src in data["sources"].values())
    for row in result["cases"]:
        assert row["predicted_total_gib"] > 0 and isinstance(row["verdict_right"], bool)
        assert ("error" in row) == (row["kind"] != "oom")
    for part in ("dev", "test"):
        summary = result["parts"][part]
        assert summary["verdicts"] == sum(f["verdicts"] for f in summary["families"].values())


def _row(**kw) -> dict:
    base = {"source": "s", "part": "dev", "model": "m", "gpu": "2xA100", "nodes": 1, "strategy": "ddp",
            "grad_ckpt": "full", "compile": False, "micro_batch": 1, "workload": "w",
            "published_tokens_per_s": 100.0, "predicted_tokens_per_s": 100.0}
    return {**base, **kw}


def test_ordering_counts_strategy_pairs_apart_from_same_strategy_pairs() -> None:
    """Runs that differ only in what the plan chooses (strategy, checkpointing, compile; the batch may follow) are
    strategy pairs; runs with the same choices on another workload are same-strategy pairs; runs differing in both
    are left out; a published tie (within 5 %) is skipped and a predicted tie is not right."""
    mod = load_bench()
    ddp = _row(published_tokens_per_s=100, predicted_tokens_per_s=90)
    zero3 = _row(strategy="zero3", micro_batch=4, published_tokens_per_s=150, predicted_tokens_per_s=120)
    longer = _row(workload="w2", published_tokens_per_s=80, predicted_tokens_per_s=95)
    both = _row(strategy="zero2", workload="w2", published_tokens_per_s=300, predicted_tokens_per_s=10)
    other_gpu = _row(gpu="8xH100", strategy="zero2", published_tokens_per_s=1, predicted_tokens_per_s=1000)
    assert mod.pair_kind(ddp, zero3) == "strategy" and mod.pair_kind(ddp, longer) == "same_strategy"
    assert mod.pair_kind(ddp, both) == "mixed" and mod.pair_kind(ddp, other_gpu) is None
    result = mod.ordering([ddp, zero3, longer, both, other_gpu])
    # ddp < zero3 predicted right; longer < both (ddp vs zero2 on w2) predicted the other way
    assert result["strategy_pairs"] == {"right": 1, "pairs": 2}
    assert result["same_strategy_pairs"] == {"right": 0, "pairs": 1}  # ddp > longer, predicted below
    assert result["mixed_pairs"] == 3  # ddp-both, zero3-longer, zero3-both
    tie = _row(strategy="zero3", published_tokens_per_s=103, predicted_tokens_per_s=500)
    same_prediction = _row(grad_ckpt="none", published_tokens_per_s=200, predicted_tokens_per_s=90)
    assert mod.ordering([ddp, tie])["pairs"] == 0
    assert mod.ordering([ddp, same_prediction])["strategy_pairs"] == {"right": 0, "pairs": 1}


def test_throughput_cases_are_complete_and_compare_strategies() -> None:
    """Every throughput source names its URL; every case gives one published rate and is predicted; the
    collection holds strategy pairs in both parts."""
    mod = load_bench()
    data = yaml.safe_load(mod.THROUGHPUT.read_text())
    rates = {"tokens_per_s_per_gpu", "s_per_step", "samples_per_s", "minutes_per_epoch"}
    for name, src in data["sources"].items():
        assert "https://" in src["text"], name
        for case in src["cases"]:
            c = {**src["defaults"], **case}
            assert len(rates & set(c)) == 1, (name, c)
            assert "minutes_per_epoch" not in c or c.get("ordering_only"), name
    result = mod.evaluate_throughput(data)
    assert len(result["cases"]) == sum(len(src["cases"]) for src in data["sources"].values())
    assert all(r["predicted_tokens_per_s"] > 0 for r in result["cases"])
    assert all(("error" in r) != r["ordering_only"] for r in result["cases"])
    for part in ("dev", "test"):
        assert result["parts"][part]["strategy_pairs"]["pairs"] >= 3


def test_float8_pairs_are_runs_that_differ_only_in_float8() -> None:
    """An FP8 run pairs with the bf16 run of its source that differs from it in float8 alone, and the pair gives
    both speed ratios; a bf16 run that differs in anything else (here compile) is no pair."""
    mod = load_bench()
    bf16 = _row(seq=8192, float8=False, ordering_only=False, workload='{"float8": false, "seq_len": 8192}',
                published_tokens_per_s=100, predicted_tokens_per_s=120)
    fp8 = {**bf16, "float8": True, "workload": '{"float8": true, "seq_len": 8192}',
           "published_tokens_per_s": 128, "predicted_tokens_per_s": 144}
    eager = {**bf16, "compile": True}
    pairs = mod.float8_pairs([bf16, eager, fp8])
    assert len(pairs) == 1
    assert pairs[0]["published_ratio"] == 1.28 and pairs[0]["predicted_ratio"] == 1.2
    assert pairs[0]["ratio_error"] == round(1.2 / 1.28 - 1, 4)
    assert mod.float8_pairs([eager, fp8]) == []


def test_gpt2_rows_are_planned_as_their_config_builds_them() -> None:
    """transformers#9371's GPT-2 rows give their shape inline: each is what GPT-2's config.json (model_type gpt2,
    attn_pdrop 0.1) builds through plan/config_shape.py, so they are planned with GPT-2's score chain, biases,
    position embedding and attention dropout, not as a Llama of the same widths; and they ran the 2021 Trainer's
    step (transformers' AdamW, clipping that waits on torch 1.7, zero_grad writing zeros)."""
    from shardfit.plan.config_shape import shape_from_config

    mod = load_bench()
    src = yaml.safe_load(mod.THROUGHPUT.read_text())["sources"]["transformers-9371-gpt2-1gpu-vs-ddp"]
    sizes = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20)}
    for case in src["cases"]:
        layers, hidden, heads = sizes[case["model"]]
        cfg = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": 50257,
               "n_positions": 1024, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
        built = shape_from_config(cfg, case["model"])
        assert mod.throughput_shape({**src["defaults"], **case}) == built, case["model"]
        w = mod.workload({**src["defaults"], **case}, case["seq"])
        assert (w.optimizer_loop, w.grad_clip, w.zero_grad_zeros) == ("transformers", "per_tensor_sync", True)
