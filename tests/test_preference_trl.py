"""shardfit's DPO against TRL's DPOTrainer (issue 44): on the same rows, model and LoRA, the first step's sigmoid loss
and every adapter gradient agree. Skipped without TRL (the optional `bench` extra; `make bench` installs it).

shardfit runs as a user's run does (`train` with max_steps 1: data read from a TRL-format file, its tokenisation,
packing, the adapters-off reference, the loss normalised per pair); the gradients are caught as backward
accumulates them, before clipping and the optimizer step. TRL runs `DPOTrainer.compute_loss` on the batch its own
collator makes of its own tokenisation, then backward. The token ids of both are compared first, so a gradient
mismatch can only come from the loss."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from shardfit.config import load_config
from shardfit.data.preference import encode_preference_split, read_preference_split
from shardfit.data.tokenize import IGNORE
from shardfit.models.build import build_model, load_tokenizer
from shardfit.models.source import resolve_model
from shardfit.parallel.env import init_distributed
from shardfit.train.recipe import train
from tests.helpers import DEMO_DATA, ROOT, read_jsonl, write_config

trl = pytest.importorskip("trl")

N_PAIRS, BETA, RANK, ALPHA, MAX_LEN = 4, 0.1, 4, 8, 128


def _pairs(n: int) -> list[dict]:
    """The first `n` demo notes as the DPO bench's conversational TRL rows (bench/dpo_vs_trl.py `pair_row`): the
    record as the demo writes it chosen, the same facts in another layout rejected."""
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", ROOT / "bench" / "dpo_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return [bench.pair_row(json.loads(line)) for line in DEMO_DATA.read_text().splitlines()[:n]]


def _shardfit_config(tmp_path: Path, model: Path, data: Path):  # noqa: ANN202 - a shardfit Config
    return load_config(write_config(
        tmp_path / "dpo.yaml", model=str(model), data=str(data), objective="dpo",
        dpo={"beta": BETA, "loss": "sigmoid"}, method="lora",
        lora={"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": "all-linear"}, precision="fp32",
        max_seq_len=MAX_LEN, micro_batch=N_PAIRS, max_steps=1, lr=1e-3, warmup_ratio=0.0, log_steps=1,
        output_dir=str(tmp_path / "run"), resume="never", report_to=["none"]))


def _trl_trainer(tmp_path: Path, model_dir: Path, rows: list[dict]):  # noqa: ANN202 - a trl.DPOTrainer
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=["sigmoid"], max_length=MAX_LEN,
                         per_device_train_batch_size=N_PAIRS, bf16=False, fp16=False, use_cpu=True,
                         gradient_checkpointing=False, report_to=[], disable_tqdm=True, seed=42)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    return trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=lora)


def _lora(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _same_token_ids(cfg, trainer) -> None:  # noqa: ANN001
    """Each pair's sides are the same token ids, with the same answer tokens labelled, on both sides."""
    tok = load_tokenizer(resolve_model(cfg.model))
    split = read_preference_split(cfg)
    pairs, _ = encode_preference_split(cfg, tok, split)
    assert len(pairs) == len(trainer.train_dataset) == N_PAIRS
    for pair, ex in zip(pairs, trainer.train_dataset, strict=True):
        for enc, answer in ((pair.chosen, ex["chosen_ids"]), (pair.rejected, ex["rejected_ids"])):
            assert enc.input_ids == ex["prompt_ids"] + answer
            # shardfit's targets are shifted (position t predicts token t+1); TRL masks the answer's tokens.
            labelled = [t + 1 for t, y in enumerate(enc.targets) if y != IGNORE]
            assert labelled == list(range(len(ex["prompt_ids"]), len(enc.input_ids)))


@pytest.mark.parametrize("adapters", ["fresh", "moved"])
def test_dpo_first_step_matches_trl(tmp_path: Path, tiny_llama: Path, adapters: str) -> None:
    """`fresh`: the adapters as initialised (B = 0: the policy is the reference, the loss ln 2, and only B has a
    gradient). `moved`: B set to small random values on both sides, so the policy differs from the reference and A's
    gradients are compared too."""
    rows = _pairs(N_PAIRS)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _shardfit_config(tmp_path, tiny_llama, data)
    trainer = _trl_trainer(tmp_path, tiny_llama, rows)
    _same_token_ids(cfg, trainer)

    model = build_model(cfg, "single", weights=True)
    ours = _lora(model)
    if adapters == "moved":
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in ours.items():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    start = {n: p.detach().clone() for n, p in ours.items()}
    grads: dict[str, torch.Tensor] = {}
    for n, p in ours.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone()))
    result = train(cfg, init_distributed(), model=model, quiet=True)
    first = next(m for m in read_jsonl(result.run_dir / "metrics.jsonl") if m.get("step") == 1)

    theirs = _lora(trainer.model)
    assert set(theirs) == set(start)
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(start[n])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(N_PAIRS)])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()

    assert first["loss"] == pytest.approx(loss.item(), rel=1e-4)
    if adapters == "fresh":
        assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert set(grads) == set(theirs)
    compared = 0
    for n, p in theirs.items():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        compared += bool(p.grad.abs().max() > 0)
    # The comparison is not of zeros: B always has a gradient, A once B is not zero.
    assert compared == (len(theirs) if adapters == "moved" else len(theirs) // 2)
