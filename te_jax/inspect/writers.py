"""Writers of statistics rows: a JSON lines file (stdlib) and TensorBoard scalars and histograms.

Both take a statistics tree (``grads["fp8_stats"]``) or rows from
``te_jax.inspect.to_rows``, once per logged step::

    with JsonlWriter("stats.jsonl") as w:
        w.write(grads["fp8_stats"], step=step, recipe="mxfp8")
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from te_jax.inspect.records import Row, to_rows
from te_jax.core.stats import STAT_NAMES

TENSORBOARD_HINT = "pip install tensorboardX  (or tensorflow, for flax.metrics.tensorboard)"


def _rows(stats_or_rows: Mapping | Sequence[Row], **extra: Any) -> list[Row]:
    if isinstance(stats_or_rows, Mapping):
        return to_rows(stats_or_rows, **extra)
    return [{**r, **extra} for r in stats_or_rows]


class JsonlWriter:
    """Appends one JSON object per (step, layer, role) to ``path``.

    Args:
      path: the file; its directory is created.
      append: keep what the file holds (False: start it afresh).
    """

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w")

    def write(self, stats_or_rows: Mapping | Sequence[Row], **extra: Any) -> list[Row]:
        """Writes the rows (with ``extra`` fields, e.g. ``step=...``) and returns them."""
        rows = _rows(stats_or_rows, **extra)
        for r in rows:
            self._file.write(json.dumps(r, allow_nan=True) + "\n")
        self._file.flush()
        return rows

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[Row]:
    """The rows of a file ``JsonlWriter`` wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TensorBoardWriter:
    """TensorBoard scalars ``<stat>/<layer>/<role>`` and histograms ``<stat>/<role>`` (over the layers).

    Uses tensorboardX, else TensorFlow's writer (``flax.metrics.tensorboard``);
    raises ImportError saying what to install when neither is there.
    """

    def __init__(self, logdir: str | Path):
        logdir = str(logdir)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from flax.metrics.tensorboard import SummaryWriter as FlaxWriter  # needs tensorflow
            except ImportError:
                raise ImportError(f"te_jax.inspect.TensorBoardWriter needs tensorboardX or tensorflow: "
                                  f"{TENSORBOARD_HINT}") from None
            w = FlaxWriter(logdir)
            self._scalar, self._hist = w.scalar, lambda tag, values, step: w.histogram(tag, values, step)
            self._flush, self._close = w.flush, w.close
        else:
            w = SummaryWriter(logdir)
            self._scalar = lambda tag, value, step: w.add_scalar(tag, value, step)
            self._hist = lambda tag, values, step: w.add_histogram(tag, values, step)
            self._flush, self._close = w.flush, w.close

    def write(self, stats_or_rows: Mapping | Sequence[Row], step: int) -> list[Row]:
        import numpy as np

        rows = _rows(stats_or_rows)
        for r in rows:
            for name in STAT_NAMES:
                if name in r:
                    self._scalar(f"{name}/{r['layer']}/{r['role']}", r[name], step)
        for role in sorted({r["role"] for r in rows}):
            for name in STAT_NAMES:
                values = [r[name] for r in rows if r["role"] == role and name in r]
                if values:
                    self._hist(f"{name}/{role}", np.asarray(values, np.float64), step)
        self._flush()
        return rows

    def close(self) -> None:
        self._flush()
        self._close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
