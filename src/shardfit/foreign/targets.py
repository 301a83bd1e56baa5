"""The modules a tool puts LoRA adapters on (axolotl's `lora_target_modules`, LLaMA-Factory's `lora_target`,
ms-swift's `--target_modules`, peft's `target_modules`), planned as the adapters on those modules only.

Targets are matched as peft matches them, on the module names of the job's own model: a list entry names the
modules whose name is it or ends with "." and it (`q_proj`, `self_attn.q_proj`; `q` is no suffix of `q_proj`), a
string is one regular expression that must match a module's whole name. Where peft would refuse the targets
(nothing matches), the job exits 2; where the planner cannot tell (names of modules it does not model), it plans
every linear layer and says so."""

from __future__ import annotations

import dataclasses
import re

from shardfit.config.targets import names_no_module, targets_fix, targets_problem, unmatched
from shardfit.errors import UserError
from shardfit.foreign.job import TOOL_NAMES, ForeignJob
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.sdpa_classes import installed_transformers, release_of
from shardfit.plan.workload import LORA_TARGETS

# The projection names the planner places on every model it lists (block_modules): an entry ending in one of them
# that matches none of the model's modules names a module the model does not have.
_PROJECTIONS = {f"{n}_proj" for n in LORA_TARGETS}
# A mixture's router names (`_moe_names`), which the planner lists on every mixture it models: on a model without
# them (a dense one, gpt-oss's `router` beside Qwen's `gate`) they match no module.
_ROUTERS = {"gate", "router"}
# Families whose attention and MLP modules have other names than the planner's shapes can say (their catalog
# entries are the compact form), by config.json's model_type: a job naming q_proj... on them is planned, with a note
# to check. By model_type, not the hub id: GLM-4-9B-0414 (glm4) names its modules q_proj..., THUDM/glm-4-9b
# (chatglm) query_key_value; Phi-4-mini is a phi3.
_OTHER_NAMES = {"phi3": "qkv_proj, o_proj, gate_up_proj, down_proj",
                "mixtral": "q_proj, k_proj, v_proj, o_proj, and in transformers 4 block_sparse_moe.gate and its "
                           "experts' w1, w2, w3",
                "chatglm": "query_key_value, dense, dense_h_to_4h, dense_4h_to_h"}


def _block_prefixes(shape: ModelShape, version: str) -> tuple[str, ...]:
    """Where the decoder blocks sit: `model.layers`, or for a model with a vision or audio tower
    `model.language_model.layers` from transformers 4.52 (its refactor of the multimodal classes); before it, one
    of `model.layers` (Qwen2-VL) and `language_model.model.layers` (LLaVA-style), which the shape does not say."""
    if not shape.multimodal:
        return ("model.layers",)
    if release_of(version) >= (4, 52):
        return ("model.language_model.layers",)
    return ("model.layers", "language_model.model.layers")


def _attention(shape: ModelShape) -> dict[str, list[str]]:
    """A block's attention modules by the LORA_TARGETS name the planner counts them under (ModelShape.
    attention_linears): MLA's low-rank query and key-value projections count as q and k, and it has no v_proj."""
    if shape.mla is None:
        return {n: [f"self_attn.{n}_proj"] for n in ("q", "k", "v", "o")}
    q = ["self_attn.q_a_proj", "self_attn.q_b_proj"] if shape.mla.q_rank else ["self_attn.q_proj"]
    return {"q": q, "k": ["self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"], "o": ["self_attn.o_proj"]}


def fused_experts(shape: ModelShape, version: str) -> bool:
    """Whether transformers `version` builds `shape`'s routed experts fused: one `experts` module per block holding
    3-D weights for all of them (`gate_up_proj`, `down_proj`), no module per expert. Every family from
    transformers 5; gpt-oss's and Llama 4's classes from their first release."""
    return shape.moe and (release_of(version) >= (5, 0) or shape.experts_always_fused)


