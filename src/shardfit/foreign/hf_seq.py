"""The sequence length an HF Trainer job trains at, where its arguments do not name it by one of the Trainer's or
TRL's keys (arg_nulls.py `SEQ_KEYS`): a known script's own argument (transformers' run_clm.py `--block_size`), and
the one note that says what the plan took where nothing gives it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardfit.foreign.arg_nulls import SEQ_KEYS
from shardfit.foreign.common import nodes_words
from shardfit.foreign.keys import Source

if TYPE_CHECKING:
    from shardfit.foreign.accelerate import Accelerate

# Scripts whose own argument is the sequence length: transformers' examples/pytorch/language-modeling/run_clm.py
# cuts the concatenated text into blocks of `--block_size` tokens (capped at the tokenizer's model_max_length).
KNOWN_SEQ = {"run_clm.py": "block_size"}
# Every such argument, read as a sequence length only for its own script (`unread_seq_keys`).
SCRIPT_SEQ_KEYS = tuple(sorted(set(KNOWN_SEQ.values())))
ALL_SEQ_KEYS = (*SEQ_KEYS, *SCRIPT_SEQ_KEYS)


def plan_words(launcher: str | None, src: Source, launched: Accelerate | None = None,
               model_config: bool = False) -> dict[str, str]:
    """How the command line sets its sequence length, nodes and LoRA, for the plan's suggestions (job.py `Words`):
    the length argument it gives (`--max_length`), else plan's --seq, which `plan --from hf` takes where the
    arguments name none; its launcher's node count (common.py `nodes_words`: whether the accelerate launch
    `launched` builds DeepSpeed or FSDP); TRL's ModelConfig's --use_peft (and --load_in_4bit) where the script
    parses it (`model_config`), as --use_lora and --q_lora are other scripts' flags, which TRL's parser lacks."""
    key = next((k for k in ALL_SEQ_KEYS if k in src), None)
    plugin = launched is not None and bool(launched.fsdp or launched.deepspeed or launched.deepspeed_file)
    peft = {"lora": "--use_peft", "qlora": "--use_peft --load_in_4bit"} if model_config else {}
    return {"seq": f"--{key}" if key else "--seq", "nodes": nodes_words(launcher, plugin), **peft}


def unread_seq_keys(src: Source, program: str) -> dict[str, str]:
    """Take out of `src` the script sequence keys (SCRIPT_SEQ_KEYS) that `program` does not read as one (another
    script's --block_size may mean anything): returned, key to value, to be filed as not modelled."""
    mine = KNOWN_SEQ.get(Path(program).name)
    out = {}
    for key in SCRIPT_SEQ_KEYS:
        if key != mine and key in src.values:
            out[key] = str(src.values.pop(key))
            src.order.remove(key)
    return out


def seq_note(src: Source, program: str, seq: int | None, notes: list[str]) -> None:
    """Say the length planned where the arguments give none: --seq where given (unless the note of a null length
    says it already, arg_nulls.py `settle_nulls`), else 2048; run_clm.py's own default said as it is."""
    if any(k in src for k in ALL_SEQ_KEYS):
        return
    if seq is not None:
        if not any(f"planned at --seq {seq}" in n for n in notes):
            notes.append(f"no sequence length among the arguments: planned at --seq {seq}, as given")
        return
    if KNOWN_SEQ.get(Path(program).name) == "block_size":
        notes.append("run_clm.py without --block_size trains blocks of the tokenizer's model_max_length, or of "
                     "1024 tokens where that exceeds the model's max_position_embeddings: planned at 2048 tokens "
                     "(pass --seq, or --block_size)")
        return
    notes.append("no sequence length among the arguments: planned at 2048 tokens (pass --seq)")
