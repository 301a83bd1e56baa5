# A user's LoRA script for the HF Trainer, run as `python train.py` with no arguments: everything is set in code.
# shardfit reads it as text (ast); the two lines below would stop it, or leave a file behind, if it were ever run.
import pathlib
import sys

pathlib.Path(sys.argv[0]).with_suffix(".executed").write_text("this script was run")
raise SystemExit("shardfit must never run a training script")

from datasets import load_dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments  # noqa: E402
from trl import SFTTrainer  # noqa: E402

MODEL = "Qwen/Qwen2.5-7B-Instruct"
MAX_LEN = 1024

tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype="bfloat16")
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=8,
                         gradient_checkpointing=True, bf16=True, learning_rate=2e-4, num_train_epochs=2,
                         lr_scheduler_type="cosine", logging_steps=10)
data = load_dataset("json", data_files="reviews.jsonl")["train"]
trainer = SFTTrainer(model=model, args=args, train_dataset=data, max_seq_length=MAX_LEN, processing_class=tokenizer)
trainer.train()
