"""Which of a training script's model loads is the model its trainer trains (script_ast.py `read_script`): the
from_pretrained (or from_config) whose result reaches the `model=` of the trainer whose `.train()` runs, followed
back through the names it is assigned to, the wrappers it passes through (get_peft_model(model, ...)), the casts
on its chain (`.half()`, `.to(torch.bfloat16)`: the last one is the dtype) and the script's own functions that
return it. A script also loads models it does not train (a reward model, a reference model, a merge after
training, a helper never called): the first load in the file is not the trained one. Read from the syntax tree,
never run."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

# The owners of a from_pretrained that loads a model with a classification head (a reward or value model): the
# trained model only where the trainer's `model=` is tied to it (RewardTrainer).
HEAD_OWNERS = ("SequenceClassification", "TokenClassification")
# unsloth's loaders, which choose the dtype themselves (unsloth models/llama.py `from_pretrained`: dtype None is
# bfloat16 where the GPU supports it, else float16) and patch the model: not transformers' from_pretrained.
UNSLOTH_OWNERS = ("FastLanguageModel", "FastModel", "FastVisionModel")
# Classes whose from_pretrained loads no model weights.
_NOT_MODELS = ("Tokenizer", "Config", "Processor", "FeatureExtractor")
# How deep the names and calls are followed back from the trainer's `model=` (a loop of reassignments stops here).
_DEPTH = 12
# Methods that hand back the model they are called on in its dtype (`.to` unless given a torch dtype).
_KEEPS = ("to", "cuda", "train", "requires_grad_")
# nn.Module's casts of every floating-point weight, by TRL's --dtype names; `.to(torch.X)` casts to X.
_CASTS = {"half": "float16", "bfloat16": "bfloat16", "float": "float32"}
# transformers' builders of a model from a config: random weights in the dtype given, else the config's.
FROM_CONFIG = ("from_config", "_from_config")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# What `_Flow.resolve` finds a value can hold: model loads, each with the last cast on its way (None: none).
Found = set[tuple[ast.Call, ast.Call | None]] | None


@dataclass(frozen=True)
class ModelLoad:
    """One from_pretrained (or from_config) call that loads a model: the call, where (`at`, "train.py:12") and on
    what (`owner`); `cast` the last cast on the way to the trainer (`.half()`), which sets the dtype, and `config`,
    for from_config, the call that made its config (`_Flow.config_of`)."""

    call: ast.Call
    at: str
    owner: str
    cast: ast.Call | None = None
    config: ast.Call | None = None

    @property
    def built(self) -> bool:
        """A from_config: the model built from a config, not loaded from a checkpoint."""
        return called_name(self.call.func) in FROM_CONFIG

    @property
    def unsloth(self) -> bool:
        return self.owner in UNSLOTH_OWNERS

    @property
    def head(self) -> bool:
        return any(h in self.owner for h in HEAD_OWNERS)


def owner_of(call: ast.Call) -> str:
    """The class a from_pretrained is called on (`AutoModelForCausalLM` for transformers.AutoModelForCausalLM)."""
    return ast.unparse(call.func.value).rsplit(".", 1)[-1] if isinstance(call.func, ast.Attribute) else ""


def loads_model(call: ast.Call) -> bool:
    """Whether a from_pretrained call loads a model: called on a model class (AutoModelForCausalLM,
    LlamaForCausalLM, AutoPeftModelForCausalLM, FastLanguageModel), not on a tokenizer, config or processor, nor
    peft's PeftModel (which puts adapters on a model loaded already)."""
    owner = owner_of(call)
    return ("Model" in owner or "For" in owner) and not owner.startswith("PeftModel") and \
        not any(n in owner for n in _NOT_MODELS)


@dataclass
class TrainedLoad:
    """What `trained_load` finds: the loads the trainer's `model=` is tied to (`tied`, empty where none can be), the
    loads that could still be the trained one where it is not (`candidates`), and unsloth's loads among all;
    `unfollowed`: the call (as "build() at train.py:5") the trainer's `model=` comes from that cannot be followed
    back to a load (no candidate is then taken for it); `untold`: where the trainers are, where several are built
    and which one trains cannot be told; `trainer`: the call of the one that trains."""

    tied: list[ModelLoad]
    candidates: list[ModelLoad]
    unsloth: list[ModelLoad]
    unfollowed: str | None = None
    untold: list[str] = field(default_factory=list)
    trainer: ast.Call | None = None  # the trainer call that trains (None: no trainer, or `untold`)


