"""The nulls of a file of arguments (TrlParser's `--config FILE.yaml`, HfArgumentParser's parse_yaml_file and
parse_json_file): each reaches its dataclass field as None, replacing the field's default, as neither parser
checks a default or a dict's value against the field's type. Most such Nones mean what the default means (use_peft,
packing, bf16: TRL reads None as `not fp16`), so the readers drop them; the keys here mean something else, and
`settle_nulls` plans or refuses each as the trainer takes it. The dtype keys are kbit.py's (`job_load`)."""

from __future__ import annotations

from shardfit.errors import UserError
from shardfit.foreign.keys import Source

# The keys that give hf.py's sequence length, the first one given winning.
SEQ_KEYS = ("model_max_length", "max_seq_length", "max_length", "cutoff_len", "seq_length")
# Keys whose None the Trainer, or peft, cannot run with, and what fails: the job stops before its first step.
FAILS = {"per_device_train_batch_size": "TrainingArguments.train_batch_size multiplies it by the GPU count "
                                        "(TypeError: None * int) before the first step",
         "gradient_accumulation_steps": "the Trainer multiplies the batch by it (TypeError: None * int) before the "
                                        "first step",
         "lora_r": "peft's LoraConfig(r=None) fails (TypeError) when get_peft_model builds the adapters"}
# The null keys the readers keep (the dtype's too: ModelConfig's and model_init_kwargs' None loads the checkpoint
# as transformers takes None).
NULL_KEYS = (*SEQ_KEYS, "gradient_checkpointing", *FAILS, "dtype", "torch_dtype")


def settle_nulls(src: Source, seq: int | None, notes: list[str], dtype_keys: tuple[str, ...] = ()) -> None:
    """Plan or refuse the nulls `src` kept (`src.null_at`, each key's file and line). A null dtype key counts only
    where the job reads it (`dtype_keys`: kbit.py `load_keys`, which plans it); elsewhere it is dropped as other
    nulls are, for no dataclass of the script takes it. A sequence
    length of None truncates no row (trl 1.x SFTConfig, DPOConfig, RewardConfig `max_length`: "If None, no
    truncation is applied"), which the plan cannot size: planned at `seq` (plan's --seq) with a note, else a
    UserError naming the key. A null gradient_checkpointing turns checkpointing off (transformers 5 TrainingArguments
    `__post_init__` sets None to False; 4.x tests it for truth), though TRL's configs default it to true, unless
    activation_checkpointing (5.x's name for it, which wins) is set, when it changes nothing. A null that
    makes the job fail (FAILS) is a UserError."""
    for key in [k for k in src.order if k in src.null_at and src.values.get(k) is None]:
        at = src.null_at[key]
        if key in ("dtype", "torch_dtype") and key not in dtype_keys:
            _drop(src, key)
            continue
        if key in FAILS:
            raise UserError(f"{at}: {key}: null reaches the arguments as None, and {FAILS[key]}, so the job never "
                            f"trains. Give it a number, or remove the key for its default.")
        if key == "gradient_checkpointing" and src.get("activation_checkpointing") is not None:
            _drop(src, key)  # read only where its new name is None (transformers 5.x `__post_init__`)
            continue
        if key == "gradient_checkpointing":
            src.values[key] = "false"
            notes.append(f"{at}: gradient_checkpointing: null reaches TrainingArguments as None, which turns "
                         f"checkpointing off (TRL's configs default it to true only where the key is absent): "
                         f"planned without checkpointing")
            continue
        if key not in SEQ_KEYS:
            continue
        _drop(src, key)
        if any(src.get(k) is not None for k in SEQ_KEYS):
            continue  # another key gives the length the plan reads
        if seq is None:
            raise UserError(f"{at}: {key}: null truncates no row (TRL's SFTConfig, DPOConfig and RewardConfig take "
                            f"None as no truncation, trl 1.x), so each row trains at its full length, which the "
                            f"plan cannot know. Give --seq N (the longest row's tokens) to plan at that length, or "
                            f"set {key} to a number.")
        notes.append(f"{at}: {key}: null truncates no row (trl 1.x: no truncation), so each row trains at its full "
                     f"length: planned at --seq {seq}, as given (rows longer than that need more memory)")


def _drop(src: Source, key: str) -> None:
    """Forget the null `key`, as if the file had left it out."""
    src.values.pop(key)
    src.order.remove(key)
    src.null_at.pop(key)
