"""Byte-level text data: Python's own standard library by default, or any text file.

Tokens are bytes (vocabulary 256), so there is no tokenizer to download. The
default corpus is the ``.py`` source of the running interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``, without site-packages), read in
sorted path order up to a size cap; every 20th file is held out for
evaluation. ``--data FILE`` trains on any file instead, holding out its last
5%.

Batches are a pure function of ``(seed, step)``, so a run resumed from a
checkpoint sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 256
EVAL_EVERY_NTH_FILE = 20
EVAL_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and held-out token streams (uint8 arrays) and where they came from."""

    train: np.ndarray
    eval: np.ndarray
    source: str

    def describe(self) -> str:
        return f"{self.source}: {len(self.train) / 1e6:.2f}M train / {len(self.eval) / 1e6:.2f}M held-out bytes"


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted by path relative to ``root`` (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_stdlib(max_bytes: int = 16 << 20, root: str | Path | None = None) -> Corpus:
    """The stdlib corpus, reading files in order until ``max_bytes`` are read; every 20th file held out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, held, total = [], [], 0
    for i, path in enumerate(stdlib_files(root)):
        if total >= max_bytes:
            break
        text = path.read_bytes()[: max_bytes - total]
        total += len(text)
        (held if i % EVAL_EVERY_NTH_FILE == EVAL_EVERY_NTH_FILE // 2 else train).append(text)
    if not train or not held:
        raise ValueError(f"no Python sources found under {root}; pass --data FILE")
    return Corpus(_tokens(b"\n".join(train)), _tokens(b"\n".join(held)), f"Python {sysconfig.get_python_version()} "
                  f"stdlib ({root})")


def load_file(path: str | Path, max_bytes: int | None = None) -> Corpus:
    """Any file as bytes; the last 5% is held out."""
    data = Path(path).read_bytes()[:max_bytes]
    if len(data) < 1024:
        raise ValueError(f"{path}: only {len(data)} bytes; need at least 1 KiB of text")
    cut = int(len(data) * (1 - EVAL_FRACTION))
    return Corpus(_tokens(data[:cut]), _tokens(data[cut:]), str(path))


def load(data: str | None = None, max_bytes: int = 16 << 20) -> Corpus:
    """``load_file(data)`` when a path is given, else the stdlib corpus."""
    return load_file(data, max_bytes) if data else load_stdlib(max_bytes)


def _tokens(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).copy()


def check_seq_len(corpus: Corpus, seq_len: int) -> None:
    """Raises ValueError when the training or held-out text is too short for one window of ``seq_len``."""
    _check_length(corpus.train, "training", seq_len)
    _check_length(corpus.eval, "held-out", seq_len)


def _check_length(stream: np.ndarray, name: str, seq_len: int) -> None:
    if len(stream) <= seq_len + 1:
        raise ValueError(f"the {name} text ({len(stream)} bytes) is shorter than --seq-len + 2 ({seq_len + 2})")


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return stream[idx].astype(np.int32)


def train_batch(corpus: Corpus, step: int, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """int32[batch, seq_len + 1]: random windows of the train stream, determined by (seed, step)."""
    _check_length(corpus.train, "training", seq_len)
    rng = np.random.default_rng([seed, step])
    return _windows(corpus.train, rng.integers(0, len(corpus.train) - seq_len - 1, size=batch), seq_len)


def eval_batches(corpus: Corpus, num_batches: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """Fixed held-out batches: evenly spaced windows of the held-out stream (the same for every run)."""
    n = num_batches * batch
    _check_length(corpus.eval, "held-out", seq_len)
    starts = np.linspace(0, len(corpus.eval) - seq_len - 1, n).astype(np.int64)
    windows = _windows(corpus.eval, starts, seq_len)
    return [windows[i * batch:(i + 1) * batch] for i in range(num_batches)]
