"""The one evaluator every peer's result goes through: the same held-out rows, the same code, mean token loss.

    python bench/evaluator.py --config cfg.json --dirs RUN_A/adapter RUN_B/model --result out.json

Each directory is what a run saved: a PEFT adapter (adapter_config.json; its base is the config's model folder) or
a full Hugging Face model folder. The held-out rows are tokenised by shardfit's data code from the workload's
config; the loss is the summed cross-entropy of every target token over the number of target tokens (prompt
tokens masked), one example at a time in fp32, so padding and batching cannot change it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

IGNORE = -100


def mean_token_loss(parts: Iterable[tuple[float, int]]) -> float:
    """Mean loss per target token from (summed loss, target tokens) per example: every token weighs the same,
    however the tokens are spread over examples. NaN when there is no target token at all."""
    total, n = 0.0, 0
    for loss_sum, count in parts:
        if count < 0:
            raise ValueError(f"negative token count {count}")
        total, n = total + loss_sum, n + count
    return total / n if n else float("nan")


def example_loss(model, input_ids: list[int], targets: list[int]) -> tuple[float, int]:  # noqa: ANN001 - any LM
    """Summed cross-entropy over an example's target tokens and how many there are (`targets` already shifted:
    targets[t] is what position t predicts, IGNORE where nothing is)."""
    import torch
    import torch.nn.functional as F

    ids = torch.tensor([input_ids])
    tgt = torch.tensor(targets)
    logits = model(input_ids=ids).logits[0].float()
    loss = F.cross_entropy(logits, tgt, ignore_index=IGNORE, reduction="sum")
    return float(loss), int((tgt != IGNORE).sum())


def load_saved(path: Path, base: str):  # noqa: ANN201 - a transformers model
    """A saved run output as an fp32 model in eval mode: a PEFT adapter on `base`, or a full model folder."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "adapter_config.json").is_file():
        from peft import PeftModel  # only adapters need peft

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def evaluate(dirs: list[Path], cfg: dict) -> list[float]:
    """Mean held-out token loss of each saved run output, on the held-out rows of the workload config `cfg`."""
    import torch
    from workloads import tokenized

    _, held, _ = tokenized(dict(cfg, eval_data=cfg["eval_data"]))
    out = []
    with torch.no_grad():
        for d in dirs:
            model = load_saved(d, cfg["model"])
            out.append(mean_token_loss(example_loss(model, ex.input_ids, ex.targets) for ex in held))
            del model
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the workload's user config as JSON (with eval_data)")
    p.add_argument("--dirs", nargs="+", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    losses = evaluate([Path(d) for d in args.dirs], cfg)
    Path(args.result).write_text(json.dumps(dict(zip(args.dirs, losses, strict=True))))


if __name__ == "__main__":
    main()
