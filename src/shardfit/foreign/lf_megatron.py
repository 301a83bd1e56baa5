"""LLaMA-Factory's Megatron YAMLs (`USE_MCA=1` through mcore_adapter, `USE_MEGATRON_BRIDGE=1` through
Megatron-Bridge): Megatron-LM's tensor, pipeline, context and expert parallelism, not the HF Trainer the
LLaMA-Factory readers model. They are refused with the `shardfit plan` command of the same split."""

from __future__ import annotations

import math

from shardfit.errors import UserError
from shardfit.foreign.common import as_int
from shardfit.foreign.keys import Source, count
from shardfit.plan.hardware import Hardware

# Megatron's split sizes, with the plan flag of each (tensor parallelism has none: it is not planned).
SPLIT = {"tensor_model_parallel_size": "", "pipeline_model_parallel_size": "--pipeline-parallel",
         "context_parallel_size": "--sequence-parallel", "expert_model_parallel_size": "--expert-parallel"}
# Keys only the Megatron trainers read (megatron_bridge_args.py, mcore_adapter's TrainingArguments).
MEGATRON_ONLY = {"virtual_pipeline_model_parallel_size", "use_distributed_optimizer", "overlap_grad_reduce",
                 "overlap_param_gather", "moe_grouped_gemm", "moe_token_dispatcher_type", "recompute_granularity",
                 "bias_activation_fusion", "apply_rope_fusion", "megatron_pretrained_checkpoint"}
METHODS = {"lora": "lora", "oft": "lora", "full": "full", "freeze": "freeze"}
GPUS_PER_NODE = 8


def is_megatron(top: dict) -> bool:
    """Whether a LLaMA-Factory YAML is one for its Megatron trainers."""
    return bool((set(SPLIT) | MEGATRON_ONLY) & set(top))


def refuse_megatron(src: Source, nproc: int | None, hw: Hardware | None = None) -> UserError:
    """The error for a Megatron YAML: what it is, and the `shardfit plan` of the same pipeline, row and expert
    split on the YAML's length, batch and accumulation. Its ranks: `nproc` a node, else the GPUs of `hw` (--gpus),
    else the fewest the split needs; its card that of `hw` (H100 when not given)."""
    sizes = {k: count(src.get(k, 1), k, src.at(k)) for k in SPLIT}
    tp, pp = sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"]
    cp, ep = sizes["context_parallel_size"], sizes["expert_model_parallel_size"]
    least = tp * pp * math.lcm(cp, ep)  # Megatron's dense and expert groups both tile the ranks
    if hw is not None:
        per_node, nodes = nproc or hw.gpus_per_node, hw.nodes
        if (per_node * nodes) % least:
            raise UserError(f"{src.where}: the split ({', '.join(f'{k} {v}' for k, v in sizes.items() if v > 1)}) "
                            f"needs a multiple of {least} GPUs; {per_node * nodes} ranks do not tile it. Launch a "
                            f"multiple of {least} (--nproc, --gpus).")
        gpus = f"{per_node}x{hw.name}" + (f" --nodes {nodes}" if nodes > 1 else "")
        world = per_node * nodes
    else:
        world = nproc or least
        nodes = world // GPUS_PER_NODE if world > GPUS_PER_NODE and world % GPUS_PER_NODE == 0 else 1
        gpus = f"{world // nodes}xH100" + (f" --nodes {nodes}" if nodes > 1 else "")
    ft = str(src.get("finetuning_type", "lora")).lower()
    method = METHODS.get(ft, "full")
    recompute = str(src.get("recompute_granularity") or "none").lower()
    ckpt = recompute if recompute in ("full", "selective") else "none"  # Megatron recomputes nothing unless told
    flags = "".join(f" {flag} {sizes[k]}" for k, flag in SPLIT.items() if flag and sizes[k] > 1)
    seq = as_int(src.get("cutoff_len", 2048), "cutoff_len", src.at("cutoff_len"))
    batch = as_int(src.get("per_device_train_batch_size", 1), "per_device_train_batch_size",
                   src.at("per_device_train_batch_size"))
    accum = as_int(src.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps",
                   src.at("gradient_accumulation_steps"))
    model = src.get("model_name_or_path") or "MODEL"
    given = ", ".join(f"{k} {sizes[k]}" for k in SPLIT if k in src)
    command = (f"shardfit plan --model {model} --gpus {gpus} --method {method}{flags} --seq {seq} --batch {batch} "
               f"--grad-accum {accum} --grad-ckpt {ckpt}")
    said = ("--nproc" if nproc else "--gpus" if hw is not None else "the fewest the split needs") + \
        ("" if hw is not None else "; H100: name your card with --gpus")
    tp_note = (f"; tensor parallelism is not planned: its {tp} ranks are planned as data-parallel ones"
               if tp > 1 else "")
    return UserError(f"{src.where}: a LLaMA-Factory Megatron YAML (USE_MCA=1 or USE_MEGATRON_BRIDGE=1"
                     f"{': ' + given if given else ''}), which --from llamafactory does not read (it reads the "
                     f"HF-Trainer YAML and v1 configs). Plan the same split with `{command}` ({world} GPU(s): "
                     f"{said}){tp_note}.")
