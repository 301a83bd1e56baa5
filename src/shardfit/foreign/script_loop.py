"""A training script that trains with its own loop: no Trainer call that trains, a loop that calls `.backward()`
and an optimizer's `.step()` (research code, and many posts users copy). Read from the syntax tree (never run):
what that loop runs instead of the HF Trainer's defaults -- the micro-batch of the DataLoader it iterates, the
optimizer it steps, autocast or a GradScaler, the checkpointing it calls, and the wrapper (DDP, FSDP1/2,
deepspeed.initialize) that shares the model over ranks. What cannot be read from literals is refused (exit 2)
with the fix, never guessed.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfit.errors import UserError
from shardfit.foreign.common import SHARDING_STRATEGIES, fsdp_engine, local_file, record
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.keys import Source, use_deepspeed
from shardfit.foreign.script_loads import called_name
from shardfit.plan.optimizer_kinds import DTYPE_BYTES, OPTIMIZERS, anyprecision_kind, rmsprop_kind
from shardfit.plan.workload import Workload

if TYPE_CHECKING:  # kbit.py reads script_ast.py, which reads this module
    from shardfit.foreign.kbit import Loaded

# The optimizers the planner models, by class name: (the planner's optimizer, plan/optimizer_kinds.py; bitsandbytes'
# kernel). torch's Adam and AdamW keep the same two states; bitsandbytes' 32-bit and paged ones step in place with
# fp32 states; a class of bitsandbytes' module is its kernel whatever the name (`optimizer_kind` "bnb"). Adafactor is
# torch's, transformers' where the script imports it from there (`_planned`); SGD with momentum keeps a buffer.
MODELLED = {"AdamW": ("adamw", False), "Adam": ("adamw", False), "FusedAdam": ("adamw", False),
            "AdamW8bit": ("adamw8bit", True), "Adam8bit": ("adamw8bit", True), "PagedAdamW8bit": ("adamw8bit", True),
            "PagedAdam8bit": ("adamw8bit", True), "PagedAdamW": ("adamw", True), "PagedAdamW32bit": ("adamw", True),
            "AdamW32bit": ("adamw", True), "Adam32bit": ("adamw", True),
            "SGD": ("sgd", False), "Adagrad": ("adagrad", False), "RMSprop": ("rmsprop", False),
            "RMSprop32bit": ("rmsprop", True), "RMSprop8bit": ("rmsprop8bit", True),
            "Adafactor": ("adafactor_torch", False), "Lion": ("lion", False), "Lion32bit": ("lion", True),
            "PagedLion": ("lion", True), "PagedLion32bit": ("lion", True), "Lion8bit": ("lion8bit", True),
            "PagedLion8bit": ("lion8bit", True), "AdEMAMix": ("ademamix", False), "AdEMAMix32bit": ("ademamix", True),
            "PagedAdEMAMix": ("ademamix", True), "PagedAdEMAMix32bit": ("ademamix", True),
            "AdEMAMix8bit": ("ademamix8bit", True), "PagedAdEMAMix8bit": ("ademamix8bit", True),
            "FusedLamb": ("lamb", False), "LAMB": ("lamb", False), "LAMB32bit": ("lamb", True),
            "AdamWScheduleFree": ("schedule_free_adamw", False), "RAdamScheduleFree": ("schedule_free_radam", False),
            "SGDScheduleFree": ("schedule_free_sgd", False), "AnyPrecisionAdamW": ("adamw_anyprecision", False)}
# Adam classes planned as AdamW (the same states): stand-ins, offered no 8-bit AdamW (Workload.no_8bit_form).
ADAM_CLASSES = ("Adam", "Adam32bit")
# torchdistx's AnyPrecisionAdamW keywords for its states' dtypes, with its own defaults (optimizers/
# anyprecision_optimizer.py: the variance in bfloat16, where transformers' Trainer passes float32); the
# compensation buffer only with `use_kahan_summation` (default False).
ANYPRECISION_KEYWORDS = (("momentum_dtype", "float32"), ("variance_dtype", "bfloat16"),
                         ("compensation_buffer_dtype", "bfloat16"))
# Optimizers a loop may step that the planner does not model (beside any other class from an `optim` module).
OTHERS = ("Adadelta", "Adamax", "NAdam", "RAdam", "LBFGS", "SparseAdam", "ASGD", "Rprop", "SGD8bit", "Muon",
          "SophiaG", "Prodigy", "DAdaptAdam", "CAME", "Lamb", "Shampoo", "SOAP", "ScheduleFreeAdamW", "LAMB8bit")
# autocast's spellings (accelerate's `accelerator.autocast()` follows its Accelerator's mixed_precision instead).
AUTOCAST = ("torch.autocast", "autocast", "torch.amp.autocast", "amp.autocast", "torch.cuda.amp.autocast",
            "cuda.amp.autocast")
DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
          "float32": "fp32", "float": "fp32", "no": "fp32"}
# Calls a loop iterates through on its way to the DataLoader (enumerate(loader), tqdm(loader), ...).
_WRAPPERS = ("enumerate", "tqdm", "iter", "islice", "cycle")
_LOADERS = ("DataLoader", "StatefulDataLoader")


@dataclass
class HandLoop:
    """What a hand-written loop runs (`read_loop`), each with where the script says it (`file:line`)."""

    at: str  # the loop itself, "train.py:6-10"
    batch: int | None = None  # rows a micro-batch: the literal batch_size of the DataLoader the loop iterates
    batch_said: str = ""  # where that comes from; or why it cannot be read
    batch_at: str = ""  # the DataLoader (or the loop, where it iterates none shardfit can follow)
    optimizer: str | None = None  # the class the loop steps (AdamW, SGD, ...); None where it cannot be followed
    optimizer_at: str = ""
    optimizer_kind: str = ""  # "fused", "foreach", "for-loop", "per-tensor", "bnb", "torchao", "deepspeed", "computed"
    amsgrad: bool = False
    planned: str = ""  # the planner's optimizer for the class and its keywords (`_planned`)
    dtypes: tuple[str, ...] = ()  # its states' dtypes where the class takes them (AnyPrecisionAdamW's keywords)
    amp: str | None = None  # bf16 or fp16 where autocast (or a GradScaler, Accelerator, FSDP policy) says it
    amp_said: str = ""
    amp_unread: str = ""  # an autocast whose dtype is computed: refused
    scaler_at: str = ""  # a GradScaler the script builds (not disabled by a literal)
    ckpt_said: str = ""  # torch.utils.checkpoint / apply_activation_checkpointing where the script calls one
    reentrant: bool = True
    wraps: list[tuple[str, str, ast.Call]] = field(default_factory=list)  # ("ddp"|"fsdp1"|"fsdp2"|"deepspeed", at)
    accelerator: bool = False  # the script builds an accelerate Accelerator (its launch's plugin then applies)
    grad_accum: int = 1
    accum_said: str = ""
    syncs: list[str] = field(default_factory=list)  # .item() / print(...) in the loop: host waits each step
    # where the script tells bitsandbytes' GlobalOptimManager to keep some weight's states in 32 bits
    # (register_module_override, override_config), as the HF Trainer does for the embedding; "" where it never does
    override_at: str = ""
    epochs: int | None = None
    epochs_at: str = ""
    # the script's module-level names bound once to a literal, for the wrappers' keywords read later (loop_engine)
    constants: dict[str, Any] = field(default_factory=dict)

    def assumptions(self, ckpt_on: bool) -> list[str]:
        """The first notes of the plan: that the script is a hand-written loop, and its checkpointing where it
        calls none (`ckpt_on`: gradient_checkpointing_enable, read with the Trainer's keys)."""
        out = [f"a hand-written training loop at {self.at} (no Trainer trains): none of the HF Trainer's defaults "
               f"apply; evaluation, saving and logging are the loop's own and not planned"]
        if not ckpt_on and not self.ckpt_said:
            out.append("gradient checkpointing: off (the script calls neither gradient_checkpointing_enable nor "
                       "torch.utils.checkpoint; pass --grad-ckpt full)")
        return out

    def convert(self, job: ForeignJob) -> None:
        """The converted config's epochs: the loop's `for epoch in range(N)` where it has one, else shardfit's
        default (no Trainer default of 3)."""
        if self.epochs is not None:
            job.convert["epochs"] = self.epochs
            record(job, "for epoch in range", self.epochs, effect=f"the loop's epochs, {self.epochs_at}")
        else:
            job.convert.pop("epochs", None)

    def loaded(self, loaded: Loaded, job: ForeignJob) -> Loaded:
        """The load as kbit.py `apply_load` plans it for this loop: fp16 from the script's own autocast or
        GradScaler. Without an Accelerator nothing upcasts a 16-bit load: under torch's own FSDP a mixed-precision
        policy of the same dtype, or fp16 autocast over an fp16 load, casts nothing and keeps no fp32 masters, so
        it plans as no autocast; a GradScaler over fp16 weights of a full fine-tune exits 2 (torch refuses it)."""
        low = {"bfloat16": "bf16", "float16": "fp16", "auto": "bf16"}.get(loaded.dtype)
        w = job.workload
        if low == w.precision == "fp16" and w.method == "full" and job.engine != "deepspeed" and self.scaler_at:
            raise UserError(f"{self.scaler_at}: the script loads the model in fp16 ({loaded.said}) and its "
                            f"GradScaler unscales this full fine-tune's fp16 gradients, which torch refuses at the "
                            f"first step (ValueError: \"Attempting to unscale FP16 gradients.\"): the loop cannot "
                            f"train. Load in fp32 (torch_dtype=torch.float32) under fp16 autocast, or in bf16 "
                            f"without the GradScaler.")
        if low == w.precision and not self.accelerator and (job.engine.startswith("fsdp") or low == "fp16"):
            job.workload = dataclasses.replace(w, precision="fp32")
        return dataclasses.replace(loaded, fp16_from=f"the script's {self.amp_said}" if self.amp_said else
                                   loaded.fp16_from)


def read_loop(tree: ast.Module, path: Path, constants: dict[str, Any], bases: dict[str, str]) -> HandLoop | None:
    """The script's hand-written training loop (`HandLoop`), or None where a trainer trains or no loop calls
    `.backward()` and `.step()`. The innermost such loop counts; a trainer whose `.train()` is called wins."""
    if _trainer_trains(tree, bases):
        return None
    every = [n for n in ast.walk(tree) if isinstance(n, ast.For | ast.AsyncFor | ast.While)]
    trains = [n for n in every if _calls_attr(n, "backward") and _calls_attr(n, "step")]
    if not trains:  # a loop whose step is one of the script's own functions (`train_step(batch)`)
        functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        trains = [n for n in every if _calls_attr(_scope(n, functions), "backward") and
                  _calls_attr(_scope(n, functions), "step")]
    else:
        functions = {}
    if not trains:
        return None
    loop = min(trains, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)
    scope = _scope(loop, functions)  # the loop and the functions it calls that step (one level)
    name = path.name
    out = HandLoop(at=f"{name}:{loop.lineno}-{loop.end_lineno}", constants=constants)
    binds = _bindings(tree)
    _read_batch(out, loop, tree, binds, constants, name)
    step = _read_optimizer(out, scope, binds, _imports(tree), constants, name)
    _read_amp(out, tree, constants, name)
    _read_ckpt(out, tree, constants, name)
    _read_wraps(out, tree, name)
    _read_accum(out, scope, tree, step, constants, name)
    out.syncs = [f"{name}:{c.lineno}" for c in ast.walk(scope) if isinstance(c, ast.Call) and
                 (_attr(c) == "item" or called_name(c.func) == "print")]
    out.override_at = next((f"{name}:{c.lineno}" for c in ast.walk(tree) if isinstance(c, ast.Call) and
                            _attr(c) in ("register_module_override", "override_config")), "")
    outer = [f for f in ast.walk(tree) if isinstance(f, ast.For) and f is not loop and loop in ast.walk(f)]
    if len(outer) == 1 and isinstance(outer[0].iter, ast.Call) and called_name(outer[0].iter.func) == "range" and \
            len(outer[0].iter.args) == 1 and isinstance(n := _literal(outer[0].iter.args[0], constants), int):
        out.epochs, out.epochs_at = n, f"{name}:{outer[0].lineno}"
    return out


def _scope(loop: ast.AST, functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]) -> ast.AST:
    """`loop` with the bodies of the script's own functions it calls by name (`functions`; one level), walked as
    one tree: where a step done in `train_step(batch)` is found."""
    called = [functions[c.func.id] for c in ast.walk(loop) if isinstance(c, ast.Call) and
              isinstance(c.func, ast.Name) and c.func.id in functions]
    return ast.Module(body=[loop, *dict.fromkeys(called)], type_ignores=[]) if called else loop


