"""A run that runs out of memory ends as an expected failure (exit 1): what ran out and where, the plan's figure,
what the plan knows to fit instead; and `diagnose` on that log quotes shardfit's own prediction.

The out-of-memory is real: `force: true` starts a job the plan refuses (eager attention of a 32-head model over
4,000-token rows, 4 to a micro-batch: one layer's scores are an 8 GiB tensor), and the process runs under an
RLIMIT_DATA of 3 GiB, so the allocator's request fails at once as it would on a machine without the RAM, and
nothing of this shared machine is touched."""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from shardfit.diagnose.engine import analyze
from shardfit.plan.hardware import Hardware
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.train.oom import ran_out
from tests.helpers import save_with_tokenizer, write_config

LIMIT = 3 * 2**30


def _limited() -> None:  # runs in the child before exec: its data segment (heap, anonymous maps) is capped
    resource.setrlimit(resource.RLIMIT_DATA, (LIMIT, LIMIT))


def _many_heads(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny Llama with 16 attention heads: its eager attention scores are 16 times its mask."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return save_with_tokenizer(AutoModelForCausalLM.from_config(config), out, tokenizer_dir)


def _long_rows(path: Path, rows: int = 4, words: int = 4000) -> Path:
    rng = random.Random(0)
    vocab = ["alpha", "river", "stone", "cloud", "ember", "north", "quiet", "amber", "field", "light"]
    with path.open("w") as f:
        for _ in range(rows):
            text = " ".join(rng.choice(vocab) for _ in range(words))
            f.write(json.dumps({"instruction": "Repeat the text.", "input": text, "output": "ok"}) + "\n")
    return path


def test_forced_oom_exits_1_with_what_ran_out_and_what_fits(tmp_path: Path, tokenizer_dir: Path) -> None:
    model = _many_heads(tmp_path / "model", tokenizer_dir)
    cfg = write_config(tmp_path / "oom.yaml", model=str(model), data=str(_long_rows(tmp_path / "long.jsonl")),
                       method="lora", precision="fp32", max_seq_len=8192, micro_batch=4, grad_ckpt="none",
                       attn_implementation="eager", max_steps=2, eval_split=0.0, force=True, report_to=["none"],
                       output_dir=str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-m", "shardfit", "train", str(cfg)], capture_output=True, text=True,
                       timeout=300, preexec_fn=_limited, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    err = r.stderr
    assert r.returncode == 1, err[-3000:]
    assert "unexpected" not in err and "This is a bug" not in err and "Traceback" not in err, err[-3000:]
    assert "predicted_oom" in err  # force: the plan's refusal became a warning
    line = err[err.index("shardfit: error: out of memory"):]
    assert "host RAM ran out in step 1 (forward)" in line and "GiB allocation failed" in line, line
    assert "The plan predicted" in line and "largest part: activations" in line, line
    assert "force: true started it anyway" in line, line
    # fp32 eager attention keeps its probabilities once and peaks at three times that in the last block's backward
    # (measured: plan/eager_scores.py), so micro-batch 1 alone fits by the plan
    assert "What fits instead, by the plan:" in line and "--set micro_batch=1 --set grad_accum=4" in line, line
    assert "No checkpoint was written" in line, line

    # diagnose on that log: an out-of-memory, and shardfit's own prediction quoted first.
    a = analyze(r.stdout + err)
    assert a.findings[0].category == "shardfit_predicted_oom", a.scores
    assert "The log says: predicted_oom: predicted" in a.findings[0].root_cause
    assert "largest part: activations" in a.findings[0].root_cause


def test_what_ran_out() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    try:
        torch.empty(2**62, dtype=torch.uint8)  # more than any address space: the CPU allocator refuses it
    except RuntimeError as e:
        assert ran_out(e, cpu) == "host RAM"
    assert ran_out(MemoryError(), cpu) == "host RAM"
    assert ran_out(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), gpu) == \
        "GPU memory (cuda:0)"
    assert ran_out(RuntimeError("shape mismatch"), cpu) is None
    assert ran_out(KeyError("x"), cpu) is None


def test_refusal_names_the_largest_part_and_no_time_for_rows_that_cannot_run() -> None:
    """Item 3: a replica that does not fit because of its activations says so, not 'full replica'; its row in
    the table shows no step time or tokens/s."""
    from shardfit.plan.render import format_table

    shape = resolve_shape("Qwen/Qwen2.5-1.5B")
    plan = make_plan(shape, Workload(method="lora", seq_len=8192, micro_batch=4, grad_ckpt="none"),
                     Hardware(1, 2, 24.0, name="4090"))
    single = plan.candidate("single")
    assert not single.fits and "largest part: activations" in single.notes and "gradient checkpointing" in single.notes
    row = next(line for line in format_table(plan).splitlines() if line.startswith("single "))
    cells = row.split()
    assert "NO" in cells and cells[cells.index("NO") + 1:cells.index("NO") + 4] == ["-", "-", "-"], row
