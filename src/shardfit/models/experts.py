"""A mixture of experts inside a built model: its routers, its fused expert weights, its load-balancing loss.

transformers 5 stores every family's routed experts as fused 3-D parameters of one `experts` module per block
(`gate_up_proj` [experts, 2 x width, hidden] or transposed, `down_proj`), and the router as a module of its own
(`mlp.gate`, `mlp.router`, `feed_forward.router`). peft reaches the fused weights only through
`target_parameters`; and its automatic v4-to-v5 conversion of `all-linear` also targets the router's weight, which
must stay frozen (an adapted router changes which experts every token reaches). So shardfit names both itself.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROUTER_NAMES = ("gate", "router")
# The config keys that name the routed experts per block, by family (Qwen, Mixtral/gpt-oss/Llama 4, DeepSeek/GLM).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeParts:
    """Module paths of a model's routers and experts modules, and the experts' fused weight names."""

    routers: tuple[str, ...]
    experts: tuple[str, ...]
    expert_weights: tuple[str, ...]  # e.g. ("gate_up_proj", "down_proj"): 3-D parameters of an experts module

    @property
    def any(self) -> bool:
        return bool(self.experts)


def moe_parts(model: nn.Module) -> MoeParts:
    """The routers and experts of `model` (empty for a dense model): an `experts` module with 3-D weights, and the
    router beside it in the same block (through a peft wrapper too)."""
    routers, experts, weights = [], [], set()
    for name, module in model.named_modules():
        # Under a LoRA wrapper the experts module sits below peft's `base_layer`s, its router where it was.
        path = name.replace(".base_layer", "")
        if not path.endswith("experts"):
            continue
        fused = fused_weight_names(module)
        if not fused:
            continue
        experts.append(name)
        weights.update(fused)
        parent = path.rpartition(".")[0]
        for r in ROUTER_NAMES:
            if isinstance(model.get_submodule(parent), nn.Module) and hasattr(model.get_submodule(parent), r):
                routers.append(f"{parent}.{r}")
    return MoeParts(tuple(routers), tuple(experts), tuple(sorted(weights)))


def fused_weight_names(module: nn.Module) -> list[str]:
    """The fused expert weights of an experts module: its 3-D parameters, and the 3-D weights QLoRA stores in NF4
    behind a parametrization (models/quantize_experts.py; recognised by its `expert_shape`, without dequantizing)."""
    names = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    plists = getattr(module, "parametrizations", None)
    if isinstance(plists, nn.ModuleDict):
        names += [n for n, plist in plists.items() if len(getattr(plist[0], "expert_shape", ())) == 3]
    return names


def lora_targets(model: nn.Module, parts: MoeParts) -> list[str]:
    """`all-linear` resolved as peft would, less the routers and the output head: the linear layers of the model
    (shared experts and dense blocks included) by full path."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routers = set(parts.routers)
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and name not in routers]


def router_targets(targets: str | list[str], parts: MoeParts) -> list[str]:
    """The routers that LoRA `targets` name, matched as peft matches module names (a list entry: the module's name
    or its last dotted parts; a string other than all-linear: a regular expression over the whole name)."""
    if targets == "all-linear":
        return []
    if isinstance(targets, str):
        try:
            return [r for r in parts.routers if re.fullmatch(targets, r)]
        except re.error:
            return []  # apply_lora reports the bad expression
    return [r for r in parts.routers if any(r == t or r.endswith("." + t) for t in targets)]


def expert_target_parameters(parts: MoeParts) -> list[str]:
    """peft `target_parameters` for every fused expert weight: a rank of LoRA per expert."""
    return [f"{e}.{w}" for e in parts.experts for w in parts.expert_weights]


def use_experts(model: nn.Module, name: str | None) -> str | None:
    """Set how `model`'s routed experts compute (transformers' `experts_implementation`: eager, batched_mm,
    grouped_mm; resolve/defaults.py `resolve_experts` chooses by device); None or a dense model: left as built.
    Where transformers refuses `name` for the class (grouped_mm it cannot dispatch) the experts run eager, which
    every fused-experts class has; a class it cannot switch at all keeps what it was built with. Returns what the
    experts now run, or None for a dense model."""
    config = getattr(model, "config", None)
    if config is None or not moe_parts(model).any:
        return None
    if name is not None and getattr(config, "_experts_implementation", None) != name:
        try:
            model.set_experts_implementation(name)
        except (ValueError, KeyError):  # transformers refuses an implementation the class cannot dispatch to
            model.set_experts_implementation("eager")
    return getattr(config, "_experts_implementation", None)


@contextlib.contextmanager
def adapter_names_as_written(model: nn.Module) -> Iterator[None]:
    """peft 0.21 rewrites a LoRA config's targets for the MoE families whose v4 layout transformers 5 fused
    (`gate_proj` -> the fused `gate_up_proj` with the rank doubled, `gate` -> the router's weight), so that adapters
    trained on v4 still load. Applied to an adapter made on v5 it moves a shared expert's or a dense block's
    `gate_proj` adapter onto the routed experts (LoRA where `lora.experts: false` said none) and targets the router.
    Within this scope peft sees a model type it has no rewrite for, and takes the targets as written: around
    creating an adapter and around reading one back."""
    config = getattr(model, "config", None)
    if config is None or not moe_parts(model).any:
        yield
        return
    real = config.model_type
    had_own = "model_type" in vars(config)
    config.model_type = f"{real}-shardfit-v5"
    try:
        yield
    finally:
        if had_own:
            config.model_type = real
        else:
            del config.model_type


