"""Preference objectives (DPO, ORPO, SimPO, KTO): the data layouts, the losses' math, step 0 of a run, the two
references agreeing, bad rows, and 2 ranks equal to one process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.data.formats import BadRow, detect_preference
from shardfit.data.preference import to_pref_row
from shardfit.errors import UserError
from shardfit.parallel.env import init_distributed
from shardfit.report.build import make_report
from shardfit.train.preference import PreferenceSettings, dpo_losses, kto_losses, orpo_losses, simpo_losses
from shardfit.train.recipe import train
from tests.helpers import (
    DEMO_DATA,
    ROOT,
    load_bench,
    read_jsonl,
    run_cli,
    run_here,
    train_here,
    write_config,
    write_images,
)

USER = {"role": "user", "content": "Extract the record."}


def pairs_from_demo(path: Path, n: int, start: int = 0) -> Path:
    """`n` TRL-style pairs from the demo's rows: the record format chosen, the same facts in prose rejected."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[start:start + n]]
    out = []
    for r in rows:
        name, city, ext = (part.split("=", 1)[1] for part in r["output"].split("; "))
        out.append({"prompt": [{"role": "user", "content": f"{r['instruction']}\n\n{r['input']}"}],
                    "chosen": [{"role": "assistant", "content": r["output"]}],
                    "rejected": [{"role": "assistant", "content": f"{name} ({city}), extension {ext}"}]})
    path.write_text("".join(json.dumps(o) + "\n" for o in out))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pairs_from_demo(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 24)


BASE = dict(objective="dpo", method="lora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1,
            eval_steps=100, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, resume="never", report_to=["none"])


def _cfg(tmp_path: Path, model: Path, data: Path, name: str = "c", **over):
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp_path / f"run-{name}"))
    keys.update(over)
    return write_config(tmp_path / f"{name}.yaml", **keys)


# -- the layouts users bring ---------------------------------------------------------------------------------------
def test_trl_rows_strings_messages_and_implicit_prompt() -> None:
    p = to_pref_row({"prompt": "Q?", "chosen": "good", "rejected": "bad"})
    assert p.prompt == [{"role": "user", "content": "Q?"}] and p.chosen[0]["content"] == "good"
    assert p.rejected == [{"role": "assistant", "content": "bad"}] and p.desirable is None
    implicit = to_pref_row({"chosen": [USER, {"role": "assistant", "content": "a"}],
                            "rejected": [USER, {"role": "assistant", "content": "b"}]})
    assert implicit.prompt == [USER] and implicit.chosen[0]["content"] == "a" and implicit.rejected[0]["content"] == "b"
    assert detect_preference({"prompt": "q", "completion": "a", "label": True}) == "unpaired"
    kto = to_pref_row({"prompt": "q", "completion": "a", "label": False})
    assert kto.rejected is None and kto.desirable is False


def test_llamafactory_ranking_rows() -> None:
    sharegpt = to_pref_row({"conversations": [{"from": "human", "value": "Q?"}],
                            "chosen": {"from": "gpt", "value": "good"}, "rejected": {"from": "gpt", "value": "bad"}})
    assert sharegpt.prompt == [{"role": "user", "content": "Q?"}]
    assert sharegpt.chosen == [{"role": "assistant", "content": "good"}]
    alpaca = to_pref_row({"instruction": "Do it", "input": "now", "chosen": "ok", "rejected": "no"})
    assert alpaca.prompt == [{"role": "user", "content": "Do it\n\nnow"}] and alpaca.rejected[0]["content"] == "no"
    kto = to_pref_row({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
                       "kto_tag": True})
    assert kto.prompt == [{"role": "user", "content": "Q"}] and kto.chosen[0]["content"] == "A" and kto.desirable


def test_bad_preference_values() -> None:
    with pytest.raises(BadRow, match="label"):
        to_pref_row({"prompt": "q", "completion": "a", "label": "yes"})
    with pytest.raises(BadRow, match="same prompt"):
        to_pref_row({"chosen": "a", "rejected": "b"})


