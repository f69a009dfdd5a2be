"""One GEMM's quantization inside a custom VJP: quantize with state, keys, statistics, the GEMM, cotangents.

``GemmQuant`` is what a functional op's forward and backward call for every
tensor they quantize and every GEMM they run; the helpers below turn what it
recorded into the cotangents of the op's state and parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax import lax

from te_jax.core.checks import check_key
from te_jax.core.bundles import BACKWARD_FIELDS, ROLE_OF, DenseQuantizers
from te_jax.core.remat import name_quantized
from te_jax.recipe.autocast import current as current_autocast
from te_jax.core.stats import Sample, primary_copy, tensor_stats
from te_jax.ops import gemm as gemm_ops
from te_jax.quantize.delayed import as_float32
from te_jax.spec.scaled_tensor import ScaledTensor
from te_jax.recipe import ROLES
from te_jax.ops.sharding import MeshResource, match_cotangent, reduce_amax, varying_axes
from te_jax.core.state_guard import check_state_update_applied


def mesh_resource_or_autocast(mesh_resource: MeshResource | None) -> MeshResource | None:
    """``mesh_resource``, or the active autocast's when None (the one place a functional op reads the autocast)."""
    return current_autocast().mesh_resource if mesh_resource is None else mesh_resource


class GemmQuant:
    """The quantizers of one GEMM inside a custom VJP, recording the state of stateful roles.

    Args:
      q: the GEMM's quantizers.
      state: role -> state of the stateful roles (float32 or max-merging leaves).
      key: raw PRNG key or None; role r draws from ``fold_in(key, ROLES.index(r))``.
      mesh_resource: the axes amaxes are reduced over and the GEMMs are partitioned by.
      inspect: None, or the rows (``te_jax.inspect.Sample``) each quantized
        tensor's statistics read, recorded in ``stats``; None leaves ``stats``
        None and computes nothing.
    """

    def __init__(self, q: DenseQuantizers, state: Mapping, key, mesh_resource: MeshResource | None,
                 inspect: Sample | None = None):
        self.q, self.key, self.mesh_resource = q, key, mesh_resource
        self.st = {r: as_float32(v) for r, v in state.items()}
        self.new: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        self.sample = inspect
        self.stats: dict[str, Any] | None = {} if inspect else None

    @classmethod
    def backward(cls, q: DenseQuantizers, state: Mapping, key, mesh_resource: MeshResource | None,
                 inspect: Sample | None, where: str) -> GemmQuant:
        """The GemmQuant of a backward pass: first checks that the gradient roles have the key they need."""
        if key is None:
            check_key(q, BACKWARD_FIELDS, where)
        return cls(q, state, key, mesh_resource, inspect)

    def has(self, field: str) -> bool:
        """Whether the role of ``field`` ("input", "weight", ...) has a quantizer."""
        return getattr(self.q, field) is not None

    def run(self, field: str, fn: Callable, reference: jax.Array | Callable[[slice], jax.Array] | None = None):
        """``fn(quantizer, state, key) -> (ScaledTensor, *extras)``, recording the amax for stateful roles.

        The ScaledTensor is named ``QUANTIZED`` before anything reads it (the
        state update too), so a remat policy that saves it never reruns ``fn``.
        When inspecting, the statistics compare the quantized tensor with
        ``reference``: the high-precision tensor itself, or, for a fused
        kernel's output, a function that takes a row slice and returns those
        rows of the tensor (float32, ``[M', N]``), recomputed by the pure-JAX
        twin (bit-identical to the fused kernel) for just the rows the
        statistics read, where XLA fuses it into their reductions instead of
        writing and re-reading a float32 copy.
        """
        role, qz = ROLE_OF[field], getattr(self.q, field)
        key = None if self.key is None else jax.random.fold_in(self.key, ROLES.index(role))
        out = fn(qz, self.st.get(role), key)
        out = (name_quantized(out[0]), *out[1:])
        if self.stats is not None:
            self.stats[role] = tensor_stats(reference, out[0], primary_copy(role), self.sample)
        if role in self.st:
            amax = out[0].amax
            if amax is None:
                raise ValueError(f"te_jax: the stateful quantizer of {role} returned a ScaledTensor without amax")
            if getattr(qz, "reduce_amax", False):
                amax = reduce_amax(amax, getattr(qz, "amax_reduction", "max"), self.mesh_resource)
            self.new[role] = qz.update_state(self.st[role], amax)
            self.grads[role] = qz.state_gradient(self.st[role], amax) if hasattr(qz, "state_gradient") \
                else self.new[role]
        return out

    def quantize(self, field: str, x, *, rowwise=True, colwise=False, flatten_axis=-1):
        """``x`` quantized by the role's quantizer, or ``x`` itself when it has none."""
        if not self.has(field):
            return x
        return self.run(field, lambda qz, st, key: (qz.quantize(x, st, rowwise=rowwise, colwise=colwise,
                                                                flatten_axis=flatten_axis, key=key),),
                        x)[0]

    def qdq(self, field: str, y, flatten_axis=-1):
        """Quantize-dequantize of a GEMM output (linear_output, linear_grad_input); ``y`` itself without a quantizer."""
        t = self.quantize(field, y, flatten_axis=flatten_axis)
        return dequantize(t, y.dtype) if isinstance(t, ScaledTensor) else t

    def gemm(self, a, b, dims, *, out_dtype, bias=None, fast_accum: bool | None):
        """``te_jax.ops.gemm.gemm`` for this GEMM: every GEMM of the functional ops runs through here.

        The primitive takes its sharding plan's mesh axes from
        ``self.mesh_resource`` (the op's, or the autocast's when the op was
        given none), the same in the forward and the backward.
        """
        return gemm_ops.gemm(a, b, dims, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum,
                             autotune=self.q.autotune, mesh_resource=self.mesh_resource)

    def new_state(self) -> dict[str, Any]:
        """The forward-updated state of every stateful role."""
        return {r: self.new.get(r, v) for r, v in self.st.items()}