def freeze_routers(model: nn.Module, parts: MoeParts) -> int:
    """Leave every router frozen (full fine-tune with `train_router: false`); returns how many weights."""
    n = 0
    for r in parts.routers:
        for p in model.get_submodule(r).parameters():
            p.requires_grad_(False)
            n += 1
    return n


@dataclass(frozen=True)
class AuxLoss:
    """The model's own load-balancing loss and what it needs: experts, top-k, coefficient (from its config)."""

    fn: Callable[..., torch.Tensor]
    experts: int
    top_k: int
    coef: float


def aux_loss_of(model: nn.Module, config: Any) -> AuxLoss | None:
    """The load-balancing loss of the model's family (its modeling module's `load_balancing_loss_func`) with the
    coefficient its config sets, or None: a dense model, a family without one (DeepSeek-V3 and GLM-4.5 balance
    with a bias instead; GLM-4.5V's transformers class has one besides), or a coefficient of 0."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    experts = next((getattr(text, k) for k in EXPERT_COUNT_KEYS if getattr(text, k, None)), None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not coef or not experts or not top_k:
        return None
    fn = balancing_loss_fn(model)
    return AuxLoss(fn, int(experts), int(top_k), coef) if fn is not None else None


def balancing_loss_fn(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The `load_balancing_loss_func` of the model's modeling module, None for a family without one."""
    for m in model.modules():
        fn = getattr(sys.modules.get(type(m).__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    return None


def moe_top_k(model: nn.Module) -> int:
    """Experts each token reaches, from the model's (text) config; 0 for a model without routed experts."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = max(int(getattr(config, k, 0) or 0) for k in EXPERT_COUNT_KEYS)
    return int(getattr(config, "num_experts_per_tok", 0) or 1) if experts > 1 else 0


def router_logits_of(out: Any) -> tuple[torch.Tensor, ...]:
    """The per-block router logits a forward with `output_router_logits=True` recorded ([tokens, experts] each)."""
    logits = getattr(out, "router_logits", None) or ()
    return tuple(r[0] if isinstance(r, tuple) else r for r in logits)


def expert_load(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """[lowest, highest] share of routed tokens any expert of any block received, times the number of experts (a
    float64 tensor on the logits' device; [0, 0] without logits): 1.0 is an even load; a highest of several and a
    lowest near 0 is collapse onto few experts. Counted on the device (a scatter-add, not `bincount`, whose output
    size is data) and never read here: the host reads the window's figures at a logging step (train/metrics.py)."""
    if not router_logits:
        return torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        return load_of_counts(torch.stack([_choices(logits.detach().float(), top_k) for logits in router_logits]))


def _choices(scores: torch.Tensor, top_k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the tokens' top-k choices went to each expert ([experts] float64) from [tokens, experts] scores;
    `keep` ([tokens] bool): only those tokens'."""
    chosen = scores.topk(top_k, dim=-1).indices.flatten()
    counts = torch.zeros(scores.shape[-1], dtype=torch.float64, device=chosen.device)
    ones = torch.ones_like(chosen, dtype=torch.float64)
    return counts.scatter_add_(0, chosen, ones if keep is None else ones * keep.repeat_interleave(top_k))


def load_of_counts(counts: torch.Tensor) -> torch.Tensor:
    """`expert_load`'s [lowest, highest] from the top-k choices per block and expert ([blocks, experts])."""
    share = counts / counts.sum(-1, keepdim=True).clamp(min=1) * counts.shape[-1]
    return torch.stack([share.min(), share.max()])


def router_sums(router_logits: tuple[torch.Tensor, ...], top_k: int, with_probs: bool = True,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The routers' per-expert statistics of a forward, which add up over the pieces of a batch (the ranks of a
    sequence-parallel group): the router's fp32 softmax summed over blocks and tokens ([experts], in the graph;
    None without `with_probs`), and the top-k choices of that softmax per block and expert ([blocks, experts]
    float64, outside it), whose sum over experts is top_k x the block's tokens. `keep` ([tokens] bool): count
    only those tokens (not the padding a split added)."""
    if keep is not None and router_logits:
        keep = keep.to(router_logits[0].device)
    probs = [torch.softmax(logits.float(), dim=-1) for logits in router_logits] if with_probs else None
    with torch.no_grad():
        scores = probs if probs is not None else [logits.detach().float() for logits in router_logits]
        counts = torch.stack([_choices(p.detach(), top_k, keep) for p in scores])
    if probs is None:
        return None, counts
    mask = None if keep is None else keep.to(probs[0].dtype)[:, None]
    return torch.stack([(p if mask is None else p * mask).sum(0) for p in probs]).sum(0), counts


def switch_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss from `router_sums`: experts x sum over experts of (the share of
    top-k choices it got) x (its mean router probability), both over every block's tokens; what the families'
    `load_balancing_loss_func` computes from the logits themselves (without an attention mask)."""
    rows = counts.sum() / top_k  # tokens x blocks
    choices = counts.sum(0).to(probs.dtype)
    return (choices / rows.to(probs.dtype) * probs / rows.to(probs.dtype)).sum() * probs.shape[-1]


def switch_form(aux: AuxLoss) -> bool:
    """Whether the model's own load-balancing loss is `switch_loss` (so its statistics may be summed over the pieces
    of a split batch): both on the same fixed random logits of two blocks, to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(16, aux.experts, generator=g) for _ in range(2))
    probs, counts = router_sums(logits, aux.top_k)
    try:
        own = aux.fn(logits, aux.experts, aux.top_k, None)
    except (TypeError, ValueError, RuntimeError):  # another signature (doge, switch_transformers): another form
        return False
    return isinstance(own, torch.Tensor) and bool(torch.allclose(own.float(), switch_loss(probs, counts, aux.top_k),
                                                                 rtol=1e-5, atol=1e-7))