def test_bad_rows_exit_2_with_file_line(tmp_path: Path, tiny_llama: Path, pairs: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    """Each refusal through the CLI's own `main`, in this process (exit 2 and the message it prints; an unexpected
    exception would be the last guard's exit 1)."""
    def train_refused(cfg: Path) -> str:
        capsys.readouterr()
        code, err = main(["train", str(cfg)]), capsys.readouterr().err
        assert code == 2, err[-2000:]
        return err

    data = tmp_path / "mixed.jsonl"
    data.write_text(pairs.read_text().splitlines()[0] + "\n" + json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    err = train_refused(_cfg(tmp_path, tiny_llama, data))
    assert "mixed.jsonl:2" in err and "objective dpo reads" in err
    kto = tmp_path / "kto.jsonl"
    kto.write_text(pairs.read_text())
    err = train_refused(_cfg(tmp_path, tiny_llama, kto, objective="kto"))
    assert "kto.jsonl:1" in err and "objective kto reads unpaired rows" in err
    err = train_refused(_cfg(tmp_path, tiny_llama, pairs, method="full", dpo={"precompute_reference": False}))
    assert "dpo.precompute_reference" in err


# -- the losses' math ----------------------------------------------------------------------------------------------
def test_dpo_losses_against_their_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4))
    logits = (pc - pr) - (rc - rr)
    sigmoid = dpo_losses(pc, pr, rc, rr, PreferenceSettings("dpo", 0.1))[0]
    assert torch.allclose(sigmoid, torch.log1p(torch.exp(-0.1 * logits)))
    smooth = dpo_losses(pc, pr, rc, rr, PreferenceSettings("dpo", 0.1, "sigmoid", 0.2))[0]
    want = 0.8 * torch.log1p(torch.exp(-0.1 * logits)) + 0.2 * torch.log1p(torch.exp(0.1 * logits))
    assert torch.allclose(smooth, want)
    hinge = dpo_losses(pc, pr, rc, rr, PreferenceSettings("dpo", 0.5, "hinge"))[0]
    assert torch.allclose(hinge, torch.clamp(1 - 0.5 * logits, min=0))
    ipo = dpo_losses(pc, pr, rc, rr, PreferenceSettings("dpo", 0.5, "ipo"))[0]
    assert torch.allclose(ipo, (logits - 1.0) ** 2)
    loss, r_c, r_r = dpo_losses(pc, pc, pc, pc, PreferenceSettings("dpo", 0.1))
    assert torch.allclose(loss, torch.full_like(loss, math.log(2))) and not r_c.any() and not r_r.any()


def test_orpo_simpo_kto_against_their_formulas() -> None:
    avg_c, avg_r = torch.tensor([-0.5, -2.0], dtype=torch.float64), torch.tensor([-1.0, -0.7], dtype=torch.float64)
    odds = lambda a: a - torch.log1p(-torch.exp(a))  # noqa: E731 - log(p / (1 - p)) of a mean log-probability
    orpo = orpo_losses(avg_c, avg_r, PreferenceSettings("orpo", 0.1))[0]
    assert torch.allclose(orpo, -avg_c - 0.1 * F.logsigmoid(odds(avg_c) - odds(avg_r)))
    simpo = simpo_losses(avg_c, avg_r, PreferenceSettings("simpo", 2.0, simpo_gamma=0.5))[0]
    assert torch.allclose(simpo, -F.logsigmoid(2.0 * (avg_c - avg_r) - 0.5))
    p, r = torch.tensor([-1.0, -3.0, -2.0], dtype=torch.float64), torch.tensor([-2.0, -2.0, -2.0], dtype=torch.float64)
    good = torch.tensor([True, False, True])
    losses, _ = kto_losses(p, r, good, PreferenceSettings("kto", 0.1, undesirable_weight=2.0))
    kl = max(float((p - r).mean()), 0.0)
    want = [1 - torch.sigmoid(torch.tensor(0.1 * (1.0 - kl))), 2 * (1 - torch.sigmoid(torch.tensor(0.1 * (kl + 1.0)))),
            1 - torch.sigmoid(torch.tensor(0.1 * (0.0 - kl)))]
    assert torch.allclose(losses, torch.stack(want).double())


# -- runs ----------------------------------------------------------------------------------------------------------
def _train(path: Path) -> tuple[list[dict], dict]:
    result = train(load_config(path), init_distributed(), quiet=True)
    return [m for m in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in m], result.summary