def _attr(call: ast.Call) -> str:
    """The method a call calls (`step` for opt.step()), "" for a plain function."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else ""


def _calls_attr(node: ast.AST, attr: str) -> bool:
    return any(isinstance(c, ast.Call) and _attr(c) == attr for c in ast.walk(node))


def _literal(node: ast.expr, constants: dict[str, Any]) -> Any:
    """A literal, or a module-level name bound once to one; None for anything computed."""
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _trainer_trains(tree: ast.Module, bases: dict[str, str]) -> bool:
    """Whether a trainer call's `.train()` is called (`trainer.train()`, `Trainer(...).train()`); a script that
    builds none trains by its own loop, if at all."""
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)]
    built = [c for c in calls if called_name(c.func) in bases]
    if not built:
        return False
    names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.value in built
             for t in n.targets if isinstance(t, ast.Name)}
    names |= {n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and n.value in built
              and isinstance(n.target, ast.Name)}  # trainer: Trainer = Trainer(...)
    return any(_attr(c) == "train" and (isinstance(c.func.value, ast.Name) and c.func.value.id in names
                                        or c.func.value in built) for c in calls)


def _bindings(tree: ast.Module) -> dict[str, list[tuple[ast.expr, int | None]]]:
    """Each name the script assigns, with every value bound to it: (the value, None) for `x = v`, (the call,
    i) for the i-th name of `a, b = call(...)`."""
    out: dict[str, list[tuple[ast.expr, int | None]]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for t in node.targets:
            if isinstance(t, ast.Name):
                out.setdefault(t.id, []).append((node.value, None))
            elif isinstance(t, ast.Tuple):
                for i, e in enumerate(t.elts):
                    if isinstance(e, ast.Name):
                        out.setdefault(e.id, []).append((node.value, i))
    return out


def _origins(node: ast.expr, binds: dict[str, list[tuple[ast.expr, int | None]]], seen: set[str]) -> list[ast.Call]:
    """The calls a value may come from, followed through names and through `a, b = prepare(a, b)` (accelerate's
    prepare hands each object back in its place); a deepspeed.initialize tuple ends at that call."""
    if isinstance(node, ast.Call):
        if called_name(node.func) in _WRAPPERS and node.args:
            return _origins(node.args[0], binds, seen)
        return [node]
    if not isinstance(node, ast.Name) or node.id in seen:
        return []
    seen = seen | {node.id}
    out: list[ast.Call] = []
    for value, i in binds.get(node.id, []):
        if i is None:
            out += _origins(value, binds, seen)
        elif isinstance(value, ast.Call) and called_name(value.func) == "initialize":
            out.append(value)
        elif isinstance(value, ast.Call) and i < len(value.args):
            out += _origins(value.args[i], binds, seen)
    return out


def _read_batch(out: HandLoop, loop: ast.AST, tree: ast.Module, binds: dict[str, list[tuple[ast.expr, int | None]]],
                constants: dict[str, Any], name: str) -> None:
    """The micro-batch: the literal batch_size of the DataLoader the loop iterates (the script's only DataLoader
    where the loop iterates something else, as `for step in range(n): batch = next(it)` does); torch's default 1
    where it passes none."""
    found = [c for c in _origins(loop.iter, binds, set()) if called_name(c.func) in _LOADERS] \
        if isinstance(loop, ast.For | ast.AsyncFor) else []
    every = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and called_name(c.func) in _LOADERS]
    loaders = found or (every if len(every) == 1 else [])
    out.batch_at = f"{name}:{loop.lineno}"
    if len({id(c) for c in loaders}) != 1:
        out.batch_said = (f"the loop at {out.at} iterates no DataLoader shardfit can follow" if not every else
                          f"the script builds DataLoaders at {', '.join(f'{name}:{c.lineno}' for c in every)} and "
                          f"which one the loop at {out.at} iterates cannot be told")
        return
    dl = loaders[0]
    out.batch_at = f"{name}:{dl.lineno}"
    arg = _kw(dl, "batch_size") or (dl.args[1] if len(dl.args) > 1 else None)
    star = next((k.value for k in dl.keywords if k.arg is None), None)
    if arg is None and star is not None:  # DataLoader(ds, **kw): the batch may be in kw
        out.batch_said = f"the DataLoader at {out.batch_at} takes its arguments from **{ast.unparse(star)}"
        return
    if arg is None and _kw(dl, "batch_sampler") is None:
        out.batch, out.batch_said = 1, f"the DataLoader at {out.batch_at} passes no batch_size: torch's default, 1"
        return
    value = _literal(arg, constants) if arg is not None else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        out.batch, out.batch_said = value, f"the DataLoader at {out.batch_at}: batch_size={value}"
    else:
        out.batch_said = f"the DataLoader at {out.batch_at} computes its batch " + \
            (f"(batch_size={ast.unparse(arg)})" if arg is not None else "(batch_sampler=...)")


def _imports(tree: ast.Module) -> dict[str, str]:
    """Each name `from MODULE import NAME` binds, with its module."""
    return {(a.asname or a.name): n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            for a in n.names}


def _is_optimizer(call: ast.Call) -> bool:
    text = ast.unparse(call.func)
    return called_name(call.func) in MODELLED or called_name(call.func) in OTHERS or \
        ("optim." in text and "lr_scheduler" not in text and called_name(call.func)[:1].isupper())


def _read_optimizer(out: HandLoop, loop: ast.AST, binds: dict[str, list[tuple[ast.expr, int | None]]],
                    imports: dict[str, str], constants: dict[str, Any], name: str) -> ast.Call | None:
    """The optimizer the loop steps: the receiver of its `.step()` (or the argument of `scaler.step(opt)`)
    followed back to the call that builds it; a DeepSpeed engine's step runs the optimizer initialize got.
    Returns the step call."""
    steps = [c for c in ast.walk(loop) if isinstance(c, ast.Call) and _attr(c) == "step"]
    for step in steps:
        receiver = step.func.value
        scaler = "scaler" in ast.unparse(receiver).lower() or any(
            called_name(c.func) in ("GradScaler", "ShardedGradScaler") for c in _origins(receiver, binds, set()))
        target = step.args[0] if step.args and scaler else receiver
        origins = _origins(target, binds, set())
        ds = next((c for c in origins if called_name(c.func) == "initialize"), None)
        if ds is not None:
            opt = _kw(ds, "optimizer")
            origins = _origins(opt, binds, set()) if opt is not None else []
            if not origins:
                out.optimizer, out.optimizer_kind, out.optimizer_at = "DeepSpeed", "deepspeed", f"{name}:{ds.lineno}"
                return step
        built = next((c for c in origins if _is_optimizer(c)), None)
        if built is not None:
            _optimizer_kind(out, built, imports, constants, name)
            return step
    named = [s for s in steps if "sched" not in ast.unparse(s.func).lower()]
    if named:
        out.optimizer_at = f"{name}:{named[0].lineno}"
    return named[0] if named else None


def _optimizer_kind(out: HandLoop, built: ast.Call, imports: dict[str, str], constants: dict[str, Any],
                    name: str) -> None:
    """The class a loop's optimizer is and the kernel it steps with: torch's Adam/AdamW `fused=True` in place,
    `foreach=False` one tensor at a time, else foreach (torch's default on CUDA tensors); bitsandbytes' and
    torchao's by their module."""
    cls, text = called_name(built.func), ast.unparse(built.func)
    module = text.rsplit(".", 1)[0] if "." in text else imports.get(cls, "")
    out.optimizer, out.optimizer_at = cls, f"{name}:{built.lineno}"
    out.amsgrad = _literal(_kw(built, "amsgrad"), constants) is True if _kw(built, "amsgrad") is not None else False
    _planned(out, built, module, constants)
    if "torchao" in module or "ao." in f"{module}.":
        out.optimizer_kind = "torchao"
    elif "bnb" in module or "bitsandbytes" in module:
        out.optimizer_kind = "bnb"
    elif cls == "FusedAdam":
        out.optimizer_kind = "fused"
    elif cls == "AnyPrecisionAdamW":
        out.optimizer_kind = "per-tensor"
    else:
        fused, foreach = _kw(built, "fused"), _kw(built, "foreach")
        if fused is None and foreach is None and any(k.arg is None for k in built.keywords):
            out.optimizer_kind = "computed"  # AdamW(params, **okw): fused= may be in okw
            return
        f_val = _literal(fused, constants) if fused is not None else False
        e_val = _literal(foreach, constants) if foreach is not None else None
        out.optimizer_kind = "fused" if f_val is True else "for-loop" if e_val is False and not fused else \
            "computed" if fused is not None and f_val is None else "foreach"


def _planned(out: HandLoop, built: ast.Call, module: str, constants: dict[str, Any]) -> None:
    """The planner's optimizer for the class the loop builds (MODELLED) and the keywords that change its states:
    SGD's `momentum` (a literal 0 or none: no buffer; any other, or one computed: a buffer), transformers'
    Adafactor (imported from transformers: fp32 states) with `beta1` (a first moment), RMSprop's `momentum` and
    `centered` (a state each; one computed counts as given)."""
    if out.optimizer not in MODELLED:
        return
    planned = MODELLED[out.optimizer][0]

    def given(key: str) -> Any:  # the keyword's literal value; True where it is given but computed
        node = _kw(built, key)
        value = None if node is None else _literal(node, constants)
        return value if node is None or value is not None else True

    if planned == "sgd" and given("momentum") not in (None, 0, 0.0, False):
        planned = "sgd_momentum"
    if planned == "adafactor_torch" and "transformers" in module:
        planned = "adafactor" if given("beta1") is None else "adafactor_beta1"
    if planned == "rmsprop" and not MODELLED[out.optimizer][1]:  # torch's: bitsandbytes' keeps one state
        planned = rmsprop_kind(*(given(k) not in (None, 0, 0.0, False) for k in ("momentum", "centered")))
    if planned == "adamw_anyprecision":
        kahan = given("use_kahan_summation") not in (None, 0, False)
        planned = anyprecision_kind(kahan)
        out.dtypes = tuple(_dtype_keyword(built, key, default, out.optimizer_at)
                           for key, default in ANYPRECISION_KEYWORDS[:3 if kahan else 2])
    out.planned = planned


def _dtype_keyword(built: ast.Call, key: str, default: str, at: str) -> str:
    """torch's name of the dtype keyword `key` of the optimizer call `built` (`torch.bfloat16`, `bfloat16`),
    `default` where the call does not give it; one that is no floating-point dtype, or computed, exits 2."""
    node = _kw(built, key)
    if node is None:
        return default
    name = ast.unparse(node).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise UserError(f"{at}: {called_name(built.func)}({key}={ast.unparse(node)}): the dtype of the optimizer's "
                        f"state cannot be read as one of torch's floating-point dtypes; write it literally "
                        f"({key}=torch.bfloat16, or torch.float32) to plan it.")
    return name


def _read_amp(out: HandLoop, tree: ast.Module, constants: dict[str, Any], name: str) -> None:
    """Mixed precision: torch's autocast (CUDA's default dtype fp16), accelerate's Accelerator(mixed_precision=),
    FSDP's MixedPrecision(param_dtype=) / MixedPrecisionPolicy, or a GradScaler alone (fp16)."""
    found: dict[str, str] = {}
    scaler = ""
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        text, at = ast.unparse(c.func), f"{name}:{c.lineno}"
        if called_name(c.func) == "GradScaler" or called_name(c.func) == "ShardedGradScaler":
            enabled = _kw(c, "enabled")
            if enabled is None or _literal(enabled, constants) is not False:
                scaler = scaler or at
            continue
        if text in AUTOCAST:
            if _kw(c, "enabled") is not None and _literal(_kw(c, "enabled"), constants) is False:
                continue
            device = _kw(c, "device_type") or (c.args[0] if c.args and text != "torch.cuda.amp.autocast" else None)
            if device is not None and _literal(device, constants) == "cpu":
                continue
            dtype = _kw(c, "dtype")
            kind = "fp16" if dtype is None else _dtype(dtype, constants)
            what = f"autocast at {at}"
        elif called_name(c.func) == "Accelerator" and _kw(c, "mixed_precision") is not None:
            kind, what = _dtype(_kw(c, "mixed_precision"), constants), f"Accelerator(mixed_precision=...) at {at}"
        elif called_name(c.func) in ("MixedPrecision", "MixedPrecisionPolicy") and _kw(c, "param_dtype") is not None:
            kind, what = _dtype(_kw(c, "param_dtype"), constants), f"{called_name(c.func)}(param_dtype=...) at {at}"
        else:
            continue
        if kind is None:
            out.amp_unread = f"{what} computes its dtype ({ast.unparse(c)})"
            return
        found.setdefault(kind, what)
    if len(found) > 1:
        out.amp_unread = f"{' and '.join(found.values())} name different dtypes ({', '.join(found)})"
        return
    if found:
        out.amp, out.amp_said = next(iter(found.items()))
        out.amp_said = f"{out.amp_said}: {out.amp}"
        if out.amp == "fp32":
            out.amp, out.amp_said = None, ""
    out.scaler_at = scaler
    if scaler and not found:
        out.amp, out.amp_said = "fp16", f"GradScaler at {scaler} without autocast: fp16 mixed precision"


def _dtype(node: ast.expr, constants: dict[str, Any]) -> str | None:
    """bf16 / fp16 / fp32 for torch.bfloat16, "bf16", ...; None for a computed value."""
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch":
        return DTYPES.get(node.attr)
    value = _literal(node, constants)
    return DTYPES.get(value) if isinstance(value, str) else None


def _read_ckpt(out: HandLoop, tree: ast.Module, constants: dict[str, Any], name: str) -> None:
    """torch's own activation checkpointing: torch.utils.checkpoint's checkpoint / checkpoint_sequential (reentrant
    unless use_reentrant=False), or apply_activation_checkpointing (non-reentrant by default).
    gradient_checkpointing_enable() is read with the Trainer's keys (script_ast.py)."""
    imports = _imports(tree)
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        text = ast.unparse(c.func)
        torch_ckpt = called_name(c.func) in ("checkpoint", "checkpoint_sequential") and (
            "utils.checkpoint" in text or imports.get(called_name(c.func), "").endswith("utils.checkpoint")
            or text.startswith("checkpoint."))
        if torch_ckpt:
            flag = _kw(c, "use_reentrant")
            out.reentrant = not (flag is not None and _literal(flag, constants) is False)
        elif called_name(c.func) == "apply_activation_checkpointing":
            out.reentrant = "REENTRANT" in ast.unparse(c) and "NO_REENTRANT" not in ast.unparse(c)
        else:
            continue
        out.ckpt_said = f"{text}(...) at {name}:{c.lineno}"
        return


def _read_wraps(out: HandLoop, tree: ast.Module, name: str) -> None:
    """The wrappers that share the model over ranks: DistributedDataParallel (DDP), FSDP1's
    FullyShardedDataParallel (FSDP), FSDP2's fully_shard, deepspeed.initialize; and an accelerate Accelerator."""
    kinds = {"DistributedDataParallel": "ddp", "DDP": "ddp", "FullyShardedDataParallel": "fsdp1", "FSDP": "fsdp1",
             "fully_shard": "fsdp2"}
    for c in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        kind = kinds.get(called_name(c.func)) or ("deepspeed" if ast.unparse(c.func) in ("deepspeed.initialize",
                                                                                 "ds.initialize") else None)
        if kind:
            out.wraps.append((kind, f"{name}:{c.lineno}", c))
        out.accelerator = out.accelerator or called_name(c.func) == "Accelerator"


def _read_accum(out: HandLoop, loop: ast.AST, tree: ast.Module, step: ast.Call | None, constants: dict[str, Any],
                name: str) -> None:
    """Gradient accumulation: the optimizer's step under `if (i + 1) % N == 0` in the loop (N literal), or an
    Accelerator(gradient_accumulation_steps=N) whose `accumulate()` the loop enters (its step runs every N)."""
    if step is None:
        return
    accumulate = any(isinstance(c, ast.Call) and _attr(c) == "accumulate" for c in ast.walk(loop))
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and called_name(n.func) == "Accelerator"):
        n = _literal(_kw(c, "gradient_accumulation_steps"), constants) \
            if accumulate and _kw(c, "gradient_accumulation_steps") is not None else None
        if isinstance(n, int) and n > 1:
            out.grad_accum = n
            out.accum_said = f"Accelerator(gradient_accumulation_steps={n}) at {name}:{c.lineno}: the loop's " \
                             f"accelerator.accumulate() steps every {n} micro-batches"
            return
    for node in ast.walk(loop):
        if not isinstance(node, ast.If) or not any(step in ast.walk(b) for b in node.body):
            continue
        mods = [b for b in ast.walk(node.test) if isinstance(b, ast.BinOp) and isinstance(b.op, ast.Mod)]
        n = _literal(mods[0].right, constants) if mods else None
        if isinstance(n, int) and n > 1:
            out.grad_accum, out.accum_said = n, f"the loop steps every {n} micro-batches ({name}:{node.lineno})"
        else:
            out.accum_said = (f"the loop steps the optimizer under a condition shardfit cannot read ({name}:"
                              f"{node.lineno}): planned as one micro-batch a step")
        return


