"""Expert parallelism in the plan (`expert_parallel: N`, parallel/experts.py): what a rank no longer holds (all
but 1/N of every block's routed experts, with their gradients and optimizer states where they train), and the
all-to-all traffic that brings the tokens to their experts and back.

Traffic per mixture-of-experts block and micro-batch, per rank: every token's top-k copies of its hidden state
leave for the experts' ranks (dispatch) and come back (combine), each of `tokens x top_k x hidden x bytes`; with the
routing even, (N-1)/N of it crosses the link (the rest stays on the rank). Backward sends the gradients the same two
ways; recomputation (grad_ckpt) runs the forward's two again.
"""

from __future__ import annotations

from shardfit.plan.cards import Card
from shardfit.plan.hardware import Hardware
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.workload import Workload


def routed_expert_params(shape: ModelShape) -> int:
    """Every block's routed experts' weights: a fused gate/up (or, two-matrix experts, an up) and a down projection
    per expert."""
    return int(shape.over_blocks(lambda moe: per_block_params(shape) if moe else 0))


def applies(w: Workload, shape: ModelShape, engine: str, offload: bool) -> bool:
    """Whether a strategy row runs with the workload's expert parallelism: ddp, zero2 and zero3 do (the experts
    outside DDP and FSDP2, whole on their ranks); the rest run without it."""
    return w.expert_parallel > 1 and shape.moe and engine in ("ddp", "fsdp2") and not offload


def expert_states(shape: ModelShape, w: Workload, weight_bytes: float, train_bytes: float, state_bytes: float,
                  adapter_params: int = 0) -> tuple[float, ...]:
    """(weights, grads, optimizer) bytes of every block's routed experts, before expert parallelism divides them:
    `weight_bytes` per stored expert weight, `train_bytes` per gradient where they train (a full fine-tune), and
    `adapter_params` LoRA weights on them (`lora.experts`), trained at `train_bytes`. Each trained weight holds
    `state_bytes` of optimizer states, the same per-weight count the whole model's states were taken with
    (plan/optimizer_states.py `optimizer_state_bytes`), so what is moved out of the strategy's share is exactly what
    was counted in it (Adafactor's factored rows and columns, a few bytes per expert row, stay in the share)."""
    e = routed_expert_params(shape)
    trains = w.method == "full"
    a = adapter_params * train_bytes
    return (e * weight_bytes + a, (e * train_bytes if trains else 0.0) + a,
            ((e if trains else 0) + adapter_params) * state_bytes)


def per_block_params(shape: ModelShape) -> int:
    """One mixture-of-experts block's routed experts' weights (what FSDP2 no longer gathers under expert
    parallelism)."""
    if not shape.moe:
        return 0
    return sum(i * o for n, i, o in shape.named_linears(True) if n.startswith("expert_"))


def exchange_bytes(shape: ModelShape, w: Workload, value_bytes: int) -> float:
    """One all-to-all of one block and micro-batch, one way, as a rank sends it: its tokens' top-k hidden states,
    (N-1)/N of them to other ranks."""
    n = w.expert_parallel
    return w.tokens * shape.top_k * shape.hidden * value_bytes * (n - 1) / n


def exchanges_per_block(w: Workload) -> int:
    """All-to-alls of one block per micro-batch: dispatch and combine in forward, both again in backward, and the
    forward's again where checkpointing recomputes the block."""
    return 6 if w.grad_ckpt != "none" else 4


def all_to_all_s(shape: ModelShape, w: Workload, card: Card, hw: Hardware, value_bytes: int) -> float:
    """Seconds of one micro-batch's expert all-to-alls (on the critical path: the experts wait for their tokens),
    over the GPUs' links while the expert group sits in one node, else over its network. Each also waits for a
    count exchange (a latency)."""
    n = w.expert_parallel
    if n == 1 or not shape.moe:
        return 0.0
    bw = card.link if n <= hw.gpus_per_node else min(card.link, card.nic * hw.gpus_per_node)
    one = exchange_bytes(shape, w, value_bytes) / bw + 2 * card.latency_s * (n - 1)
    return shape.moe_layers * exchanges_per_block(w) * one