def test_step0_is_ln2_and_both_references_agree(tmp_path: Path, tiny_llama: Path, pairs: Path) -> None:
    """At step 0 of a LoRA DPO run the policy is the reference: the loss is ln 2 and every margin 0. The
    reference computed once before training and the adapters switched off each step give the same run."""
    runs = {}
    for name, precompute in (("off", False), ("pre", True)):
        runs[name] = _train(_cfg(tmp_path, tiny_llama, pairs, name, max_steps=3, eval_split=0.2,
                                 dpo={"precompute_reference": precompute}))
    (off, s_off), (pre, s_pre) = runs["off"], runs["pre"]
    assert s_off["reference"] == "adapters_off" and s_pre["reference"] == "precomputed"
    assert off[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert off[0]["rewards_margin"] == 0 and off[0]["reward_accuracy"] == 0.5  # a tie counts half
    assert off[-1]["loss"] < off[0]["loss"]  # it learns: margins open
    for a, b in zip(off, pre, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                    rel=1e-4)
    assert s_off["eval_loss"] == pytest.approx(s_pre["eval_loss"], rel=1e-5)
    assert s_off["eval_reward_accuracy"] == s_pre["eval_reward_accuracy"]


@pytest.mark.parametrize("objective", ["orpo", "simpo", "kto"])
def test_other_objectives_train(tmp_path: Path, tiny_llama: Path, pairs: Path, objective: str) -> None:
    data = pairs
    if objective == "kto":  # alternate rows: the chosen answer desirable, the rejected one not
        rows = [json.loads(line) for line in pairs.read_text().splitlines()]
        data = tmp_path / "kto.jsonl"
        data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"],
                                            "label": bool(i % 2)}) + "\n" for i, r in enumerate(rows)))
    metrics, summary = _train(_cfg(tmp_path, tiny_llama, data, objective=objective, max_steps=4))
    assert summary["objective"] == objective
    assert summary["reference"] == ("adapters_off" if objective == "kto" else None)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    if objective == "kto":
        assert metrics[0]["loss"] == pytest.approx(0.5, rel=1e-6)  # 1 - sigmoid(0) for every row at step 0
    else:
        assert "reward_accuracy" in metrics[0] and "rewards_margin" in metrics[0]


def test_full_finetune_precomputes_its_reference(tmp_path: Path, tiny_llama: Path, pairs: Path) -> None:
    metrics, summary = _train(_cfg(tmp_path, tiny_llama, pairs, method="full", lr=1e-4, max_steps=2, eval_split=0.2))
    assert summary["reference"] == "precomputed" and "reference log-probabilities" in summary["startup_s"]
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert summary["eval_rewards_margin"] != 0  # the held-out pairs got the reference too


@pytest.mark.slow
@pytest.mark.parametrize("strategy,method", [pytest.param("ddp", "lora", marks=pytest.mark.heavy), ("zero3", "lora"),
                                             pytest.param("zero3", "full", marks=pytest.mark.heavy)])
def test_two_ranks_equal_one_process(tmp_path: Path, tiny_llama: Path, pairs: Path, strategy: str,
                                     method: str) -> None:
    """fp32: 2 ranks with micro_batch 2 follow the one-process run with grad_accum 2 step for step (a full
    fine-tune: the reference precomputed by both ranks sharing the pass)."""
    lr = 1e-2 if method == "lora" else 1e-4
    one = _cfg(tmp_path, tiny_llama, pairs, "one", max_steps=3, grad_accum=2, strategy="single", method=method, lr=lr)
    two = _cfg(tmp_path, tiny_llama, pairs, "two", max_steps=3, strategy=strategy, method=method, lr=lr)
    train_here(one)
    r = run_cli("train", str(two), "--nproc", "2", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (read_jsonl(tmp_path / f"run-{n}" / "metrics.jsonl") for n in ("one", "two"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "grad_norm", "logps_chosen", "logps_rejected"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=2e-6), (k, x, y)  # 6 decimals written
        for side in ("chosen", "rejected"):  # beta x a difference of two log-probabilities, each to rtol 1e-5
            tol = 0.1 * 1e-5 * 2 * abs(x[f"logps_{side}"])
            assert x[f"rewards_{side}"] == pytest.approx(y[f"rewards_{side}"], abs=tol), (side, x, y)


def test_vision_language_pairs(tmp_path: Path, tiny_vl: Path) -> None:
    """Multimodal DPO: an image in the prompt (LLaMA-Factory's `images` beside a messages history, and TRL's
    content parts), both answers after it; step 0 is ln 2 as for text."""
    write_images(tmp_path / "img", {"red": (255, 0, 0), "blue": (0, 0, 255)})
    rows = []
    for i in range(8):
        colour = ("red", "blue")[i % 2]
        other = ("blue", "red")[i % 2]
        if i % 4 < 2:
            rows.append({"messages": [{"role": "user", "content": "<image>Which colour?"}],
                         "chosen": {"role": "assistant", "content": colour},
                         "rejected": {"role": "assistant", "content": other}, "images": [f"img/{colour}.png"]})
        else:
            rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": f"img/{colour}.png"},
                                                                 {"type": "text", "text": "Which colour?"}]}],
                         "chosen": colour, "rejected": other})
    data = tmp_path / "vl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics, summary = _train(_cfg(tmp_path, tiny_vl, data, max_steps=2, max_seq_len=256))
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert summary["reference"] == "adapters_off" and metrics[-1]["loss"] != metrics[0]["loss"]