def refuse_unread(loop: HandLoop, source: str, batch: int | None, optimizer: str | None) -> None:
    """Exit 2 for what the loop runs that cannot be read and no flag gives: the micro-batch (--batch), the
    optimizer (the planner's AdamW kernels; --optimizer), the autocast dtype, an unclear wrapping."""
    if loop.batch is None and batch is None:
        raise UserError(f"{loop.batch_at}: {loop.batch_said}, so the micro-batch of the hand-written training loop "
                        f"at {loop.at} is not known; pass --batch N (rows each rank's loop runs a step) to plan it.")
    if optimizer is None and (loop.optimizer is None or loop.optimizer_kind not in ("deepspeed",) and
                              (loop.optimizer not in MODELLED or loop.amsgrad)):
        if loop.optimizer is None:
            raise UserError(f"{loop.optimizer_at or loop.at}: the optimizer the hand-written loop at {loop.at} steps "
                            f"is built where shardfit cannot follow it; pass --optimizer NAME (one of "
                            f"{', '.join(OPTIMIZERS)}) as the script builds it.")
        what = f"{loop.optimizer}(amsgrad=True), a third state per weight" if loop.amsgrad else loop.optimizer
        raise UserError(f"{loop.optimizer_at}: optim {what} (the optimizer the hand-written loop at {loop.at} "
                        f"steps) is not modelled: the planner counts {', '.join(sorted(MODELLED))} as their "
                        f"libraries build them. Step one of those in the script, or pass --optimizer NAME (one of "
                        f"{', '.join(OPTIMIZERS)}) to plan that one's states in its place.")
    if loop.amp_unread:
        raise UserError(f"{loop.amp_unread}: the hand-written loop's precision cannot be told from the code. Write "
                        f"the dtype literally (dtype=torch.bfloat16, or torch.float16) to plan it.")
    kinds = {k for k, _, _ in loop.wraps}
    if len(kinds) > 1:
        wraps = ", ".join(f"{k} at {a}" for k, a, _ in loop.wraps)
        raise UserError(f"{source}: the script wraps the model with {wraps}; which one the hand-written loop at "
                        f"{loop.at} trains cannot be told. Keep one wrapper.")


