"""Which implementation the ops run: the FFI kernels (default) or the pure-JAX reference.

The choice is made at trace time, per call (``backend=`` on every op) or for a
block of code::

    with te_jax.backend.use("reference"):
        y = jax.jit(f)(x)   # traced here, so it uses the reference

The reference is the spec the kernels are tested against; it is slower, and
it is never picked silently.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

BACKENDS = ("ffi", "reference")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("te_jax_backend", default="ffi")


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown te_jax backend {name!r}; choose one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Makes ops traced inside this block use backend ``name`` ("ffi" or "reference")."""
    token = _current.set(_check(name))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str:
    return _current.get()


def resolve(backend: str | None) -> str:
    """The backend for one call: the explicit argument, else the context's."""
    return _current.get() if backend is None else _check(backend)