def test_eval_on_pairs_reports_reward_accuracy(tmp_path: Path, tiny_llama: Path, pairs: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    """`shardfit eval RUN --data pairs`: the base (adapters off: the reference) against the tuned model; the
    tuned model's rewards are measured against that base, as training's are."""
    _train(_cfg(tmp_path, tiny_llama, pairs, max_steps=4, lr=3e-2, eval_split=0.2, eval_steps=2))
    page = make_report([str(tmp_path / "run-c")])  # the report draws the rewards and the reward accuracy
    assert {"rewards.png", "reward_accuracy.png"} <= {p.name for p in page.parent.iterdir()}
    assert "eval_reward_accuracy" in page.read_text()
    code, out, err = run_here(capsys, "eval", str(tmp_path / "run-c"), "--data", str(pairs), "--limit", "8", "--json")
    assert code == 0, err[-2000:]
    result = json.loads(out)
    assert result["pairs"] == 8 and set(result["models"]) == {"base", "tuned"}
    tuned = result["models"]["tuned"]
    assert tuned["reward_accuracy"] > 0.5 and tuned["reward_margin"] > 0
    kto = tmp_path / "kto.jsonl"
    kto.write_text(json.dumps({"prompt": "q", "completion": "a", "label": True}) + "\n")
    code, _, err = run_here(capsys, "eval", str(tmp_path / "run-c"), "--data", str(kto))
    assert code == 2 and "kto.jsonl:1" in err


def test_qlora_dpo_starts_at_ln2(tmp_path: Path, tiny_llama: Path, pairs: Path) -> None:
    """QLoRA's reference is its NF4 base with the adapters off: the same frozen weights, no second copy."""
    pytest.importorskip("torchao")
    metrics, summary = _train(_cfg(tmp_path, tiny_llama, pairs, method="qlora", max_steps=2))
    assert summary["reference"] == "adapters_off"
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_docs_table_is_the_bench_result() -> None:
    """docs/preference.md's before/after table is bench/dpo_format.py's rendering of its last results."""
    bench = load_bench("dpo_format")
    runs = bench.results()
    block = (ROOT / "docs" / "preference.md").read_text().split(bench.BLOCK[0], 1)[1].split(bench.BLOCK[1], 1)[0]
    assert runs and block.strip() == bench.doc_table(runs).strip()
    assert all(r["after"]["reward_accuracy"] > r["before"]["reward_accuracy"] for r in runs)


def test_history_turns_are_context_not_answer(tokenizer) -> None:
    """A multi-turn prompt's earlier assistant turns carry no label: only the answer after it trains."""
    from shardfit.data.tokenize import IGNORE, encode_messages

    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
               {"role": "user", "content": "and now?"}]
    answer = [{"role": "assistant", "content": "now this"}]
    enc = encode_messages(tokenizer, history + answer, 256, label_from=len(history))
    labelled = tokenizer.decode([t for t in enc.targets if t != IGNORE])
    assert "now this" in labelled and "hello there" not in labelled
    row = to_pref_row({"chosen": history + answer, "rejected": history + [{"role": "assistant", "content": "no"}]})
    assert row.prompt == history and row.chosen == answer


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "completion": "a", "kto_tag": True}, "prompt needs"),
    ({"messages": {"role": "user"}, "chosen": "a", "rejected": "b"}, "prompt needs"),
    ({"conversations": 5, "chosen": "a", "rejected": "b"}, "prompt needs"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": 5}], "rejected": "b"}, "must be a string"),
    ({"prompt": "q", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}, "unknown role"),
])
def test_malformed_rows_are_bad_rows(tmp_path: Path, row: dict, words: str) -> None:
    from shardfit.data.dataset import DataStats
    from shardfit.data.preference import load_preferences

    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(row) + "\n")
    objective = "kto" if "kto_tag" in row else "dpo"
    with pytest.raises(UserError, match=words) as e:
        load_preferences(str(data), objective, False, DataStats(), None, {})
    assert "bad.jsonl:1" in str(e.value)


def test_sharegpt_turns_as_a_prompt() -> None:
    row = to_pref_row({"prompt": [{"from": "human", "value": "hi"}], "chosen": "a", "rejected": "b"})
    assert row.prompt == [{"role": "user", "content": "hi"}]