def _step_loop(loop: HandLoop, w: Workload) -> str:
    """The Workload's `optimizer_loop` for the optimizer a hand-written loop builds: as its keywords say, torch's
    default where they say none (one tensor at a time on the torch before 2.0 that `w`'s release ran, whose
    zero_grad writes zeros: foreign/common.py `step_keys`); bitsandbytes' and torchao's their own (`auto`)."""
    kind = loop.optimizer_kind
    if kind == "foreach":
        return "for_loop" if w.zero_grad_zeros else "foreach"
    return {"fused": "fused", "for-loop": "for_loop", "per-tensor": "for_loop"}.get(kind, "auto")


def loop_workload(w: Workload, loop: HandLoop, batch: int | None, optimizer: str | None, precision_from_launch: str,
                  notes: list[str]) -> Workload:
    """The workload of a hand-written loop: its micro-batch, accumulation, optimizer kernel, precision and
    checkpointing, where the Trainer's defaults stood (`w`). `precision_from_launch`: accelerate's mixed precision
    from the launch, which only an Accelerator in the script applies."""
    changes: dict[str, Any] = {"micro_batch": batch or loop.batch or w.micro_batch, "grad_accum": loop.grad_accum,
                               "precision": loop.amp or (precision_from_launch if loop.accelerator else "fp32")}
    if loop.ckpt_said:
        changes["grad_ckpt"] = "full"
    if optimizer is None and loop.optimizer in MODELLED:
        planned, bnb = loop.planned or MODELLED[loop.optimizer][0], MODELLED[loop.optimizer][1]
        changes.update(optimizer=planned, optimizer_dtypes=loop.dtypes,
                       bnb_optimizer=bnb or loop.optimizer_kind == "bnb",
                       torchao_optimizer=loop.optimizer_kind == "torchao",
                       fused_adamw=loop.optimizer_kind not in ("foreach", "computed"),
                       no_8bit_form=loop.optimizer in ADAM_CLASSES, optimizer_loop=_step_loop(loop, w))
    elif optimizer is None and loop.optimizer_kind == "deepspeed":
        changes.update(optimizer="adamw", optimizer_dtypes=(), bnb_optimizer=False, fused_adamw=True,
                       no_8bit_form=True, optimizer_loop="fused")
    else:
        changes.update(bnb_optimizer=False, torchao_optimizer=False, fused_adamw=False, no_8bit_form=False,
                       optimizer_loop="auto")
    # No Trainer registers the embedding for 32-bit states: only the script's own override keeps it from 8 bits
    # (plan/optimizer_states.py `fp32_state_embedding`), an upper bound whatever weight it names.
    changes["embedding_override"] = bool(loop.override_at)
    _say_workload(loop, batch, optimizer, changes, notes)
    return dataclasses.replace(w, **changes)