def trained_load(tree: ast.Module, file: str, trainers: tuple[str, ...]) -> TrainedLoad:
    """The model loads of the script (`file` its name) and which of them the trainer trains: the call of a trainer
    class (`trainers`, or a class the script derives from one) whose `.train()` runs, or the one such call. Untied,
    the candidates leave out heads (HEAD_OWNERS), unsloth's loads, loads in a function the script never names, and
    loads after the trainer call in its own function (a merge after training); there are none where the trainer's
    `model=` comes from a call that cannot be followed (a builder the script imports)."""
    flow = _Flow(tree)
    loads = [ModelLoad(c, f"{file}:{c.lineno}", owner_of(c)) for c in flow.calls
             if called_name(c.func) in ("from_pretrained", *FROM_CONFIG) and loads_model(c)]
    names = trainer_names(tree, trainers)
    trainer, untold = flow.trained([c for c in flow.calls if called_name(c.func) in names], file)
    tied: set[tuple[ast.Call, ast.Call | None]] | None = None
    unfollowed = None
    if trainer is not None:
        arg = next((k.value for k in trainer.keywords if k.arg == "model"), trainer.args[0] if trainer.args else None)
        tied = flow.resolve(arg, trainer, None, 0) if arg is not None else None
        if tied is None and flow.opaque:
            call = flow.opaque[0]
            unfollowed = f"{ast.unparse(call.func)}({'...' if call.args or call.keywords else ''}) at " \
                         f"{file}:{call.lineno}"
    called = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    candidates = [ld for ld in loads if not ld.head and not ld.unsloth and flow.reachable(ld.call, called)
                  and not (trainer is not None and flow.scope(ld.call) is flow.scope(trainer)
                           and ld.call.lineno > trainer.lineno)] if unfollowed is None else []
    by_call = {ld.call: ld for ld in loads}
    found = [replace(by_call[c], cast=cast, config=flow.config_of(c) if by_call[c].built else None)
             for c, cast in sorted(tied or (), key=lambda t: (t[0].lineno, t[0].col_offset,
                                                              t[1].lineno if t[1] else 0))]
    return TrainedLoad(found, [replace(ld, config=flow.config_of(ld.call) if ld.built else None) for ld in candidates],
                       [ld for ld in loads if ld.unsloth], unfollowed, untold, trainer)


def cast_dtype(call: ast.Call) -> str | None:
    """The dtype a cast on the chain (`_is_cast`) sets, by TRL's --dtype names; None where `.to(dtype=...)` is
    given a computed one."""
    if called_name(call.func) in _CASTS:
        return _CASTS[called_name(call.func)]
    dtype = next((a.attr for a in (*call.args, *(k.value for k in call.keywords))
                  if isinstance(a, ast.Attribute) and called_name(a.value) == "torch"), None)
    return dtype if dtype in _CASTS.values() else None


def cast_said(call: ast.Call) -> str:
    """A cast as the script spells it, without the model it is called on: `.to(dtype=torch.bfloat16)`."""
    return f".{called_name(call.func)}({', '.join(ast.unparse(a) for a in (*call.args, *call.keywords))})"


def _is_cast(call: ast.Call) -> bool:
    """Whether a method call casts every weight of the model it is called on: `.half()`, `.bfloat16()`,
    `.float()`, or `.to(...)` given a torch dtype (`torch.bfloat16`) or any `dtype=`."""
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr in _CASTS:
        return not call.args and not call.keywords
    return call.func.attr == "to" and (any(k.arg == "dtype" for k in call.keywords) or any(
        isinstance(a, ast.Attribute) and called_name(a.value) == "torch" for a in call.args))


def called_name(func: ast.expr) -> str:
    """The called name: `Trainer` for Trainer(...) and transformers.Trainer(...) (a chain's last attribute,
    a name's own id); "" for any other callee (a call, a subscript)."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def trainer_names(tree: ast.Module, trainers: tuple[str, ...]) -> tuple[str, ...]:
    """The trainer classes a script's calls may build: `trainers`, and the classes the script derives from one."""
    return tuple(trainer_bases(tree, trainers))


