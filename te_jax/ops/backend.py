"""Which implementation the ops run: the FFI kernels (default) or the pure-JAX reference.

The choice is made at trace time, per call (``backend=`` on every op) or for a
block of code::

    with te_jax.ops.backend.use("reference"):
        y = jax.jit(f)(x)

The setting is part of jit's cache key, so a function already compiled with
the kernels is traced again inside the block. The reference is the spec the
kernels are tested against; it is slower, and it is never picked silently.
"""

from __future__ import annotations

import jax

BACKENDS = ("ffi", "reference")
_current = jax.make_user_context(default_value="ffi")


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown te_jax backend {name!r}; choose one of {BACKENDS}")
    return name


def use(name: str):
    """Context manager: ops traced inside it use backend ``name`` ("ffi" or "reference")."""
    return _current(_check(name))


def current() -> str:
    return _current.value


def resolve(backend: str | None) -> str:
    """The backend for one call: the explicit argument, else the context's."""
    return _current.value if backend is None else _check(backend)
