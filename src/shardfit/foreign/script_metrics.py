"""Which metric arguments the trainer call that trains passes (script_ast.py `read_script`): whether its
evaluation keeps the logits (compute_metrics without preprocess_logits_for_metrics; trainer_eval.py). Read from the
syntax tree, never run."""

from __future__ import annotations

import ast

from shardfit.foreign.script_loads import called_name

# The Trainer's metric arguments: compute_metrics keeps the logits, preprocess_logits_for_metrics reduces them.
METRIC_KEYS = ("compute_metrics", "preprocess_logits_for_metrics")
# How many leading positional arguments of a trainer call (TRAINER_CLASSES) say nothing of the metrics (model,
# args, data_collator, train_dataset, eval_dataset: the same in each).
_LEADING = 5


def call_metrics(tree: ast.Module, call: ast.Call | None, file: str, untold: list[str]) -> tuple[frozenset[str],
                                                                                                  str | None]:
    """(the METRIC_KEYS the trainer `call` that trains gives a value other than None, why that cannot be told or
    None): read from the call's syntax tree, as keywords, `**{...}` and `**dict(...)` literals, or `**name` for a
    name bound once to such a literal (its `name["key"] = ...` items added); `trainer.compute_metrics = ...` counts
    too where `trainer` is bound to the call. Comments, strings and other calls' keywords do not. `call` is None
    where the script builds no trainer, or several of which none is seen trained (`untold`: where they are)."""
    if call is None:
        return frozenset(), (f"which of the trainers at {', '.join(untold)} trains cannot be told" if untold
                             else f"no Trainer call found in {file}")
    at = f"{file}:{call.lineno}"
    if len(call.args) > _LEADING or any(isinstance(a, ast.Starred) for a in call.args):
        return frozenset(), f"{at} passes its trainer arguments by position"
    given = {k.arg for k in call.keywords if k.arg in METRIC_KEYS and not _is_none(k.value)}
    for unpacked in (k.value for k in call.keywords if k.arg is None):
        keys = _mapping_keys(unpacked, tree)
        if keys is None:
            return frozenset(), f"{at} passes its trainer arguments in **{ast.unparse(unpacked)}, which is not read"
        given |= keys & set(METRIC_KEYS)
    # `trainer.compute_metrics = ...` on a name bound to this call (not on another trainer or object)
    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.value is call
             for t in n.targets if isinstance(t, ast.Name)}
    given |= {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) and not _is_none(n.value)
              for t in n.targets if isinstance(t, ast.Attribute) and t.attr in METRIC_KEYS
              and isinstance(t.value, ast.Name) and t.value.id in bound}
    return frozenset(given), None


def _mapping_keys(node: ast.expr, tree: ast.Module) -> set[str] | None:
    """The keys a `**` mapping gives a value other than None: a dict literal with string keys, dict(k=v, ...), or a
    name bound exactly once to one of them (with its `name["k"] = v` items); None where that cannot be read."""
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return None  # a `**` inside the literal, or a computed key
        return {k.value for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and not _is_none(v)}
    if isinstance(node, ast.Call) and called_name(node.func) == "dict":
        if node.args or any(k.arg is None for k in node.keywords):
            return None
        return {k.arg for k in node.keywords if k.arg and not _is_none(k.value)}
    if not isinstance(node, ast.Name):
        return None
    bound = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign)
             and any(isinstance(t, ast.Name) and t.id == node.id for t in _targets(n))]
    changed = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and called_name(n.func.value) == node.id
                  and n.func.attr in ("update", "setdefault", "pop", "__setitem__") for n in ast.walk(tree))
    keys = _mapping_keys(bound[0], tree) if len(bound) == 1 and bound[0] is not None and not changed else None
    if keys is None:
        return None
    for n in ast.walk(tree):
        for t in _targets(n) if isinstance(n, ast.Assign) else []:
            if isinstance(t, ast.Subscript) and called_name(t.value) == node.id:
                if not (isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                    return None
                keys = keys | {t.slice.value} if not _is_none(n.value) else keys - {t.slice.value}
    return keys


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment binds."""
    if isinstance(node, ast.Assign):
        return list(node.targets)
    return [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None