# The model types whose transformers-4 expert names peft 0.21 rewrites onto transformers 5's fused weights
# (peft/utils/transformers_weight_conversion.py, `_convert_peft_config_moe`), by the gate, up and down names it
# moves from target_modules to target_parameters: Mixtral's w1, w3, w2; the rest's gate_proj, up_proj, down_proj.
# Qwen2-MoE itself, gpt-oss, Llama 4 and the other mixtures get no rewrite: their routed experts take no adapter
# from target_modules.
_MIXTRAL_NAMES = ("w1", "w3", "w2")
_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")
_REWRITTEN = {"mixtral": _MIXTRAL_NAMES, "minimax": _MIXTRAL_NAMES, "minimax_m2": _MIXTRAL_NAMES,
              **dict.fromkeys(("afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe",
                               "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "glm4v_moe", "longcat_flash",
                               "solar_open", "mellum", "qwen3_moe", "beam", "qwen3_omni_moe", "qwen3_next",
                               "hunyuan_v1_moe", "flex_olmo", "olmoe", "exaone_moe", "cohere2_moe"), _PROJ_NAMES)}


def peft_rewrite(shape: ModelShape, version: str) -> tuple[str, str, str] | None:
    """The gate, up and down names peft 0.21 moves onto `shape`'s fused expert weights under transformers
    `version` (None: no rewrite; transformers 4 has no fused weights to rewrite onto)."""
    return _REWRITTEN.get(shape.model_type) if fused_experts(shape, version) else None


def as_peft_reads(entry: str, shape: ModelShape, version: str) -> str:
    """The name a list entry reaches under peft 0.21's rewrite (`peft_rewrite`): an entry that is a moved name or
    the router's `gate`, or ends in "." and one (`mlp.gate_proj`, `model.layers.0.mlp.up_proj`,
    `block_sparse_moe.gate`), is moved whatever its prefix, onto every block's fused experts (the router's weight);
    any other entry, and every entry without the rewrite, is matched as written."""
    moved = peft_rewrite(shape, version)
    if moved is None:
        return entry
    return next((name for name in (*moved, "gate") if entry == name or entry.endswith("." + name)), entry)


def _moe_names(shape: ModelShape) -> tuple[str, str, str]:
    """The MLP's attribute, the router's and the shared expert's names as transformers builds the family: Llama
    4's feed_forward, feed_forward.router and feed_forward.shared_expert; gpt-oss's mlp.router; the Qwen MoE
    families' mlp.shared_expert (beside its gate); DeepSeek's, GLM-4.5's and the other families'
    mlp.shared_experts."""
    if shape.every_expert:
        return "feed_forward", "router", "shared_expert"
    return "mlp", "router" if shape.clamped_swiglu else "gate", "shared_expert" if shape.shared_gate else \
        "shared_experts"


def block_modules(shape: ModelShape, version: str | None = None) -> dict[str, list[str]]:
    """The modules of `shape`'s decoder blocks that the planner counts adapters on, by LORA_TARGETS name, with
    their names as transformers `version` (default: the installed one) builds the model:
    `model.layers.N.self_attn.q_proj` for a text model; an MLP of two matrices has no gate_proj; a mixture's
    blocks hold its router (`mlp.gate`, a module peft adapts, counted under gate: the router's adapters are not
    modelled, and planning it as gate projections is the larger estimate), a shared expert's projections, its
    first `dense_layers` a dense MLP, and its routed experts' projections: `mlp.experts.M.gate_proj`... where
    `version` builds a module per expert; where it fuses them (`fused_experts`), no expert's own module but, for
    the families peft 0.21 rewrites (`peft_rewrite`), `mlp.experts.gate_proj`, `up_proj` and `down_proj`
    (Mixtral's `w1`, `w3`, `w2`): the names it moves onto the fused weights of every expert."""
    version = version or installed_transformers()
    prefixes = _block_prefixes(shape, version)
    parts = _attention(shape)
    mlp = [n for n in ("gate", "up", "down") if not (n == "gate" and shape.two_matrix)]
    ffn, router, shared = _moe_names(shape)
    fused = fused_experts(shape, version)
    out: dict[str, list[str]] = {n: [] for n in LORA_TARGETS}
    for prefix in prefixes:
        for i in range(shape.layers):
            block = f"{prefix}.{i}"
            for name, modules in parts.items():
                out[name] += [f"{block}.{m}" for m in modules]
            if not shape.moe or i < shape.dense_layers:
                for name in mlp:
                    out[name].append(f"{block}.{ffn}.{name}_proj")
                continue
            out["gate"].append(f"{block}.{ffn}.{router}")
            for name in mlp:
                if not fused:
                    out[name] += [f"{block}.{ffn}.experts.{e}.{name}_proj" for e in range(shape.experts)]
                elif (moved := peft_rewrite(shape, version)) is not None:
                    out[name].append(f"{block}.{ffn}.experts.{moved[('gate', 'up', 'down').index(name)]}")
                if shape.shared_intermediate:
                    out[name].append(f"{block}.{ffn}.{shared}.{name}_proj")
    return {n: names for n, names in out.items() if names}