def keep(t, copy: str):
    """Only the ``copy`` ("rowwise" or "colwise") of a ScaledTensor, for the residuals."""
    if not isinstance(t, ScaledTensor):
        return t
    if copy == "colwise":
        return dataclasses.replace(t, data=None, scale_inv=None)
    return dataclasses.replace(t, colwise_data=None, colwise_scale_inv=None)


def state_leaves(states: Mapping[str, Mapping]) -> tuple:
    """Static ``((role, ((leaf name, dtype, varying axes), ...)), ...)`` of the incoming role states."""
    return tuple((r, tuple((n, v.dtype, varying_axes(v)) for n, v in sorted(states[r].items())))
                 for r in sorted(states))


def state_cotangent(leaves: tuple, grads: Mapping, all_vary) -> dict[str, dict]:
    """The state updates as the cotangent of the incoming state (its leaf dtypes and varying axes).

    ``leaves`` is ``state_leaves`` of the incoming state, ``grads`` the
    ``GemmQuant.grads`` of forward and backward merged. In shard_map each leaf
    is reduced by max over the axes it does not vary over (identical where the
    amaxes were reduced already). Raises ``te_jax.core.state_guard.FP8StateError``
    when the caller did not declare that it applies the update.
    """
    check_state_update_applied([role for role, _ in leaves])
    return {role: {name: lax.convert_element_type(match_cotangent(grads[role][name], all_vary, vary, "max"), dtype)
                   for name, dtype, vary in names}
            for role, names in leaves}


def cotangent(ct, all_vary, vary):
    """``ct`` in shard_map's varying-axes type, reduced over the axes its primal does not vary over (None passes)."""
    return None if ct is None else match_cotangent(ct, all_vary, vary)


def vary_of(*xs) -> tuple:
    """The varying axes (shard_map) of each array (empty for None)."""
    return tuple(frozenset() if x is None else varying_axes(x) for x in xs)
