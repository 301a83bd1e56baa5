# GLM-4 LoRA fine-tune split over the visible GPUs with a device map (one process).
from transformers import AutoModelForCausalLM


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, device_map="auto",
                                                torch_dtype="bfloat16")
