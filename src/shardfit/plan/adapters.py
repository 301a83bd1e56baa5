"""What LoRA adapts: which of a block's linear layers carry an adapter, and how many adapter parameters the model
has."""

from __future__ import annotations

from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import LORA_TARGETS, Workload


def adapts(name: str, w: Workload) -> bool:
    """Whether LoRA adapts the block's linear layer `name` (ModelShape.named_linears): one of `lora_targets` (all
    of them by default); a mixture's routed experts only with `lora_experts` (all of them with `lora_all_experts`,
    else their fused gate/up weight when `gate` or `up` is a target; under peft's rewrite, `lora_rewritten`, the
    weights it names, while the MLP names then adapt no dense or shared expert's module); a router only with
    `lora_router`. Gated DeltaNet's projections (`linear_*`) and a shared experts' gate (`shared_gate`) bear no
    q_proj...down_proj name, so only all-linear (`lora_targets` None) reaches them, as it reaches every nn.Linear
    but the head and the routers (models/experts.py `lora_targets`), less a Mamba mixer's out_proj
    (`linear_out_proj`), whose base weight the fused kernel reads itself (models/adapters.py `mamba_out_projs`)."""
    targets = w.lora_targets or LORA_TARGETS
    if name == "router":
        return w.lora_router
    if name == "linear_out_proj" or name.startswith("weight_"):  # bare weights: no module to wrap
        return False
    if name.startswith("linear_") or name == "shared_gate":
        return w.lora_targets is None
    if name.startswith("expert_"):
        if w.lora_rewritten is not None:
            return w.lora_experts and name.removeprefix("expert_") in w.lora_rewritten
        parts = name.removeprefix("expert_").split("_")
        return w.lora_experts and (w.lora_all_experts or any(p in targets for p in parts))
    if w.lora_rewritten is not None and name in ("gate", "up", "down"):
        return False
    return name in targets


def adapts_experts(shape: ModelShape, w: Workload) -> bool:
    """Whether LoRA reaches any routed expert's weight of `shape` (`adapts` on its expert_* layers): the one
    answer for the plan and for what a converted config must say (`lora.experts`)."""
    return any(adapts(n, w) for n, _, _ in shape.named_linears(True) if n.startswith("expert_"))


def rank_of(name: str, w: Workload) -> int:
    """The adapter rank on the linear layer `name`: the workload's, doubled on a fused gate/up expert weight that
    peft's rewrite reaches (it fuses gate_proj's and up_proj's adapters, each of the rank, into one)."""
    return 2 * w.lora_rank if w.lora_rewritten is not None and name == "expert_gate_up" else w.lora_rank


def adapted_shapes(shape: ModelShape, w: Workload, moe: bool | None = None) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one block (the largest kind by default) that LoRA adapts; a fused expert
    weight counts once per expert (peft's target_parameters gives each expert its own rank)."""
    return [(i, o) for name, i, o in shape.named_linears(moe) if adapts(name, w)]


def lora_params(shape: ModelShape, w: Workload) -> int:
    """Adapter parameters of the whole model: rank x (in + out) per adapted layer (each hybrid block's copy of a
    shared block's layers too: ModelShape `shared_linears`)."""
    shared = sum(rank_of(n, w) * (i + o) for n, i, o in shape.shared_linears + shape.per_layer_model_linears()
                 if adapts(n, w))
    return int(shape.over_blocks(lambda moe: sum(rank_of(n, w) * (i + o) for n, i, o in shape.named_linears(moe)
                                                 if adapts(n, w)))
               + shared)


def lora_expert_params(shape: ModelShape, w: Workload) -> int:
    """The adapter parameters on the routed experts (`lora.experts`): the part of `lora_params` expert parallelism
    shares out with the experts."""
    if not w.trains_adapters:
        return 0
    return int(shape.over_blocks(lambda moe: sum(rank_of(n, w) * (i + o) for n, i, o in shape.named_linears(moe)
                                                 if moe and n.startswith("expert_") and adapts(n, w))))


def saved_params(shape: ModelShape, w: Workload) -> int:
    """The weights of the modules trained whole beside the adapters (`lora_saved`): a full copy of the embedding
    or of the head per name, tied or not (peft copies each module it is given)."""
    return len(set(w.lora_saved)) * shape.vocab * shape.hidden if w.trains_adapters else 0
