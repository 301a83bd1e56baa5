"""The planner's activation and loss terms against what autograd and a real step really keep."""


from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.models.checkpointing import enable_hf_checkpointing
from shardfit.plan.activations import FULL_LOSS_BYTES, activation_bytes
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.workload import Workload
from shardfit.simulate.step import packed_positions
from shardfit.simulate.tracker import skip_frozen_grad_hooks
from shardfit.train.loss import CausalLMLoss
from tests.helpers import saved_tensor_bytes

# A vocabulary unlike every size of the cases (tokens per micro-batch 512, hidden 256, MLP 704): a per-block term
# counted over the vocabulary where the tokens belong would then show. The loss's tensors, the only ones it sizes,
# are the same at four and two blocks and cancel out of the per-block difference.
VOCAB = 384


def _saved_bytes_per_token(arch: str, method: str, grad_ckpt: str, layers: int, seq: int = 256,
                           attention: str = "sdpa", autocast: bool = True) -> float:
    """Bytes autograd keeps for backward after one forward of the training module (saved-tensor hooks; weights
    themselves excluded), per token: the quantity the analytic activation estimate models."""

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    # flash: what flash-attention saves, as SDPA saves it over rows of one unpadded example (no mask built).
    # A small vocabulary: the loss keeps the same tensors whatever the block count, so it drops out of the per-block
    # difference, and its head matmul (16-bit on a CPU: slow) was most of a case's time at 4096.
    config = cls(hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, tie_word_embeddings=False,
                 attn_implementation="sdpa" if attention == "flash" else attention)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
    if not autocast:  # as FSDP2's MixedPrecisionPolicy runs it: 16-bit parameters, adapters included
        model.to(torch.bfloat16)
    if grad_ckpt == "full":
        enable_hf_checkpointing(model)
    module = CausalLMLoss(model, all_labelled=True)
    ids = torch.randint(0, VOCAB, (2, seq))
    positions = None if attention == "flash" else packed_positions(2, seq)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return saved_tensor_bytes(module, lambda: module(ids, positions, ids)) / (2 * seq)


@pytest.mark.parametrize(("arch", "method", "grad_ckpt", "attention", "strategy"), [
    (arch, method, ckpt, "sdpa", "single") for arch in ("llama", "qwen2") for method in ("lora", "full")
    for ckpt in ("none", "full")] + [("llama", "lora", "none", "eager", "single"),
                                     ("qwen2", "full", "none", "eager", "single"),
                                     ("llama", "lora", "none", "flash", "single"),
                                     ("qwen2", "full", "full", "flash", "single"),
                                     ("llama", "lora", "none", "sdpa", "zero3"),
                                     ("qwen2", "lora", "none", "flash", "zero3"),
                                     ("qwen2", "full", "none", "sdpa", "zero3"),
                                     ("qwen3", "lora", "none", "sdpa", "single"),
                                     ("qwen3", "full", "none", "sdpa", "single"),
                                     ("qwen3", "lora", "full", "flash", "single"),
                                     ("qwen3", "full", "none", "flash", "zero3")])
def test_activation_estimate_matches_saved_tensors(arch: str, method: str, grad_ckpt: str, attention: str,
                                                   strategy: str) -> None:
    """Per decoder block, what the analytic estimate counts equals what autograd really saves, within 5%: under
    autocast (single, ddp) and with 16-bit parameters and no autocast (FSDP2's mixed precision); over packed rows
    (sdpa, eager: a block-diagonal mask) and rows of one example (flash: no mask); Qwen3's q and k norms keep their
    fp32 inputs (and, in a full fine-tune, their outputs)."""
    autocast = strategy == "single"
    per_block = _saved_bytes_per_token(arch, method, grad_ckpt, 4, attention=attention, autocast=autocast) - \
        _saved_bytes_per_token(arch, method, grad_ckpt, 2, attention=attention, autocast=autocast)
    shape = ModelShape(f"tiny-{arch}", 2, 256, 704, 8, 2, VOCAB, False, 32, qk_norm=64 if arch == "qwen3" else 0)
    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=8,
                 attention=attention)
    tokens = 512
    # One block more: what each block saves. The block alive at a time adds its own once (checkpointing's recomputed
    # block, and eager attention's scores at their peak above the saved ones), not per block.
    predicted = (activation_bytes(shape, w, 2, strategy) - activation_bytes(shape, w, 1, strategy)) / tokens
    assert predicted == pytest.approx(per_block / 2, rel=0.05)


def test_selective_checkpointing_keeps_between_full_and_none() -> None:
    """What a selectively checkpointed block keeps lies between a fully checkpointed block's input and everything
    autograd saves without checkpointing, for full and LoRA fine-tunes."""
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    for method in ("full", "lora"):
        kept = {ckpt: activation_bytes(shape, Workload(method=method, seq_len=4096, grad_ckpt=ckpt), shape.layers)
                for ckpt in ("none", "selective", "full")}
        assert kept["full"] < kept["selective"] < kept["none"], method


def test_full_logits_loss_bytes_match_a_real_step() -> None:
    """`--loss full` charges FULL_LOSS_BYTES per logit element: what transformers' own loss really holds at its
    peak (fp32 log-softmax and gradients; the model output is dropped before backward, as the Trainer does),
    measured on a real step of a model whose logits dwarf everything else."""

    tokens, vocab = 512, 32768
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(p is model.model.norm.weight)  # a gradient must reach the logits, nothing else of size
    ids = torch.randint(0, vocab, (1, tokens))
    tracker = MemTracker()
    tracker.track_external(model)
    skip_frozen_grad_hooks(tracker, model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    peak = {getattr(k, "value", k): v for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items()}
    per_logit = (peak["Total"] - peak["Parameter"] - peak.get("Buffer", 0)) / (tokens * vocab)
    assert per_logit == pytest.approx(FULL_LOSS_BYTES, rel=0.05)


def test_selective_recomputation_reuses_the_kept_outputs() -> None:
    """Selective checkpointing's kept outputs (every other matmul's, the attention kernel's) are the very tensors
    the recomputed block's autograd saves again (the policy hands them back instead of running the op): one block
    in backward holds its input and its saved set, as under full checkpointing, not the kept outputs twice."""
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    for method in ("full", "lora"):
        w = Workload(method=method, seq_len=4096, grad_ckpt="selective")
        full = activation_bytes(shape, Workload(method=method, seq_len=4096, grad_ckpt="full"), 1)
        assert activation_bytes(shape, w, 1) == pytest.approx(full), method