def trainer_bases(tree: ast.Module, trainers: tuple[str, ...]) -> dict[str, str]:
    """Each trainer class a script's calls may build, mapped to the library class it is (`trainers`): itself, or
    the one a class the script derives from it (through its own classes too: `class A(DPOTrainer)`,
    `class B(A)`) extends -- a custom DPOTrainer still optimises DPO."""
    out = {t: t for t in trainers}
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    grew = True
    while grew:  # a chain of the script's own classes resolves one link per pass
        grew = False
        for c in classes:
            base = next((out[called_name(b)] for b in c.bases if called_name(b) in out), None)
            if base is not None and c.name not in out:
                out[c.name], grew = base, True
    return out


class _Flow:
    """The script's parents, scopes and functions, to follow a value back to the from_pretrained calls it can
    hold."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.parent: dict[ast.AST, ast.AST] = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        self.calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)),
                            key=lambda n: (n.lineno, n.col_offset))
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.opaque: list[ast.Call] = []  # calls `resolve` met and could not follow, innermost first
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, node)

    def scope(self, node: ast.AST) -> ast.AST:
        """The function (or class, or the module) whose body holds `node`."""
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, _SCOPES):
                return node
        return self.tree

    def reachable(self, node: ast.AST, named: set[str]) -> bool:
        """Whether every function around `node` is named somewhere in the script (called, or handed on)."""
        scope = self.scope(node)
        while scope is not self.tree:
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef) and scope.name not in named:
                return False
            scope = self.scope(scope)
        return True

    def resolve(self, expr: ast.expr, use: ast.AST, index: int | None, depth: int) -> Found:
        """The model loads (from_pretrained, from_config) whose result `expr` (at `use`; `index`: the element of a
        tuple it was unpacked from) can hold, each with the last cast on its way (or None); None where it can hold
        anything else, or where that cannot be told. A call that cannot be followed is kept in `opaque`."""
        if depth > _DEPTH:
            return None
        if isinstance(expr, ast.Tuple) and index is not None and index < len(expr.elts):
            return self.resolve(expr.elts[index], use, None, depth + 1)
        if isinstance(expr, ast.Name):
            return self._name(expr.id, use, index, depth)
        if not isinstance(expr, ast.Call):
            return None
        name = called_name(expr.func)
        if name in ("from_pretrained", *FROM_CONFIG) and loads_model(expr):
            return {(expr, None)}
        if isinstance(expr.func, ast.Name) and name in self.functions:
            returns = [n for n in self._body(self.functions[name]) if isinstance(n, ast.Return) and n.value]
            return _union([self.resolve(r.value, r, index, depth + 1) for r in returns if r.value])
        if _is_cast(expr):  # the outermost cast runs last: it wins over any cast inside it
            inner = self.resolve(expr.func.value, use, index, depth + 1)  # type: ignore[attr-defined]
            return None if inner is None else {(load, expr) for load, _ in inner}
        if isinstance(expr.func, ast.Attribute) and name in _KEEPS:
            return self.resolve(expr.func.value, use, index, depth + 1)  # model.to(device): the same weights
        # a wrapper handed the model (get_peft_model(model, cfg), PeftModel.from_pretrained(model, path))
        arg = next((k.value for k in expr.keywords if k.arg == "model"), expr.args[0] if expr.args else None)
        if arg is None or name == "from_pretrained" and not owner_of(expr).startswith("PeftModel"):
            self.opaque.append(expr)  # build(), AutoConfig.from_pretrained(...): no model to follow
            return None
        mark = len(self.opaque)
        found = self.resolve(arg, expr, None, depth + 1)
        if found is None and len(self.opaque) > mark:
            self.opaque[mark:] = [expr]  # name the call the script makes, not what it was handed
        return found

    def trained(self, built: list[ast.Call], file: str) -> tuple[ast.Call | None, list[str]]:
        """Of the trainer calls `built`, the one whose `.train()` runs (`Trainer(...).train()`, or `t.train()` on
        a name bound to it), or the only one; None with where each is where several are and none (or more than one)
        is seen trained."""
        if len(built) <= 1:
            return (built[0] if built else None), []
        trained: list[ast.Call] = []
        for call in self.calls:
            if isinstance(call.func, ast.Attribute) and call.func.attr == "train":
                value = self._built(self.value_of(call.func.value, call), built)
                if value is not None and value not in trained:
                    trained.append(value)
        return (trained[0], []) if len(trained) == 1 else (None, [f"{file}:{c.lineno}" for c in built])

    def _built(self, value: ast.expr, built: list[ast.Call]) -> ast.Call | None:
        """The trainer call of `built` that `value` is: itself, or the one a script function it calls returns
        (`t = make_trainer(); t.train()`)."""
        if value in built:
            return value  # type: ignore[return-value]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in self.functions:
            returns = [self.value_of(n.value, n) for n in self._body(self.functions[value.func.id])
                       if isinstance(n, ast.Return) and n.value is not None]
            found = {id(r): r for r in returns if r in built}
            return next(iter(found.values())) if len(found) == 1 else None  # type: ignore[return-value]
        return None

    def value_of(self, expr: ast.expr, use: ast.AST) -> ast.expr:
        """`expr`, or for a name the value of its last assignment before `use` in its scope (else the module's)."""
        if not isinstance(expr, ast.Name):
            return expr
        for scope in (self.scope(use), self.tree):
            line = getattr(use, "lineno", 0) if scope is self.scope(use) else 1 << 30
            bound = [v for s, v, at in self._assigns(scope, expr.id) if s.lineno < line and at is None]
            if bound:
                return bound[-1]
        return expr

    def config_of(self, call: ast.Call) -> ast.Call | None:
        """The call that makes the config a from_config builds from: a config's from_pretrained (the checkpoint's
        config.json) or a config class (LlamaConfig(...)); None where it is made otherwise."""
        arg = next((k.value for k in call.keywords if k.arg == "config"), call.args[0] if call.args else None)
        value = self.value_of(arg, call) if arg is not None else None
        made = isinstance(value, ast.Call) and called_name(value.func).endswith(("Config", "from_pretrained"))
        return value if made else None

    def _name(self, name: str, use: ast.AST, index: int | None, depth: int) -> Found:
        """The values `name` can hold at `use`: its assignments before it in the same scope, back to the last one
        that runs whenever `use` does; the module's where the function assigns it nowhere (and takes no such
        parameter)."""
        scope = self.scope(use)
        line = getattr(use, "lineno", 0)
        above = {id(a) for a in self._ancestors(use)}
        found: list[Found] = []
        for stmt, value, at in reversed([a for a in self._assigns(scope, name) if a[0].lineno < line]):
            found.append(self.resolve(value, stmt, index if at is None else at, depth + 1))
            if id(self.parent.get(stmt)) in above:
                return _union(found)
        # no assignment runs whenever `use` does: a function may read the module's name (not a parameter's)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef) and \
                name not in {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}:
            glob = self._assigns(self.tree, name)
            if glob:
                return _union(found + [self.resolve(v, s, index if at is None else at, depth + 1)
                                       for s, v, at in glob])
        return None

    def _ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parent:
            node = self.parent[node]
            yield node

    def _body(self, scope: ast.AST) -> Iterator[ast.AST]:
        """The nodes of `scope`'s own body, not those of the functions or classes it defines."""
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, _SCOPES):
                stack.extend(ast.iter_child_nodes(node))

    def _assigns(self, scope: ast.AST, name: str) -> list[tuple[ast.stmt, ast.expr, int | None]]:
        """The statements of `scope` that bind `name` to a value, in order: each with the value and, for a
        tuple target (`model, tokenizer = ...`), the element `name` takes. A cast called on the name as a statement
        of its own (`model.half()`) counts as binding it to the cast: nn.Module's casts change the weights in
        place."""
        out = []
        for node in self._body(scope):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _is_cast(node.value) and \
                    isinstance(node.value.func, ast.Attribute) and called_name(node.value.func.value) == name and \
                    isinstance(node.value.func.value, ast.Name):
                out.append((node, node.value, None))
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name) and target.id == name:
                        out.append((node, node.value, None))
                    elif isinstance(target, ast.Tuple | ast.List):
                        out += [(node, node.value, i) for i, e in enumerate(target.elts)
                                if isinstance(e, ast.Name) and e.id == name]
        return sorted(out, key=lambda a: a[0].lineno)


def _union(found: list[Found]) -> Found:
    """The loads any of the values can hold; None where one of them can hold something else, or there are none."""
    if not found or any(f is None for f in found):
        return None
    return set().union(*found)  # type: ignore[arg-type]