def _containers(shape: ModelShape, version: str) -> list[str]:
    """Names of modules that peft cannot wrap (no nn.Linear, nn.Embedding or the like), in one dense and one
    mixture block of `shape` as transformers `version` names them: the model and its layer list, the block, its
    norms, attention and MLP, a dense gated MLP's activation module, and a mixture's experts container and shared
    expert."""
    ffn, _, shared = _moe_names(shape)
    out: list[str] = []
    for prefix in _block_prefixes(shape, version):
        parts = prefix.split(".")
        out += [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
        for i in sorted({0, min(shape.dense_layers, shape.layers - 1)}):
            block = f"{prefix}.{i}"
            out += [block, f"{block}.self_attn", f"{block}.{ffn}", f"{block}.input_layernorm",
                    f"{block}.post_attention_layernorm"]
            if ffn == "mlp" and not (shape.two_matrix or shape.clamped_swiglu) and i < shape.dense_layers + \
                    (0 if shape.moe else 1):
                out.append(f"{block}.mlp.act_fn")  # a gated MLP's activation is a module of its own (SiLU...)
            if shape.moe and i >= shape.dense_layers:
                out.append(f"{block}.{ffn}.experts")
                if shape.shared_intermediate:
                    out.append(f"{block}.{ffn}.{shared}")
    return list(dict.fromkeys(out))


def _matches(target: str, module: str) -> bool:
    """peft's rule for one entry of a list of target modules."""
    return module == target or module.endswith("." + target)


def _own_names(modules: dict[str, list[str]]) -> str:
    """The last parts of the model's block modules, each once (`q_proj, k_proj, ..., down_proj`)."""
    seen = dict.fromkeys(m.rsplit(".", 1)[-1] for names in modules.values() for m in names)
    return ", ".join(seen)


# One routed expert's module (`experts.0.gate_proj`, any prefix): where transformers fuses the experts there is no
# such module, so an entry peft does not move onto the fused weights (`as_peft_reads`) surely matches nothing.
_ONE_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")


def _refused(t: str) -> bool:
    """Whether a list entry that matched none of the modules the planner lists matches none of the model's at
    all: it names one of the planner's projections (bare, or under self_attn/mlp), which the planner lists
    wherever the model has them. Other names (lm_head, a vision tower's modules) may name modules the planner does
    not model. (Entries that name no module of any model are refused before: config/targets.py.)"""
    return t.rsplit(".", 1)[-1] in _PROJECTIONS | _ROUTERS and \
        (t.count(".") == 0 or t.startswith(("self_attn.", "mlp.")))


def _fix(missed: list[str], modules: dict[str, list[str]]) -> str:
    """What to give instead of the `missed` entries, and the model's own module names."""
    return f"{targets_fix(missed)} The model's block modules: {_own_names(modules)}.".lstrip()


def _other_family(shape: ModelShape) -> str | None:
    """The module names of a family the shape cannot tell apart (Phi-3's fused qkv_proj...), when the model
    is one of them (its shape's model_type)."""
    return _OTHER_NAMES.get(shape.model_type)


def _none_of_the_family(job: ForeignJob, key: str, entries: list[str], shape: ModelShape) -> None:
    """Refuse list entries of which none ends in a module name of a family the shape cannot tell apart (`q_proj,
    v_proj` on GLM-4-9B, whose attention is query_key_value): peft raises "Target modules ... not found" when no
    entry matches a module."""
    other = _other_family(shape)
    if other is None:
        return
    names = set(re.findall(r"[A-Za-z0-9_]+", other))
    if entries and not any(t.rsplit(".", 1)[-1] in names for t in entries):
        raise UserError(f"{job.source}: {key} {', '.join(entries)} matches no module of {job.model}, whose modules "
                        f"are named {other}: peft raises \"Target modules ... not found in the base model\" when "
                        f"no entry matches. Name its own modules ({other.split(', ')[0]}, ...).")


def _fallback(job: ForeignJob, key: str, shown: str, modules: dict[str, list[str]], what: str) -> str:
    """Every linear layer, with the note saying why (targets the planner cannot place)."""
    example = next(iter(modules.values()))[0]
    job.notes.append(f"{key} {shown}: {what} of the projections of {job.model}'s blocks (named as {example}); "
                     f"planned as adapters on every linear layer (an over-estimate; peft refuses targets that "
                     f"match no module of the model at all)")
    return ""


def _short_match(rx: re.Pattern[str], modules: dict[str, list[str]]) -> str | None:
    """A trailing part of a module name that `rx` matches in full (`q_proj of model.layers.0.self_attn.q_proj`),
    if any."""
    kinds = {re.sub(r"\.\d+\.", ".N.", m): m for names in modules.values() for m in names}  # one of each layout
    for name in kinds.values():
        parts = name.split(".")
        for i in range(1, len(parts)):
            if rx.fullmatch(".".join(parts[i:])):
                return f"{'.'.join(parts[i:])} of {name}"
    return None


def plan_targets(job: ForeignJob, key: str, targets: str | list[str], shape: ModelShape,
                 version: str | None = None) -> str:
    """Plan the job's adapters on `targets` (module names, or one regular expression over them as peft reads a
    string; not all-linear) of `shape`'s modules as transformers `version` names them (default: the installed
    one), and return the effect the plan shows beside `key`. Targets peft refuses (none matches a module) are a
    UserError: a string that matches only the end of a name (`q_proj`: peft matches it on the whole name), list
    entries of which none names a module (`q` for q_proj, `q_proj,v_proj` as one name, a projection the model
    lacks). A list entry that matches nothing beside others that do is skipped, as peft skips it, with a note.
    Targets the planner cannot place (names of modules it does not model, a pattern over other paths)
    leave the adapters on every linear layer, said in a note, and return "" (the key is then not modelled)."""
    ver = version or installed_transformers()
    modules = block_modules(shape, ver)
    shown = targets if isinstance(targets, str) else ", ".join(targets)
    if isinstance(targets, str):
        try:
            rx = re.compile(targets)
        except re.error as e:  # peft would fail on it when it builds the adapters
            raise UserError(f"{job.source}: {key} {targets!r} is not a regular expression ({e}); give module names "
                            f"or a valid regular expression over module names.") from None
        box = next((c for c in _containers(shape, ver) if rx.fullmatch(c)), None)
        if box is not None:
            raise UserError(f"{job.source}: {key} {targets!r} matches {box}, a module peft cannot wrap (no nn.Linear): "
                            f"peft wraps every module whose whole name the pattern matches, and raises \"Target "
                            f"module ... is not supported\" on this one. Match only the projections' names "
                            f"('.*\\.(q_proj|v_proj)').")
        hits = {n: [m for m in names if rx.fullmatch(m)] for n, names in modules.items()}
        planned = tuple(n for n, found in hits.items() if found)
        if not planned:
            short = _short_match(rx, modules)
            if short is not None:
                raise UserError(f"{job.source}: {key} {targets!r} matches only the end of module names ({short}): "
                                f"peft matches a string as a regular expression on the whole name, and refuses "
                                f"one that matches no module. Give a list of names ([q_proj, v_proj]) or a "
                                f"pattern over whole names ('.*\\.(q_proj|v_proj)').")
            return _fallback(job, key, shown, modules, "matches none")
    else:
        # Another tool's job runs under peft's rule: entries that match nothing are skipped beside others that
        # match, so only a list of which none matches exits 2 (config/targets.py `unmatched`).
        problem = targets_problem(targets, skip_partial=True)
        if problem is not None and problem.refused:
            raise UserError(f"{job.source}: {key} {problem.message} The model's block modules: "
                            f"{_own_names(modules)}.")
        # an entry naming one expert's module (`mlp.experts.0.down_proj`) needs no rule of its own: where
        # transformers fuses the experts, peft 0.21 moves it onto every expert's fused weight when it ends in a
        # moved name (`as_peft_reads`), and otherwise it matches no module, as any name the model lacks
        named = [t for t in targets if not names_no_module(t)]
        read = {t: as_peft_reads(t, shape, ver) for t in named}
        hits = {n: [m for m in names if any(_matches(read[t], m) for t in named)] for n, names in modules.items()}
        planned = tuple(n for n, found in hits.items() if found)
        missed = [t for t in named if not any(_matches(read[t], m) for names in modules.values() for m in names)]
        fused = fused_experts(shape, ver)
        if any(not (_refused(t) or (fused and _ONE_EXPERT.search(t))) for t in missed):
            return _fallback(job, key, shown, modules, "names modules beyond those")
        _none_of_the_family(job, key, [read[t] for t in named], shape)
        if problem is not None:
            job.notes.append(f"{key} {problem.message}")
        example = next(iter(modules.values()))[0]
        why = (f"{job.source}: {key} {', '.join(missed)} matches no module of {job.model}: peft matches a name on "
               f"the module name's last parts ({example}). {_fix(missed, modules)}")
        verdict = unmatched(named, missed, why, skip_partial=True)
        if verdict is not None and verdict.refused:
            raise UserError(f"{why} peft refuses targets of which none matches a module (\"Target modules "
                            f"{set(targets)} not found in the base model\").")
        if verdict is not None:
            job.notes.append(verdict.message.removeprefix(f"{job.source}: "))
    _notes(job, key, hits, shape, ver)
    fields = _experts(job, key, hits, shape, ver)
    if fields.get("lora_router") and all(m.rsplit(".", 1)[-1] in ("gate", "router") for m in hits.get("gate", [])):
        # the router is counted as itself (lora_router), not as gate projections; an empty tuple would read as
        # every projection, so a router alone keeps `gate` (the larger estimate)
        planned = tuple(n for n in planned if n != "gate") or planned
    job.workload = dataclasses.replace(job.workload, lora_targets=planned, **fields)
    on = ", ".join(f"{name}_proj" for name in planned)
    if isinstance(targets, str):
        return f"a regular expression: adapters on {on} of every block it names"
    return f"adapters on {on}"


def _notes(job: ForeignJob, key: str, hits: dict[str, list[str]], shape: ModelShape, version: str) -> None:
    """What the plan of targets that peft takes leaves uncertain: a mixture's router planned as gate projections,
    fused experts reached through peft's rewrite of transformers 4's names, a family whose module names the shape
    cannot say."""
    if hits.get("gate") and all(m.rsplit(".", 1)[-1] in ("gate", "router") for m in hits["gate"]):
        router = re.sub(r"^.*\.layers\.\d+\.", "", hits["gate"][0])
        if peft_rewrite(shape, version) is not None:
            job.notes.append(f"{key}: {router} is {job.model}'s router; peft 0.21 adapts its weight (gate.weight, "
                             f"through target_parameters), planned so")
        else:
            job.notes.append(f"{key}: {router} is {job.model}'s router, a module peft adapts; its adapters are "
                             f"planned as gate projections (an over-estimate)")
    moved = peft_rewrite(shape, version)
    if moved is not None and any(re.search(r"\.experts\.[a-z]", m) for found in hits.values() for m in found):
        job.notes.append(f"{key}: transformers {version} fuses {job.model}'s routed experts into 3-D weights "
                         f"(experts.gate_up_proj, experts.down_proj); peft 0.21 moves {', '.join(moved)} onto "
                         f"them (every expert's; {moved[0]} and {moved[1]} only together, gate_up_proj at twice "
                         f"the rank), so the dense layers' and shared experts' MLPs get no adapter; a peft without "
                         f"that rewrite refuses them")
    other = _other_family(shape)
    if other is not None and peft_rewrite(shape, version) is None:
        job.notes.append(f"{key}: {job.model}'s modules are named {other}, which the planner's shape does not "
                         f"say: planned on the usual projection names; peft skips a name the model does "
                         f"not have, and refuses the targets only when none matches")


def _experts(job: ForeignJob, key: str, hits: dict[str, list[str]], shape: ModelShape, version: str) -> dict:
    """The Workload fields of what peft 0.21 adapts on a mixture whose experts transformers `version` fuses, for
    target_modules matching the modules `hits`: under its rewrite (`peft_rewrite`) the moved names reach the
    fused weights (gate_up at twice the rank, gate and up only together: it raises on one alone) and no dense or
    shared expert's module, and the router's `gate` its weight; without it no routed expert (a 3-D weight is no
    module), and the router only where it is an nn.Linear (Llama 4's)."""
    if not fused_experts(shape, version):
        return {}
    leaves = {m.rsplit(".", 1)[-1] for found in hits.values() for m in found}
    moved = peft_rewrite(shape, version)
    if moved is None:
        router = next((m for m in hits.get("gate", ()) if m.rsplit(".", 1)[-1] in ("gate", "router")), None)
        if router is not None and not _router_is_linear(shape, moved):
            raise UserError(f"{job.source}: {key} reaches {re.sub(r'^.*[.]layers[.][0-9]+[.]', '', router)}, "
                            f"{job.model}'s router, which transformers {version} builds as its own module class "
                            f"(no nn.Linear) and peft 0.21 does not rewrite: peft raises \"Target module ... is "
                            f"not supported\". Drop it from {key}.")
        return {"lora_experts": False, "lora_router": _router_is_linear(shape, moved) and "router" in leaves}
    gate, up, down = moved
    if (gate in leaves) != (up in leaves):
        one, other = (gate, up) if gate in leaves else (up, gate)
        raise UserError(f"{job.source}: {key} reaches {one} but not {other}: peft 0.21 moves every entry named or "
                        f"ending in .{gate}/.{up} onto {job.model}'s fused experts.gate_up_proj under "
                        f"transformers {version}, and raises \"Cannot convert PEFT target(s) {one} without also "
                        f"targeting {other} because they are fused into gate_up_proj\". Add {other}, or drop "
                        f"{one}.")
    fused = (("gate_up",) if gate in leaves else ()) + (("down",) if down in leaves else ())
    return {"lora_experts": True, "lora_rewritten": fused, "lora_router": "gate" in leaves}


def _router_is_linear(shape: ModelShape, moved: tuple[str, str, str] | None) -> bool:
    """Whether peft 0.21 puts an adapter on the router of `shape`'s fused mixture as a module (all-linear or a
    target naming it): without its rewrite (`moved` None) only Llama 4's router is an nn.Linear; the other
    families' routers are modules of their own class, which peft refuses to wrap and all-linear passes over.
    Under the rewrite the router's weight is reached as a parameter instead (`lora_router` from its name)."""
    return moved is None and shape.every_expert


# The tools that resolve their "all" targets themselves into the leaf names of the model's modules whose class
# name says Linear, and hand peft that list (LLaMA-Factory 0.9.5 `find_all_linear_modules`, ms-swift 4.6.0
# `find_all_linears` for a text model), rather than peft's string all-linear: the list `_linear_leaves` makes,
# as axolotl's lora_target_linear does (`plan_linear_names`).
LINEAR_NAME_TOOLS = {"llamafactory": "lora_target all", "swift": "--target_modules all-linear"}


def plan_all_linear(job: ForeignJob, shape: ModelShape, version: str) -> None:
    """What all-linear adapts on a mixture whose experts transformers `version` fuses. peft 0.21's string: every
    nn.Linear's module name, which under its rewrite includes the moved expert names and the router's `gate`
    (the fused weights at their ranks, no dense or shared expert's MLP), and without it reaches no routed expert
    and the router only where it is an nn.Linear (Llama 4's). A tool that hands peft its Linear modules' names
    (LINEAR_NAME_TOOLS) reaches the same modules without the rewrite; under it, no router (a module of its own
    class, no Linear) and the fused experts only when the list (`_linear_leaves`: a dense layer's or shared
    expert's MLP) holds every name peft moves, gate_proj, up_proj and down_proj, which it then moves onto every
    expert."""
    if not (job.workload.trains_adapters and fused_experts(shape, version)):
        return
    moved = peft_rewrite(shape, version)
    if moved is not None and job.tool in LINEAR_NAME_TOOLS and not (job.tool == "swift" and shape.multimodal):
        leaves = _linear_leaves(shape, version)
        listed = all(name in leaves for name in moved)
        fields = {"lora_experts": listed, "lora_rewritten": ("gate_up", "down") if listed else (),
                  "lora_router": False}
        reached = (f"its dense layers' or shared experts' MLPs put {', '.join(moved)} in that list, which peft "
                   f"0.21 moves onto every routed expert's fused weights (gate_up_proj at twice the rank, no "
                   f"adapter left on those MLPs)" if listed else
                   f"none of {', '.join(moved)} is in that list, so the routed experts get no adapter")
        job.notes.append(f"{LINEAR_NAME_TOOLS[job.tool]} on {job.model}: {TOOL_NAMES[job.tool]} hands peft the "
                         f"names of the modules whose class is a Linear, not peft's all-linear; under transformers "
                         f"{version} the router and the fused experts are no Linear: {reached}; no router adapter")
        job.workload = dataclasses.replace(job.workload, **fields)
        return
    if moved is None:
        # Llama 4's router is an nn.Linear of class Llama4Router: a Linear for peft, no "Linear" in its name
        fields = {"lora_experts": False,
                  "lora_router": _router_is_linear(shape, moved) and job.tool not in LINEAR_NAME_TOOLS}
    else:
        fields = {"lora_experts": True, "lora_rewritten": ("gate_up", "down"), "lora_router": True}
        job.notes.append(f"all-linear on {job.model}: peft 0.21 moves {', '.join(moved)} onto the fused routed "
                         f"experts (gate_up_proj at twice the rank), so the dense layers' and shared experts' MLPs "
                         f"get no adapter; the router's weight gets one")
    job.workload = dataclasses.replace(job.workload, **fields)


# The last parts of the module names peft's modules_to_save reaches on the planner's models: the input embedding
# and the LM head (ChatGLM's output_layer, InternLM2's output, GPT-NeoX's embed_in/embed_out).
_SAVED = {"embed_tokens": "embed", "wte": "embed", "word_embeddings": "embed", "embed_in": "embed",
          "lm_head": "head", "output_layer": "head", "output": "head", "embed_out": "head"}


def saved_names(value: object) -> list[str]:
    """The module names of a modules_to_save setting: a list, or names separated by commas (LLaMA-Factory's
    additional_target) or spaces (ms-swift's `--modules_to_save a b`); empty for none."""
    if value is None or value is False:
        return []
    items = value if isinstance(value, (list, tuple, set)) else [value]
    return [t for item in items for t in re.split(r"[,\s]+", str(item)) if t]


def plan_saved(job: ForeignJob, key: str, names: list[str]) -> str:
    """Plan peft's modules_to_save `names`: a full trainable copy of the embedding and the head among them (its
    weights, gradients and optimizer states; the frozen original stays), the effect shown beside `key`. Other
    modules are not modelled: "" when none of the names is planned."""
    kinds = {_SAVED[n.rsplit(".", 1)[-1]] for n in names if n.rsplit(".", 1)[-1] in _SAVED}
    other = [n for n in names if n.rsplit(".", 1)[-1] not in _SAVED]
    if not kinds:
        return ""
    job.workload = dataclasses.replace(job.workload, lora_saved=tuple(sorted(kinds)))
    if other:
        job.notes.append(f"{key}: {', '.join(other)} also trained whole (peft's modules_to_save), not planned: "
                         f"only the embedding's and the head's copies are (an under-estimate)")
    what = " and ".join({"embed": "the embedding", "head": "the head"}[k] for k in sorted(kinds))
    return f"{what} trained whole beside the adapters (peft's modules_to_save: a full trainable copy)"


# peft 0.21's targets for a LoraConfig without target_modules (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, looked up by the top-level config's model_type in
# LoraModel._prepare_adapter_config), the whole table: a model_type outside it makes peft raise. Copied so that a
# plan imports no peft (and with it torch); tests/test_foreign_peft_parity.py holds the copy to the installed
# peft's table, every row. gemma4's row is a regex over the language model's q_proj/v_proj: the same two names.
PEFT_DEFAULT_TARGETS = {
    **dict.fromkeys(("llama", "llama4", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                     "stablelm", "opt", "gptj", "gpt_neo", "bart", "gemma4"), ("q_proj", "v_proj")),
    **dict.fromkeys(("t5", "mt5"), ("q", "v")), **dict.fromkeys(("gpt2", "gpt_bigcode"), ("c_attn",)),
    **dict.fromkeys(("bloom", "gpt_neox", "chatglm", "RefinedWebModel", "RefinedWeb", "falcon"), ("query_key_value",)),
    "blip-2": ("q", "v", "q_proj", "v_proj"),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "layoutlm"), ("query", "value")),
    "deberta-v2": ("query_proj", "value_proj"), "deberta": ("in_proj",), "mpt": ("Wqkv",),
    "btlm": ("c_proj", "c_attn"), "codegen": ("qkv_proj",), "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj"), "rwkv": ("key", "value", "receptance", "output"),
    "rwkv7": ("r_proj", "k_proj", "v_proj", "o_proj", "key", "value")}


