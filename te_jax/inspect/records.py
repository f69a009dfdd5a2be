"""Statistics trees as flat rows, and the plain-text tables the CLI prints.

A statistics tree is what the "fp8_stats" collection (or its gradient) holds:
nested dicts of module names ending in ``{role: {stat: value}}``; under
``nn.scan`` every value has the scanned axes in front. ``to_rows`` turns it
into one dict per quantized tensor::

    {"layer": "TransformerLayer_0/mlp/wi", "role": "linear_input", "amax": 3.2, ..., **extra}

(a scanned layer ``layers/dense`` becomes ``layers/dense[0]``, ``[1]``, ...).
An NNX model's statistics, ``nnx.state(model, te_jax.nnx.FP8Stats)``, give
the same rows, named by the layers' paths in the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx

from te_jax.core.stats import COUNTED, STAT_NAMES, STATS_COLLECTION
from te_jax.recipe import ROLES

Row = dict[str, Any]
KEY = ("layer", "role")


def role_order(role: str) -> tuple[int, str]:
    return (ROLES.index(role) if role in ROLES else len(ROLES), role)


def _is_role_stats(node: Any) -> bool:
    return isinstance(node, Mapping) and bool(node) and set(node) <= set(STAT_NAMES)


def _as_tree(node: Any) -> Any:
    """Nested dicts from a statistics tree or an NNX state: each ``nnx.Variable`` (``FP8Stats``) replaced by its
    value, and an NNX layer's attribute "fp8_stats" dropped from the path (its entries are the layer's)."""
    if isinstance(node, nnx.Variable):
        node = node.get_value()
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for name, child in node.items():
        child = _as_tree(child)
        if name == STATS_COLLECTION and isinstance(child, Mapping):
            out.update(child)
        else:
            out[str(name)] = child
    return out


def to_rows(stats: Mapping, **extra: Any) -> list[Row]:
    """One row per (layer, role) of a statistics tree (host values; call outside jit).

    Args:
      stats: the "fp8_stats" tree, e.g. ``grads["fp8_stats"]``; or an NNX
        model's ``nnx.state(model, te_jax.nnx.FP8Stats)`` (or its
        ``nnx.to_pure_dict``), whose rows are named by the layers' paths.
      extra: fields added to every row (e.g. ``step=10, recipe="mxfp8"``).
    """
    rows: list[Row] = []
    stats = _as_tree(stats)

    def walk(node: Mapping, path: tuple[str, ...]) -> None:
        roles = sorted((n for n, c in node.items() if _is_role_stats(c)), key=role_order)
        if roles:
            values = {r: {k: np.asarray(v, np.float64) for k, v in node[r].items()} for r in roles}
            shape = np.shape(next(iter(values[roles[0]].values())))
            for index in np.ndindex(*shape):
                layer = "/".join(path) + (f"[{','.join(map(str, index))}]" if index else "")
                for r in roles:
                    rows.append({"layer": layer, "role": str(r),
                                 **{k: float(values[r][k][index]) for k in STAT_NAMES if k in values[r]}, **extra})
        for name in sorted(node):
            if name not in roles and isinstance(node[name], Mapping):
                walk(node[name], path + (str(name),))

    walk(stats, ())
    found = _leaf_names(stats) if not rows and isinstance(stats, Mapping) else set()
    if found:
        raise ValueError("te_jax: inspect.to_rows: the tree holds no statistics (amax, ... per role), only "
                         f"{sorted(found)[:6]}: it reads the 'fp8_stats' collection of a model run "
                         "with inspect=True (grads['fp8_stats']), or nnx.state(model, te_jax.nnx.FP8Stats); FP8 "
                         "state (FP8Meta, the 'fp8_meta' collection) has no statistics")
    return rows


def _leaf_names(node: Any) -> set[str]:
    """The names of a nested mapping's leaves that hold a value."""
    names: set[str] = set()
    for name, child in node.items():
        if isinstance(child, Mapping):
            names |= _leaf_names(child)
        elif child is not None:
            names.add(str(name))
    return names


def mean_over(rows: Iterable[Row], by: Sequence[str] = KEY) -> list[Row]:
    """Rows with the same ``by`` fields averaged (e.g. over steps), in first-seen order.

    ``skipped_update`` (``te_jax.core.stats.COUNTED``) is summed instead: the
    number of steps whose delayed-scaling update of that tensor was skipped.
    """
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    out = []
    for key, group in groups.items():
        row = dict(zip(by, key))
        for name in STAT_NAMES:
            values = [g[name] for g in group if name in g]
            if values:
                row[name] = float(np.sum(values) if name in COUNTED else np.mean(values))
        out.append(row)
    return out


def merge_max(a: Mapping, b: Mapping) -> dict:
    """Two statistics trees merged elementwise by max (as two uses of one layer are)."""
    return {k: merge_max(v, b[k]) if isinstance(v, Mapping) else np.maximum(np.asarray(v), np.asarray(b[k]))
            for k, v in a.items()}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def render(header: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [list(map(str, header))] + [[_fmt(v) for v in row] for row in body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(rows: Sequence[Row], stats: Sequence[str] = STAT_NAMES, sort: str | None = None) -> str:
    """One recipe's statistics per (layer, role); ``sort`` names a stat to rank by (descending)."""
    rows = sorted(rows, key=lambda r: -r.get(sort, 0.0)) if sort else list(rows)
    return render(("layer / role", *stats), [(f"{r['layer']} {r['role']}", *(r.get(s, float("nan")) for s in stats))
                                             for r in rows])


def compare_table(by_recipe: Mapping[str, Sequence[Row]], stat: str = "rel_error") -> str:
    """``stat`` per (layer, role), one column per recipe, the lowest marked, and a mean row."""
    if stat not in STAT_NAMES:
        raise ValueError(f"te_jax.inspect: unknown statistic {stat!r}; choose from {STAT_NAMES}")
    names = list(by_recipe)
    values: dict[tuple, dict[str, float]] = {}
    for name in names:
        for r in by_recipe[name]:
            values.setdefault((r["layer"], r["role"]), {})[name] = r[stat]
    body = []
    for (layer, role), per in values.items():
        present = {n: v for n, v in per.items() if np.isfinite(v)}
        best = min(present, key=present.get) if present else "-"
        body.append((f"{layer} {role}", *(per.get(n, "-") for n in names), best))
    means = [float(np.mean([per[n] for per in values.values() if n in per])) if any(n in per for per in values.values())
             else "-" for n in names]
    body.append((f"mean over tensors ({stat})", *means, ""))
    return render(("layer / role", *names, "lowest"), body)