_KERNELS = {"fused": "fused=True: stepped in place", "foreach": "torch's default foreach step on CUDA, one copy "
            "of what each GPU trains at the step", "for-loop": "foreach=False: stepped one tensor at a time, no copy "
            "of the whole group", "per-tensor": "torchdistx: stepped one tensor at a time, its states in their own "
            "dtypes", "bnb": "bitsandbytes: stepped in place", "torchao": "torchao: stepped in place",
            "computed": "fused= computed in the script: planned as torch's default foreach step, one copy of "
            "what each GPU trains (an upper bound; fused=True steps in place)"}


def _say_workload(loop: HandLoop, batch: int | None, optimizer: str | None, changes: dict[str, Any],
                  notes: list[str]) -> None:
    """The notes for `loop_workload`: where each setting comes from."""
    if loop.batch is not None:
        notes.append(f"micro-batch --batch {batch} in place of the loop's {loop.batch} ({loop.batch_said})" if batch
                     else f"micro-batch {loop.batch}: {loop.batch_said}")
    elif batch is not None:
        notes.append(f"micro-batch --batch {batch}: {loop.batch_said}")
    if loop.accum_said:
        notes.append(loop.accum_said)
    if optimizer is not None:
        notes.append(f"--optimizer {optimizer} in place of the loop's {loop.optimizer or 'optimizer'}" +
                     (f" ({loop.optimizer_at})" if loop.optimizer_at else ""))
    elif loop.optimizer_kind == "deepspeed":
        notes.append(f"the loop steps the DeepSpeed engine of deepspeed.initialize at {loop.optimizer_at}: the "
                     f"optimizer its JSON builds")
    else:
        notes.append(f"optimizer: {loop.optimizer} at {loop.optimizer_at} ({_KERNELS[loop.optimizer_kind]})"
                     + (_override_said(loop) if loop.optimizer_kind == "bnb" and "8bit" in changes["optimizer"]
                        else ""))
    if loop.amp:
        notes.append(f"precision: {loop.amp_said} around the loop's forward (autocast over the weights as loaded)")
    elif changes["precision"] != "fp32":
        notes.append(f"precision: {changes['precision']}, the launch's accelerate mixed precision, which the "
                     f"script's Accelerator applies")
    if loop.ckpt_said:
        notes.append(f"gradient checkpointing: {loop.ckpt_said}" + ("" if loop.reentrant else " (non-reentrant)"))


