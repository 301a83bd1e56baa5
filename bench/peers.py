"""The peers shardfit is compared with, each run in its own process by bench/compare.py:

    hf_trainer       transformers' Trainer + peft, padding to the longest row of each batch (DataCollatorForSeq2Seq)
    trl_sft          TRL's SFTTrainer, packing=True (its default packing strategy and loss for the installed version)
    deepspeed_zero3  the Trainer with a DeepSpeed ZeRO-3 config, one process per rank under torchrun, gloo
    deepspeed_zero2  the same with ZeRO-2

Every peer trains on the same token ids (shardfit's tokenisation of the workload's data: chat template, prompt
masked), with the same model folder, LoRA rank/alpha on all linear layers, lr, cosine schedule with 5% warmup,
AdamW without weight decay, clipping at 1.0, seed and epochs. What differs is only what the peer does by default
(the Trainer keeps transformers' SDPA attention and eager mode; TRL its own defaults, gradient checkpointing
included). The run saves its adapter or model with the peer's own save call, for the shared evaluator.

    python bench/peers.py --peer hf_trainer --config cfg.json --batch 4 --result out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

PEERS = ("hf_trainer", "trl_sft", "deepspeed_zero3", "deepspeed_zero2")
IGNORE = -100


def rows_per_step(examples_per_step: float, n_examples: int, n_rows: int) -> int:
    """Packed rows per step that hold `examples_per_step` examples on average, when `n_examples` pack into
    `n_rows` rows (at least one row)."""
    return max(1, round(examples_per_step * n_rows / max(n_examples, 1)))


def deepspeed_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed JSON a Trainer user writes for ZeRO `stage` ("auto" lets the Trainer fill in batch, clipping
    and precision, bf16 or not, from its own arguments). Bucket sizes are scaled to a small model, as in
    bench/deepspeed_memory.py; the full weights are gathered at save time so the evaluator can load them."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": 2e6, "allgather_bucket_size": 2e6}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": 1e6, "stage3_param_persistence_threshold": 1e4,
                     "stage3_max_live_parameters": 1e9, "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": False},
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "zero_optimization": zero}


def _lora_config(cfg: dict):  # noqa: ANN202 - peft.LoraConfig
    from peft import LoraConfig

    lora = cfg["lora"]
    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def _common_args(cfg: dict, batch: int, out: Path) -> dict[str, Any]:
    """TrainingArguments shared by every peer: the workload's schedule and optimizer on the GPU where there is one,
    else on the CPU (with DeepSpeed too: without use_cpu accelerate finds no device backend and counts one
    process), no saving or logging during training. Precision: the config's `precision` when it names one (bf16:
    the Trainer's bf16 autocast), else the peer's own default (the Trainer: fp32; TRL's SFTConfig: bf16)."""
    import torch

    args = dict(output_dir=str(out / "trainer"), per_device_train_batch_size=batch,
                gradient_accumulation_steps=cfg["grad_accum"], learning_rate=cfg["lr"], lr_scheduler_type="cosine",
                warmup_steps=0.05, num_train_epochs=cfg["epochs"], logging_steps=10**6,
                save_strategy="no", report_to=[], seed=cfg["seed"], dataloader_num_workers=0, max_grad_norm=1.0,
                weight_decay=0.0, optim="adamw_torch", disable_tqdm=True,
                use_cpu=not torch.cuda.is_available())
    if cfg.get("precision") in ("bf16", "fp32"):
        args.update(bf16=cfg["precision"] == "bf16", fp16=False)
    return args


def _model_dtype(cfg: dict, bf16: bool):  # noqa: ANN202 - a torch dtype
    """The dtype the peer loads the model in: fp32 (the folder's own dtype, transformers' default "auto"), except
    for LoRA under bf16 autocast, where a user loads the frozen base in bf16 as LLaMA-Factory does (peft keeps the
    adapters in fp32)."""
    import torch

    return torch.bfloat16 if bf16 and cfg["method"] == "lora" else torch.float32


def _rows(train: list) -> list[dict]:
    # The Trainer shifts labels itself: label t is token t, and position t-1 predicts it.
    return [{"input_ids": ex.input_ids, "attention_mask": [1] * len(ex.input_ids),
             "labels": [IGNORE] + ex.targets[:-1]} for ex in train]


def run_peer(peer: str, cfg: dict, batch: int, out: Path) -> dict:
    """Train one peer on the workload config `cfg` with `batch` rows per device per micro-step (packed rows for
    TRL); returns this rank's measurements (`peak_mem_gib`: allocated on a GPU, as shardfit's summary counts it;
    the resident set on a CPU)."""
    from transformers import AutoModelForCausalLM
    from workloads import tokenized

    from shardfit.train.metrics import peak_mem_gib

    train, _, tok = tokenized(dict(cfg, eval_data=None))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lora = cfg["method"] == "lora"
    rows = _rows(train)
    extra: dict[str, Any] = {}
    if peer == "trl_sft":
        import datasets
        from trl import SFTConfig, SFTTrainer

        ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
        args = SFTConfig(**_common_args(cfg, batch, out), packing=True, max_length=cfg["max_seq_len"])
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=_model_dtype(cfg, bool(args.bf16)))
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                             peft_config=_lora_config(cfg) if lora else None)
        extra.update(packed_rows=len(trainer.train_dataset), trl_loss_type=args.loss_type,
                     trl_packing_strategy=args.packing_strategy,
                     trl_gradient_checkpointing=args.gradient_checkpointing)
    else:
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        kw = _common_args(cfg, batch, out)
        if peer.startswith("deepspeed_"):
            kw["deepspeed"] = deepspeed_config(int(peer[-1]))
        args = TrainingArguments(**kw)  # before the model: under ZeRO-3 it makes from_pretrained partition
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=_model_dtype(cfg, bool(args.bf16)))
        if lora:
            from peft import get_peft_model

            model = get_peft_model(model, _lora_config(cfg))
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          data_collator=DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=IGNORE))
    # What the Trainer itself set up: on a CPU the DeepSpeed path needs use_cpu, or accelerate sees one process
    # and every rank trains on all the data.
    extra.update(trainer_world=trainer.args.world_size, distributed_type=str(trainer.accelerator.distributed_type),
                 precision="bf16" if trainer.args.bf16 else "fp32")
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainer.save_model(str(out / ("adapter" if lora else "model")))
    return {"peer": peer, "rank": int(os.environ.get("RANK", "0")), "world": world, "train_s": train_s,
            "steps": trainer.state.global_step, "examples": len(rows),
            "tokens": sum(len(r["input_ids"]) for r in rows) * cfg["epochs"], "batch_per_device": batch,
            "peak_mem_gib": peak_mem_gib(trainer.args.device), **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=PEERS, required=True)
    p.add_argument("--config", required=True, help="the workload's user config as JSON")
    p.add_argument("--batch", type=int, required=True, help="rows per device per micro-step (packed rows for TRL)")
    p.add_argument("--result", required=True, help="JSON file; under torchrun each rank writes RESULT.rankN")
    args = p.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    out = Path(cfg["output_dir"])
    res = run_peer(args.peer, cfg, args.batch, out)
    world = res["world"]
    path = Path(args.result) if world == 1 else Path(f"{args.result}.rank{res['rank']}")
    path.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
