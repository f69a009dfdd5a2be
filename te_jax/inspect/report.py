"""A PNG report (matplotlib): tensors ranked by quantization error, and two recipes compared layer by layer.

::

    te_jax.inspect.report.plot_report({"mxfp8": rows_a, "nvfp4": rows_b}, "report.png")

Panels: (1) the first recipe's tensors ranked by ``stat`` (default
``rel_error``), coloured by role; (2) with two or more recipes, the first two
side by side for every tensor (log scale), in the same order; (3) each
recipe's mean ``stat`` per role. matplotlib is optional (the ``examples``
extra); without it ``plot_report`` raises ImportError saying what to install.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from te_jax.inspect.records import Row, role_order
from te_jax.core.stats import STAT_NAMES

INSTALL_HINT = 'pip install matplotlib  (or pip install -e ".[examples]")'
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _figure(n_panels: int, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"te_jax.inspect.report needs matplotlib: {INSTALL_HINT}") from None
    fig = Figure(figsize=(7.5 * n_panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _values(rows: Sequence[Row], stat: str) -> dict[tuple[str, str], float]:
    return {(r["layer"], r["role"]): float(r.get(stat, np.nan)) for r in rows}


def plot_report(by_recipe: Mapping[str, Sequence[Row]], path: str | Path, stat: str = "rel_error",
                top: int = 40) -> Path:
    """Writes the report PNG and returns its path.

    Args:
      by_recipe: recipe name -> rows (``te_jax.inspect.to_rows``, e.g. averaged
        over steps with ``mean_over``); the first recipe is ranked, the first
        two are compared.
      path: the PNG.
      stat: the statistic ranked and compared (one of ``STAT_NAMES``).
      top: at most this many tensors in the ranking panels (the worst ones).
    """
    if stat not in STAT_NAMES:
        raise ValueError(f"te_jax.inspect: unknown statistic {stat!r}; choose from {STAT_NAMES}")
    if not by_recipe or not any(by_recipe.values()):
        raise ValueError("te_jax.inspect: no statistics to plot (was the step run with autocast(inspect=True)?)")
    names = list(by_recipe)
    first = _values(by_recipe[names[0]], stat)
    ranked = sorted(first, key=lambda k: -np.nan_to_num(first[k], nan=-1.0))[:top]
    roles = sorted({k[1] for k in first}, key=role_order)
    role_color = {r: _COLORS[i % len(_COLORS)] for i, r in enumerate(roles)}
    n_panels = 3 if len(names) > 1 else 2
    fig = _figure(n_panels, max(4.0, 0.22 * len(ranked) + 1.5))
    from matplotlib.patches import Patch

    axes = fig.subplots(1, n_panels)
    labels = [f"{layer} {role.removeprefix('linear_')}" for layer, role in ranked]
    y = np.arange(len(ranked))

    ax = axes[0]
    ax.barh(y, [first[k] for k in ranked], color=[role_color[k[1]] for k in ranked])
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(stat)
    ax.set_title(f"{names[0]}: tensors ranked by {stat}")
    ax.set_xlim(left=0)
    ax.legend(handles=[Patch(color=role_color[r], label=r) for r in roles], fontsize=7, loc="lower right")

    if len(names) > 1:
        second = _values(by_recipe[names[1]], stat)
        ax = axes[1]
        h = 0.4
        ax.barh(y - h / 2, [first[k] for k in ranked], h, label=names[0], color=_COLORS[0])
        ax.barh(y + h / 2, [second.get(k, np.nan) for k in ranked], h, label=names[1], color=_COLORS[1])
        ax.set_yticks(y, labels, fontsize=7)
        ax.invert_yaxis()
        if all(v > 0 for v in [*first.values(), *second.values()] if np.isfinite(v)):
            ax.set_xscale("log")
        ax.set_xlabel(stat)
        ax.set_title(f"{names[0]} vs {names[1]}, layer by layer")
        ax.legend(fontsize=7)

    ax = axes[-1]
    width = 0.8 / len(names)
    x = np.arange(len(roles))
    for i, name in enumerate(names):
        values = _values(by_recipe[name], stat)
        means = [np.nanmean([v for k, v in values.items() if k[1] == r] or [np.nan]) for r in roles]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, means, width, label=name, color=_COLORS[i % len(_COLORS)])
    ax.set_xticks(x, [r.removeprefix("linear_") for r in roles], fontsize=8)
    ax.set_ylabel(f"mean {stat}")
    ax.set_title(f"mean {stat} per role")
    ax.legend(fontsize=7)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