def _override_said(loop: HandLoop) -> str:
    """Where a loop's bitsandbytes 8-bit optimizer keeps 32-bit states beside the small tensors'."""
    if loop.override_at:
        return (f"; 32-bit states for the input embedding (a full fine-tune's) as the script's GlobalOptimManager "
                f"override at {loop.override_at} asks, planned for the embedding whatever weight it names")
    return ("; the input embedding's states in 8 bits too: the script registers no 32-bit override "
            "(GlobalOptimManager.register_module_override), which the HF Trainer alone does for it")


def hand_loop_job(job: ForeignJob, loop: HandLoop, src: Source, hidden: int) -> bool:
    """What a hand-written loop's job runs beside its workload: the engine (`loop_engine`), DDP's
    find_unused_parameters, torch checkpointing's reentrancy, the tool's words for the plan's suggestions, and what
    the planned speed assumes. False where the script's Accelerator decides the engine (hf_engine.py `plan_engine`)."""
    if loop.ckpt_said:
        job.reentrant_ckpt = loop.reentrant
    loop_words(job)
    job.notes.append(loop_speed_note(loop))
    return loop_engine(job, loop, src, hidden)


def loop_engine(job: ForeignJob, loop: HandLoop, src: Source, hidden: int) -> bool:
    """How the loop's ranks share the model, by the wrapper it calls: DDP; FSDP2's fully_shard (full_shard unless
    reshard_after_forward=False; CPUOffloadPolicy: offload); FSDP1 by its sharding_strategy and cpu_offload (torch's
    use_orig_params=False: flat parameters); deepspeed.initialize by its JSON. Under several ranks with none of
    them: planned as DDP, said. False where the script's Accelerator decides (accelerate's plugin, hf_engine.py)."""
    job.find_unused = False
    if not loop.wraps:
        if loop.accelerator:
            return False
        if job.distributed:
            job.engine = "ddp"
            job.notes.append(f"the hand-written loop at {loop.at} runs under {job.nproc} ranks a node and the script "
                             f"wraps the model in no DistributedDataParallel, FSDP or deepspeed.initialize shardfit "
                             f"can see: planned as DDP (a full copy per rank); a loop that syncs no gradients at all "
                             f"holds a little less")
        return True
    kind, at, call = loop.wraps[0]
    if kind == "ddp":
        job.engine = "ddp" if job.distributed else "single"
        unused = _kw(call, "find_unused_parameters")
        job.find_unused = unused is not None and _literal(unused, loop.constants) is True
        job.notes.append(f"DistributedDataParallel at {at}" + (" (find_unused_parameters=True)" if job.find_unused
                                                                else ""))
    elif kind == "fsdp2":
        reshard = _kw(call, "reshard_after_forward")
        offload = _kw(call, "offload_policy")
        keeps = reshard is not None and _literal(reshard, loop.constants) is False
        job.engine = fsdp_engine("shard_grad_op" if keeps else "full_shard",
                                 offload is not None and "CPUOffloadPolicy" in ast.unparse(offload), job.distributed)
        job.workload = dataclasses.replace(job.workload, fsdp1=False, flat_params=False)
        job.notes.append(f"FSDP2's fully_shard at {at}: {job.engine}")
    elif kind == "fsdp1":
        strategy = _kw(call, "sharding_strategy")
        name = ast.unparse(strategy).rsplit(".", 1)[-1].upper() if strategy is not None else "FULL_SHARD"
        if name not in SHARDING_STRATEGIES:
            raise UserError(f"{at}: FullyShardedDataParallel(sharding_strategy={ast.unparse(strategy)}) cannot be "
                            f"read; write the strategy literally (ShardingStrategy.FULL_SHARD, SHARD_GRAD_OP, ...).")
        offload = _kw(call, "cpu_offload")
        orig = _kw(call, "use_orig_params")
        job.engine = fsdp_engine(SHARDING_STRATEGIES[name], offload is not None and "offload_params=True" in
                                 ast.unparse(offload), job.distributed)
        flat = not (orig is not None and _literal(orig, loop.constants) is True)
        job.workload = dataclasses.replace(job.workload, fsdp1=True, flat_params=flat)
        job.notes.append(f"FSDP1's FullyShardedDataParallel at {at}: {job.engine}" +
                         (" (use_orig_params=False, torch's default: flat parameters)" if flat else ""))
    else:
        _loop_deepspeed(job, call, at, src, hidden, loop.constants)
    return True


