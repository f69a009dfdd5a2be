"""The custom-call primitive base: a primitive lowered per platform, partitioned, batched.

Every te_jax custom call is built from two pieces (the idea of
TransformerEngine-JAX's ``BasePrimitive``, with te_jax's explicit errors):
``CustomCallPrimitive``, a JAX primitive with an abstract eval, a compiled
eager implementation, an FFI lowering per platform and an optional batching
rule; and ``Partitioned``, a per-device function under ``custom_partitioning``
(Shardy ``sharding_rule``, ``infer`` and ``partition`` hooks, the partitioned
body traced with no mesh: ``device_local``) and, optionally, ``custom_vmap``.
Under a mesh with Explicit axes a ``Partitioned`` call's results are typed with
the shardings its ``infer`` hook computes them in (``te_jax.ops.sharding_types``).
Three families use them: the matrix ops (``te_jax.ops.primitive``: quantize,
dequantize, the fused norm / activation kernels), the GEMM
(``te_jax.ops.gemm_call``) and the grouped GEMM (``te_jax.ops.grouped.call``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from te_jax.ops.sharding_types import partitioned_types

__all__ = ["CustomCallPrimitive", "Partitioned", "device_local"]


class CustomCallPrimitive:
    """A JAX primitive whose lowering is an FFI custom call.

    Args:
      name: the primitive's name, as jaxprs print it.
      abstract_eval: ``(*avals, **params)`` -> the result aval(s).
      lower: ``(platform, ctx, *args, **params)`` -> the lowered results; ``platform``
        is one of ``platforms``, or None when ``platforms`` is None (one rule for all).
      platforms: the platforms lowered (None: every platform, by one rule).
      multiple_results: whether the primitive returns a list of results.
      batcher: a batching rule for the bare primitive (None: none; a ``Partitioned``
        with a vmap rule batches the call before it is bound).
    """

    def __init__(self, name: str, *, abstract_eval: Callable, lower: Callable,
                 platforms: Sequence[str] | None = ("cpu", "cuda"), multiple_results: bool = False,
                 batcher: Callable | None = None):
        self.primitive = prim = Primitive(name)
        prim.multiple_results = multiple_results
        prim.def_abstract_eval(abstract_eval)
        # Eager calls compile the primitive (the params are static: hashable descriptions).
        jitted = jax.jit(lambda params, *args: prim.bind(*args, **dict(params)), static_argnums=0)
        prim.def_impl(lambda *args, **params: jitted(tuple(params.items()), *args))
        if platforms is None:
            mlir.register_lowering(prim, functools.partial(lower, None))
        for platform in platforms or ():
            mlir.register_lowering(prim, functools.partial(lower, platform), platform=platform)
        if batcher is not None:
            batching.primitive_batchers[prim] = batcher

    def bind(self, *args, **params):
        """The primitive applied to ``args``."""
        return self.primitive.bind(*args, **params)


def _traced_without_mesh(partition: Callable) -> Callable:
    """``partition`` with the per-device body it returns run by ``device_local``."""

    @functools.wraps(partition)
    def run(*args):
        mesh, body, result_shardings, arg_shardings = partition(*args)
        return mesh, device_local(body), result_shardings, arg_shardings

    return run


class Partitioned:
    """``local(static, *args)`` run partitioned (``custom_partitioning``) and, with ``vmap_rule``, batched.

    ``static`` is the family's hashable description of one call (a ``MatrixOp``, a
    GEMM ``Layout``); every hook takes it first.

    Args:
      local: the unsharded function, ``local(static, *args)``.
      partition: ``(static, mesh, arg_shapes, result_shape)`` -> ``(mesh, body,
        result shardings, arg shardings)``; ``body(*blocks)`` runs on one device's
        blocks, traced with no mesh in context (``device_local``).
      infer: ``(static, mesh, arg_shapes, result_shape)`` -> the result shardings.
      sharding_rule: ``(static, mesh, value_types, result_types)`` -> Shardy's rule.
      vmap_rule: ``vmap_rule(static)`` -> ``custom_vmap``'s rule for that call
        (None: vmap traces through the partitioned call).
      decode_shardings: whether the hooks get decoded ``NamedSharding``s.
    """

    def __init__(self, local: Callable, *, partition: Callable, infer: Callable, sharding_rule: Callable,
                 vmap_rule: Callable | None = None, decode_shardings: bool = True):
        self._partitioned = custom_partitioning(local, static_argnums=(0,))
        self._partitioned.def_partition(partition=_traced_without_mesh(partition), infer_sharding_from_operands=infer,
                                        sharding_rule=sharding_rule, decode_shardings=decode_shardings)
        self._infer = infer
        self._vmap_rule = vmap_rule

    def __call__(self, static, *args):
        def run(*xs):
            return self._typed(static, xs, self._partitioned(static, *xs))

        if self._vmap_rule is None:
            return run(*args)
        batched = jax.custom_batching.custom_vmap(run)
        batched.def_vmap(self._vmap_rule(static))
        return batched(*args)

    def _typed(self, static, args, results):
        """``results`` typed as ``infer`` shards them for ``args``' types (``sharding_types.partitioned_types``)."""
        return partitioned_types(results, args, lambda mesh, shapes: self._infer(static, mesh, shapes, None))


# Not public in old releases (jax 0.6): there the body is traced as it always was.
_use_abstract_mesh = getattr(jax.sharding, "use_abstract_mesh", None)


def device_local(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` as a ``custom_partitioning`` lowering function: traced with no mesh in context.

    XLA calls the partition rule while compiling; jax 0.11 does so with the
    caller's mesh (``jax.set_mesh``) still in context, and the body traced
    there types its values as sharded over it. With Explicit axes every op,
    the all-reduces' reducers included, is then lowered with a Shardy
    ``Sharding`` custom call, which nothing removes from a module that is
    already partitioned: XLA rejects the reducer ("Unsupported reduction
    computation") or the call itself. The body works on one device's blocks
    and names mesh axes only in its collectives, so it is traced as jax 0.10
    traced it, with no mesh: the same ops, hence the same bits.

    Args:
      body: the per-device function a partition rule returns.

    Returns:
      ``body``, run under an empty abstract mesh.
    """
    if _use_abstract_mesh is None:  # pragma: no cover
        return body

    @functools.wraps(body)
    def run(*args: jax.Array) -> Any:
        with _use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return body(*args)

    return run
