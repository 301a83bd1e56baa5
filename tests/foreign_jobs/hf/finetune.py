# A user's copy of Qwen's finetune.py, edited to spread the 7B model over the GPUs (the shape of the script only:
# shardfit reads its from_pretrained call, it never runs it).
import transformers


def train(model_args, training_args):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        cache_dir=training_args.cache_dir,
        device_map="auto",
        trust_remote_code=True,
    )
    return model