def plan_peft_default(job: ForeignJob, key: str, shape: ModelShape, version: str) -> tuple[str, list[str]]:
    """Plan a LoraConfig built without target_modules (TRL's --use_peft without --lora_target_modules): peft
    takes its table's targets for the model's type (PEFT_DEFAULT_TARGETS; `shape.model_type`: its config.json's, or
    the catalog entry's, which states it), planned as those targets are; a type outside the table peft refuses,
    exit 2. A model whose type the planner cannot tell keeps every linear layer, said in a note. Returns the effect
    shown beside `key` ("" where not modelled) and the targets peft takes."""
    kind = shape.model_type
    if not kind:
        job.notes.append(f"{key} without target modules: peft takes its default targets for the model's type "
                         f"(q_proj, v_proj for llama, qwen2, mistral...), which the planner cannot tell for "
                         f"{job.model}: planned on every linear layer (an over-estimate)")
        return "", []
    targets = PEFT_DEFAULT_TARGETS.get(kind)
    if targets is None:
        raise UserError(f"{job.source}: {key} gives peft no target modules, and peft has no default for "
                        f"{job.model}'s model_type {kind}: it raises \"Please specify `target_modules` or "
                        f"`target_parameters` in `peft_config`\". Name them (--lora_target_modules with the "
                        f"model's module names, or all-linear).")
    job.notes.append(f"{key} without target modules: peft's default for model_type {kind}, "
                     f"{', '.join(targets)}")
    return plan_targets(job, key, list(targets), shape, version), list(targets)


