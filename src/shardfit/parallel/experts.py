"""Expert parallelism: each rank of an expert group keeps 1/N of every mixture-of-experts block's routed experts,
and the tokens travel to their experts' ranks and back by all-to-all.

The router still runs on every rank (it is replicated like attention); only the routed experts' call changes. Each
(token, chosen expert) pair is sent, sorted by expert, to the rank holding that expert; there transformers' own
experts computation (eager, batched_mm or grouped_mm, whichever the model runs) computes the pairs with the local
slice of the weights and a routing weight of 1; the results come back the same way and are weighted and summed on
the token's rank, in the order of the experts, as the whole block sums them. Both exchanges are autograd-aware
(`all_to_all_single_autograd`), so the gradients of the experts' weights arrive on the rank holding them, from
every rank's tokens. torchtitan's expert parallelism takes the same path (a token-count
exchange, then the tokens permuted by expert); here it wraps the existing fused-experts modules instead of
replacing them, so the state dict keeps the model's own names.

LoRA on the experts (peft's `ParamWrapper`s around the experts module, one per fused weight) is sliced with them:
peft keeps an expert's `r` rows of A together (A is [E*r, in]) and its `r` columns of B interleaved with the other
experts' (B is [out, r*E], expert index fastest), so each rank keeps its experts' rows of A and columns of B and
the wrapper's `num_experts` becomes the local count; peft then adds the local experts' deltas to the local stack.

The token movement is parallel/expert_dispatch.py; the experts' gradients and clipping, parallel/expert_grads.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardfit.models.experts import moe_parts
from shardfit.parallel.expert_dispatch import dispatch_combine
from shardfit.parallel.layout import Layout
from shardfit.resolve.experts_rules import check_ep_config

# The attribute of the experts module that says how many it holds, by family (Qwen/Mixtral/DeepSeek/GLM/gpt-oss).
COUNT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass
class ExpertShard:
    """This rank's share of the experts: `ep` ranks in `group` (None: one rank), `rank` among them; the experts
    modules it sliced (model path -> module) with their whole expert count; `world` and the group of ranks holding
    the same share (`rep_group`, None when there is one such rank) for the gradients."""

    ep: int
    rank: int
    group: Any
    world: int
    rep_group: Any = None
    mesh: Any = None  # the 1-D device mesh of the ep ranks (checkpoints store the shares as its shards)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    # peft's LoRA wrappers around each sliced experts module (model path -> wrapper), their adapters sliced too
    wrappers: dict[str, nn.Module] = field(default_factory=dict)
    total: int = 0
    # Token copies this rank sent to other ranks' experts in forward (each also comes back, and backward moves
    # the same again): what bench/expert_all_to_all.py measures against the plan's count.
    rows_sent: int = 0

    @property
    def local(self) -> int:
        return self.total // self.ep

    def params(self) -> list[nn.Parameter]:
        """The expert weights this rank holds (the sliced 3-D stacks, any per-expert biases, their LoRA factors)."""
        return [p for _, p in self._named()]

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        """(model path, parameter) of every sliced tensor: the experts modules' own and their LoRA factors."""
        out = [(f"{path}.{n}", p) for path, m in self.modules.items() for n, p in m.named_parameters(recurse=False)]
        for path, w in self.wrappers.items():
            for kind in ("lora_A", "lora_B"):
                out += [(f"{path}.{kind}.{n}", p) for n, p in getattr(w, kind).named_parameters()]
        return out

    def _expert_keys(self) -> Callable[[str], bool | None]:
        """Whether a state-dict name (of the loss module, the model inside it) is one of the sliced tensors (True),
        or None for any other."""
        paths = tuple(path for path, _ in self._named())
        return lambda key: True if key.endswith(paths) else None

    def as_shards(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint's view of this rank's state (LoRA B already in the checkpoint's `[n, out, r]`,
        train/expert_lora_layout.py): each expert weight (and its optimizer moments) as its shard of the whole
        stack (a DTensor over the ep ranks, split along the experts), so that DCP saves every rank's share under
        the one-process name and shape instead of keeping one rank's copy of a same-named tensor."""
        from torch.distributed.tensor import DTensor, Shard

        def shard(t: Any, _: bool) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t  # the optimizer's step count
            # Every expert tensor has its experts along dim 0 by now (LoRA B as [n, out, r])
            return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False)

        return map_states(model_sd, optim_sd, self._expert_keys(), shard)

    def as_local(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A loaded checkpoint ({"model": ..., "optim": ...}) with the experts' shards (`as_shards`) back as this
        rank's plain tensors; FSDP2's own shards stay as they are."""
        def local(t: Any, _: bool) -> Any:
            return t.to_local() if hasattr(t, "to_local") else t

        model, optim = map_states(state_dict["model"], state_dict["optim"], self._expert_keys(), local)
        return {**state_dict, "model": model, "optim": optim}


def map_states(model_sd: dict[str, Any], optim_sd: dict[str, Any], picked: Callable[[str], Any],
               fn: Callable[[Any, Any], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts with `fn(value, picked(key))` in place of every value whose name
    `picked` answers (not None), the optimizer's per-parameter states (moments, step) alike."""
    model_sd = {k: v if (how := picked(k)) is None else fn(v, how) for k, v in model_sd.items()}
    if "state" not in optim_sd:
        return model_sd, optim_sd
    state = {k: v if (how := picked(k)) is None else {n: fn(t, how) for n, t in v.items()}
             for k, v in optim_sd["state"].items()}
    return model_sd, {**optim_sd, "state": state}


def expert_count(module: nn.Module) -> int:
    """How many experts a fused-experts module holds (its own attribute)."""
    for a in COUNT_ATTRS:
        n = getattr(module, a, None)
        if isinstance(n, int) and n > 0:
            return n
    raise ValueError(f"{type(module).__name__} names no expert count ({', '.join(COUNT_ATTRS)})")


def _set_count(module: nn.Module, n: int) -> None:
    for a in COUNT_ATTRS:
        if isinstance(getattr(module, a, None), int):
            setattr(module, a, n)


def shard_experts(model: nn.Module, ep: int, rank: int, group: Any, world: int,
                  rep_group: Any = None, mesh: Any = None) -> ExpertShard:
    """Keep experts [rank * E/ep, (rank + 1) * E/ep) of every experts module of `model` and route its calls over
    `group`. Every parameter of an experts module is per expert (first dimension E); it is sliced in place (a copy
    of the slice, so the whole stack is freed)."""
    shard = ExpertShard(ep=ep, rank=rank, group=group, world=world, rep_group=rep_group, mesh=mesh)
    for name in moe_parts(model).experts:
        module = model.get_submodule(name)
        total = expert_count(module)
        if total % ep:
            raise ValueError(f"{name}: {total} experts do not share out over {ep} ranks")
        shard.total = total
        lo, n = rank * total // ep, total // ep
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.shape[0] != total:
                raise ValueError(f"{name}.{pname}: first dimension {p.shape[0]} is not the {total} experts")
            p.data = p.data[lo:lo + n].clone()
        _set_count(module, n)
        for path in _wrapper_paths(name):
            shard.wrappers[path] = _slice_adapters(model.get_submodule(path), lo, n, total)
        local_forward = module.forward
        shard.modules[name] = module
        module.forward = _dispatching(local_forward, shard, name, n)
    return shard


def _wrapper_paths(name: str) -> list[str]:
    """The paths of peft's wrappers around the experts module at `name` (`...experts.base_layer.base_layer`: one
    wrapper per `base_layer`), outermost first; none without LoRA on the experts."""
    parts, out = name.split("."), []
    while parts and parts[-1] == "base_layer":
        parts.pop()
        out.append(".".join(parts))
    return out


def _slice_adapters(wrapper: nn.Module, lo: int, n: int, total: int) -> nn.Module:
    """Keep experts [lo, lo + n) of a peft `ParamWrapper`'s every adapter: their rows of A ([E*r, in], an expert's
    r rows together) and their columns of B ([out, r*E], the expert index fastest)."""
    if getattr(wrapper, "num_experts", None) != total:
        raise ValueError(f"{type(wrapper).__name__} around the experts holds no adapter over all {total} experts")
    for a in wrapper.lora_A.values():
        width = a.weight.shape[-1]
        a.weight.data = a.weight.data.reshape(total, -1, width)[lo:lo + n].reshape(-1, width).clone()
    for b in wrapper.lora_B.values():
        out = b.weight.shape[0]
        b.weight.data = b.weight.data.reshape(out, -1, total)[:, :, lo:lo + n].reshape(out, -1).clone()
    wrapper.num_experts = n
    return wrapper


def _dispatching(local_forward: Callable[..., torch.Tensor], shard: ExpertShard, path: str,
                 n: int) -> Callable[..., torch.Tensor]:
    """The experts module's forward over the expert group, with the signature transformers calls it with."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        def tally(rows: int) -> None:
            shard.rows_sent += rows

        def compute(h: torch.Tensor, e: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # Under FSDP2's mixed precision the experts (left out of it) keep their own dtype.
            dtype = next(iter(shard.modules[path].parameters())).dtype
            return local_forward(h.to(dtype), e, w.to(dtype), **kwargs).to(h.dtype)

        return dispatch_combine(hidden_states, top_k_index, top_k_weights, n, shard.group, shard.ep, compute, tally)

    return forward


def ignore_in_ddp(module: nn.Module, shard: ExpertShard) -> None:
    """Tell DDP (before it wraps `module`) to neither broadcast nor average the expert weights: each rank's are its
    own share."""
    from torch.nn.parallel import DistributedDataParallel

    mine = {id(p) for p in shard.params()}
    names = [n for n, p in module.named_parameters() if id(p) in mine]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)  # noqa: SLF001


def gather_experts(shard: ExpertShard, *, stacks: bool = True) -> None:
    """Every experts module whole again on every rank (its weights gathered from the group, its own forward back)
    and their LoRA factors: for saving with the layout of a one-process run's. `stacks=False` gathers the LoRA
    factors only, for saving an adapter (a whole 235B model's experts would not fit one rank): the model is then
    not run again, as its experts stay sliced under whole adapters."""
    for module in shard.modules.values() if stacks else ():
        for p in module.parameters(recurse=False):
            p.data = torch.cat(_gathered(p.data, shard))
        _set_count(module, shard.total)
        del module.forward  # the class's forward again
    for wrapper in shard.wrappers.values():
        for a in wrapper.lora_A.values():
            a.weight.data = torch.cat(_gathered(a.weight.data, shard))  # the experts' rows in order
        for b in wrapper.lora_B.values():
            out = b.weight.shape[0]
            parts = [x.reshape(out, -1, shard.local) for x in _gathered(b.weight.data, shard)]
            b.weight.data = torch.cat(parts, dim=2).reshape(out, -1)  # experts fastest again
        wrapper.num_experts = shard.total
    shard.modules.clear()
    shard.wrappers.clear()


def _gathered(t: torch.Tensor, shard: ExpertShard) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(shard.ep)]
    dist.all_gather(parts, t.contiguous(), group=shard.group)
    return parts


def share_experts(model: nn.Module, module: nn.Module, layout: Layout, world: int, name: str) -> ExpertShard | None:
    """The job's expert parallelism on the built `model` (inside the loss `module` the strategy will wrap): the
    model checked (resolve/experts_rules.py), this rank's share kept, and DDP told to leave the experts alone.
    None when the layout shares no experts."""
    if layout.ep == 1:
        return None
    check_ep_config(layout.ep, model.config, name)
    shard = shard_experts(model, layout.ep, layout.ep_rank, layout.ep_group, world, layout.ep_rep_group,
                          layout.ep_mesh)
    ignore_in_ddp(module, shard)
    return shard
