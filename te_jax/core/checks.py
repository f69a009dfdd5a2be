"""Trace-time checks every functional op runs, written once so a mistake gets the same error everywhere.

Each message starts ``te_jax: <where>:``, where ``where`` names the op (and
the GEMM, e.g. ``layernorm_mlp (wi)``); the rest is the same for the same mistake.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from te_jax.core.bundles import FORWARD_FIELDS, ROLE_OF, DenseQuantizers

HIGH_PRECISION = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_high_precision(where: str, **arrays) -> None:
    """Every array given (None skipped) must be float32, bfloat16 or float16."""
    for name, a in arrays.items():
        if a is not None and jnp.dtype(a.dtype) not in HIGH_PRECISION:
            raise TypeError(f"te_jax: {where}: {name} must be float32, bfloat16 or float16, got {a.dtype}")


def check_no_dot_general(where: str, dot_general, quantized: bool) -> None:
    """A custom ``dot_general`` serves the unquantized path only (te_jax's GEMMs replace it under a recipe)."""
    if dot_general is not None and quantized:
        raise ValueError(f"te_jax: {where}: a custom dot_general cannot be combined with quantizers (te_jax's "
                         "quantized GEMMs replace it); drop one of them")


def contracting_axes(dims, ndim: int, what: str, where: str) -> tuple[int, ...]:
    """``dims`` (an int or ints, negative allowed) as distinct non-negative axes of a rank-``ndim`` array."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    out = tuple(d % ndim for d in dims if -ndim <= d < ndim)
    if len(out) != len(dims) or len(set(out)) != len(out):
        raise ValueError(f"te_jax: {where}: {what} contracting dims {dims} are not distinct axes of a "
                         f"rank-{ndim} array")
    return out


def check_state(q: DenseQuantizers, state: Mapping | None, where: str) -> dict[str, Any]:
    """The states of ``q``'s stateful roles, checked (missing or malformed ones raise a clear error)."""
    stateful, state = q.stateful(), dict(state or {})
    missing = [r for r in stateful if r not in state]
    if missing:
        raise ValueError(f"te_jax: {where}: no state for the stateful quantizers of {missing}; pass "
                         "state=quantizers.init_state() (Flax layers: init the model under te_jax.autocast)")
    for r, qr in stateful.items():
        if hasattr(qr, "check_state"):
            qr.check_state(state[r])
    return {r: dict(state[r]) for r in stateful}


def check_key(q: DenseQuantizers, fields, where: str) -> None:
    """Raises when a quantizer of ``fields`` rounds stochastically (it needs a key and none was given)."""
    needy = [ROLE_OF[f] for f in fields if getattr(getattr(q, f), "stochastic_rounding", False)]
    if needy:
        raise ValueError(
            f"te_jax: {where}: the quantizers of {needy} round stochastically and need key=<a PRNG key that "
            "changes every step> (Flax layers: apply with rngs={'quantize': key}); or disable it, e.g. "
            "NVFP4BlockScaling(disable_stochastic_rounding=True)")


def check_gemm(q: DenseQuantizers, state: Mapping | None, key, where: str) -> dict[str, Any]:
    """The checks of one quantized GEMM, in one order: state, forward key.

    Every shape is accepted: block-scaled quantizers give a partial block its
    own scale and the GEMM zero pads the contraction axis.
    Returns the states of the stateful roles (``check_state``). The backward
    roles' key is checked when the backward is traced (``GemmQuant``).
    """
    inner = check_state(q, state, where)
    if key is None:
        check_key(q, FORWARD_FIELDS, where)
    return inner


def raw_key(key: jax.Array | None) -> jax.Array | None:
    """A typed PRNG key as its raw uint32 data (what ``jax.random.fold_in`` inside a custom VJP takes)."""
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key