def _linear_leaves(shape: ModelShape, version: str) -> list[str]:
    """The last parts of the names of `shape`'s block modules that are an nn.Linear under transformers `version`
    (axolotl's find_all_linear_names): where the experts are fused, no expert's name and a router only where it
    is one (Llama 4's Llama4Router); before that, every expert's projections and the router (an nn.Linear)."""
    fused = fused_experts(shape, version)
    _, router, _ = _moe_names(shape)
    leaves = [m.rsplit(".", 1)[-1] for names in block_modules(shape, version).values() for m in names
              if not (fused and re.search(r"\.experts\.[a-z]", m))]
    return [n for n in dict.fromkeys(leaves) if not (fused and n == router and not shape.every_expert)]


def plan_linear_names(job: ForeignJob, key: str, named: list[str], shape: ModelShape, version: str) -> None:
    """axolotl's `lora_target_linear: true` (0.19 loaders/adapter.py): peft gets the last names of the modules
    that are an nn.Linear (or whose class name says Linear), less lm_head, joined with the `named`
    lora_target_modules beside it. Every linear layer where the experts are not fused; on fused experts
    (transformers 5) that list reaches no routed expert unless peft's rewrite moves a dense or shared expert's
    gate_proj, up_proj and down_proj onto them, and no router but Llama 4's, or one `named`."""
    if not (job.workload.trains_adapters and fused_experts(shape, version)):
        return
    if peft_rewrite(shape, version) is None:
        # no rewrite: the list reaches what every linear layer does (plan_all_linear: no routed expert, Llama 4's
        # router), and a named router of its own class peft refuses to wrap (`_experts`)
        modules = block_modules(shape, version)
        _experts(job, key, {n: [m for m in found if any(_matches(t, m) for t in named)]
                            for n, found in modules.items()}, shape, version)
        plan_all_linear(job, shape, version)
        return
    names = list(dict.fromkeys([*_linear_leaves(shape, version), *named]))
    job.notes.append(f"{key}: axolotl hands peft the names of {job.model}'s linear modules ({', '.join(names)}); "
                     f"transformers {version} builds its routed experts fused (no Linear), planned as peft "
                     f"adapts that list")
    plan_targets(job, key, names, shape, version)
