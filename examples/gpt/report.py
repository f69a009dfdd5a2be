"""Progress bar, TensorBoard logs and the loss-curve plot; each optional dependency degrades with a message.

* ``Progress``: a tqdm bar when tqdm is installed, else a log line per update.
* ``make_writer``: TensorBoard scalars through tensorboardX, or TensorFlow's
  summary writer (``flax.metrics.tensorboard``); None, with a message, when
  neither is installed.
* ``plot_curves``: train and eval loss per recipe in one PNG (matplotlib, Agg).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

INSTALL_HINT = 'pip install -e ".[examples]"  (tqdm, matplotlib, orbax-checkpoint)'


class Progress:
    """Iterates like ``tqdm(iterable)``; without tqdm (or when disabled) prints a line per postfix update."""

    def __init__(self, iterable, *, enabled=True, desc="", total=None, initial=0):
        self._bar = None
        self._iterable = iterable
        self._desc, self._total, self._t0 = desc, total, time.perf_counter()
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print(f"(no progress bar: tqdm is not installed; {INSTALL_HINT})", file=sys.stderr)
            else:
                self._bar = tqdm(iterable, desc=desc, total=total, initial=initial, dynamic_ncols=True,
                                 mininterval=0.5)
        self._step = initial

    def __iter__(self):
        for item in self._bar if self._bar is not None else self._iterable:
            self._step = item + 1 if isinstance(item, int) else self._step + 1
            yield item

    def set_postfix(self, values: dict) -> None:
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)
        else:
            fields = "  ".join(f"{k} {v}" for k, v in values.items())
            print(f"{self._desc} step {self._step}/{self._total}  {fields}  "
                  f"({time.perf_counter() - self._t0:.0f} s)", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Writer:
    """``scalar(tag, value, step)`` over whichever summary writer was found."""

    def __init__(self, scalar, flush, close):
        self.scalar, self.flush, self._close = scalar, flush, close

    def close(self):
        self.flush()
        self._close()


def make_writer(logdir: str, run_name: str) -> _Writer | None:
    """A TensorBoard writer for ``logdir/run_name``, or None (with a message) when none is installed."""
    path = str(Path(logdir) / run_name)
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        pass
    else:
        w = SummaryWriter(path)
        return _Writer(lambda tag, value, step: w.add_scalar(tag, value, step), w.flush, w.close)
    try:
        from flax.metrics import tensorboard  # needs tensorflow
    except ImportError:
        pass
    else:
        w = tensorboard.SummaryWriter(path)
        return _Writer(w.scalar, w.flush, w.close)
    print("--tensorboard: no summary writer found; install one (pip install tensorboardX, or tensorflow) to get "
          "TensorBoard logs. Training continues without them.", file=sys.stderr)
    return None


def smooth(values, weight: float = 0.9) -> np.ndarray:
    """Exponential moving average (bias-corrected), as TensorBoard draws it."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return np.asarray(out)


def plot_curves(results: list[dict], path: str | Path) -> Path | None:
    """Train (smoothed) and eval loss against step, one colour per recipe; returns the PNG's path."""
    try:
        import matplotlib
    except ImportError:
        print(f"(no plot: matplotlib is not installed; {INSTALL_HINT})", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(results):
        h, color = r["history"], f"C{i}"
        if h["loss"]:
            ax_train.plot(h["step"], h["loss"], color=color, alpha=0.2, linewidth=0.8)
            weight = min(0.9, max(0.0, 1 - 10 / len(h["loss"])))  # lighter smoothing for short runs
            ax_train.plot(h["step"], smooth(h["loss"], weight), color=color, label=r["recipe"])
        if h["eval_loss"]:
            ax_eval.plot(h["eval_step"], h["eval_loss"], "o-", color=color, label=r["recipe"])
    first = results[0] if results else {}
    title = f"{first.get('preset', '')} model ({first.get('params', 0) / 1e6:.2f}M params), {first.get('backend', '')}"
    for ax, name in ((ax_train, "train loss (smoothed)"), (ax_eval, "held-out loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.resolve()