def _loop_deepspeed(job: ForeignJob, call: ast.Call, at: str, src: Source, hidden: int,
                    constants: dict[str, Any]) -> None:
    """deepspeed.initialize(config=FILE) (or config_params=, or args whose --deepspeed_config the command line
    gives): the JSON is read as any DeepSpeed job's; its precision section decides the precision."""
    given = _kw(call, "config") or _kw(call, "config_params")
    ref = _literal(given, constants) if given is not None else None
    if not isinstance(ref, str):
        ref = src.get("deepspeed_config") or src.get("deepspeed")
    if not isinstance(ref, str) or local_file(ref, src.path.parent) is None:
        raise UserError(f"{at}: deepspeed.initialize's config cannot be read (" +
                        (f"{ast.unparse(given)}" if given is not None else "no config=") + "): give the JSON as "
                        "config=\"ds_config.json\" in the call, or --deepspeed_config FILE on the command line.")
    ds = use_deepspeed(job, ref, src.path.parent, f"{at}: deepspeed.initialize", hidden, job.notes)
    if ds.precision:
        job.workload = dataclasses.replace(job.workload, precision=ds.precision)
    job.notes.append(f"deepspeed.initialize at {at} with {ref}: ZeRO as the JSON says")


def loop_speed_note(loop: HandLoop) -> str:
    """What the planned speed assumes of a hand-written loop."""
    lines = list(dict.fromkeys(loop.syncs))
    syncs = f"; this loop makes the host wait for the GPU (.item(), print) at {', '.join(lines)} each time that " \
        "line runs" if lines else ""
    return ("tokens/s is what a tuned stack (the HF Trainer, torchtitan) reaches on this card, as the time model "
            "is fitted on those: a hand-written loop's own data loading, per-step host syncs and missing fusions "
            f"can make it slower{syncs}")


def loop_words(job: ForeignJob) -> None:
    """The changes the plan may suggest, spelled in the script's code rather than the Trainer's arguments."""
    job.words.keys.update({
        "micro_batch": "DataLoader batch_size=1 with gradient accumulation over {} micro-batches in the loop",
        "grad_ckpt": "model.gradient_checkpointing_enable() before the loop",
        **{k: f"bitsandbytes.optim.{cls} in place of the script's optimizer" for k, cls in (
            ("adamw8bit", "AdamW8bit"), ("rmsprop8bit", "RMSprop8bit"), ("lion8bit", "Lion8bit"),
            ("ademamix8bit", "AdEMAMix8bit"))},
        "lora": "peft's get_peft_model(model, LoraConfig(...))",
        "qlora": "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) with peft's "
                 "get_peft_model(model, LoraConfig(...))",
        "fused_loss": "a fused linear cross-entropy (Liger's) in the loop's loss"})
    job.words.zero.update({z: f"deepspeed.initialize(..., config=\"ds_config_{z}.json\")"
                           for z in ("zero2", "zero3", "zero3_offload")})
