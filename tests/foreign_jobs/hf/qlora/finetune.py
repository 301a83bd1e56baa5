# The device placement of Qwen's finetune.py (shape only; shardfit reads it, never runs it).
import os

import transformers


def load(model_args, training_args, lora_args):
    device_map = None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    ddp = world_size != 1
    if lora_args.q_lora:
        device_map = {"": int(os.environ.get("LOCAL_RANK") or 0)} if ddp else "auto"
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, device_map=device_map, trust_remote_code=True)
