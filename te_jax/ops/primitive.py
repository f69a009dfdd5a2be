"""The custom-call primitive base, the backend choice, and the matrix ops' sharding rules.

Every te_jax custom call is built from two pieces (the idea of
TransformerEngine-JAX's ``BasePrimitive``, with te_jax's explicit errors):
``CustomCallPrimitive``, a JAX primitive with an abstract eval, a compiled
eager implementation, an FFI lowering per platform and an optional batching
rule; and ``Partitioned``, a per-device function under ``custom_partitioning``
(Shardy ``sharding_rule``, ``infer`` and ``partition`` hooks, the partitioned
body traced with no mesh: ``device_local``) and, optionally, ``custom_vmap``.
Three families use them: the matrix ops below (quantize, dequantize, the fused
norm / activation kernels), the GEMM (``te_jax.ops.gemm_call``) and the
grouped GEMM (``te_jax.ops.grouped.call``).

``use`` / ``resolve`` (public as ``te_jax.ops.backend``) pick, at trace time,
the FFI kernels or the pure-JAX reference, per call (``backend=``) or for a
block (``with te_jax.ops.backend.use("reference"): ...``); the choice is part
of jit's cache key. The reference is the spec the kernels are tested against,
slower, and never picked silently.

Matrix ops work on matrices ``[..., M, N]``, described by a ``MatrixOp``: the
tokens of the trailing axes of every operand and result, and a ``body(op,
shards, *args)`` that runs the kernels (``ffi``) on one device's blocks.
``call(op, *args)`` runs it partitioned and batched (a vmapped axis becomes a
leading axis of every operand, as ``vmap_method="broadcast_all"`` did).

Axis tokens:

* ``m`` / ``n``: the rows / columns. ``m/32`` is an axis of ``M/32`` entries
  (a block scale), ``n/2`` one of packed pairs (NVFP4 codes). A columnwise copy
  is ``n m``, so it takes the transposed sharding; block scales follow their data.
* ``~``: never sharded (per-tensor ``[1]`` values, PRNG key words, empty
  outputs, the ``[a | g]`` pair axis of a gated activation).

Leading axes (a batch of matrices, vmap) keep their sharding. The rules:

1. M and N keep the mesh axes of the first operand that shards them (a mesh
   axis serves one role). Elementwise and blockwise ops shard both; norms need
   whole rows (``shard_n=False``: an N sharding is gathered).
2. A sharding stays only if every shard holds whole blocks: M (N) must split
   into multiples of its granularity, the lcm of its tokens' units and the
   op's ``align`` (2D blocks, the 16-row Hadamard groups). Otherwise that
   dimension is gathered: slower, never wrong.
3. Results marked "max" (a per-tensor amax) or "sum" (dgamma, dbeta, dbias)
   are per-shard partials, combined over the mesh axes of the dimensions they
   lack by one all-reduce per kind (pmax on the float bits, psum in float32).
4. A cast whose scale depends on the whole tensor (current scaling, NVFP4)
   takes the local amax, one ``Shards.pmax``, and casts with the global scale
   in its body (``te_jax.ops.quantize``), so the bits equal the unsharded op's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

try:  # what custom_partitioning itself decodes shardings with (private: checked, and warned about, below)
    from jax._src.sharding_impls import parse_flatten_op_sharding as _parse_hlo_sharding
except ImportError:  # pragma: no cover
    _parse_hlo_sharding = None

from te_jax.ops.sharding import AxisClaims, ShardingGatherWarning, Shards, all_reduce, fold_shard_index

Dim = tuple[str | None, int]  # (factor "m" / "n" / None for "~", entries per axis index)


# ---- the backend: FFI kernels or the pure-JAX reference ----------------------------

BACKENDS = ("ffi", "reference")
_current = jax.make_user_context(default_value="ffi")


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown te_jax backend {name!r}; choose one of {BACKENDS}")
    return name


def use(name: str):
    """Context manager: ops traced inside it use backend ``name`` ("ffi" or "reference")."""
    return _current(_check_backend(name))


def current() -> str:
    """The backend of the enclosing ``use`` block ("ffi" outside any)."""
    return _current.value


def resolve(backend: str | None) -> str:
    """The backend for one call: the explicit argument, else the context's."""
    return _current.value if backend is None else _check_backend(backend)


# ---- the base: a primitive lowered per platform, partitioned, batched ----------------


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
        self._vmap_rule = vmap_rule

    def __call__(self, static, *args):
        if self._vmap_rule is None:
            return self._partitioned(static, *args)
        run = jax.custom_batching.custom_vmap(lambda *xs: self._partitioned(static, *xs))
        run.def_vmap(self._vmap_rule(static))
        return run(*args)


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


# ---- the matrix ops' custom call ------------------------------------------------------
#
# Bodies call the kernels through this primitive rather than jax.ffi.ffi_call so that a
# printed jaxpr names each call site's target once, on its outermost equation
# (``_VmapRule``'s ``target_name=...``), as a bare ffi_call did: the partitioned and
# batched wrappers nest the call in sub-jaxprs, which a printout shows once when shared
# (a remat recomputation shares them).


def _ffi_lower(platform, ctx, *args, target, results, attrs):
    return jax.ffi.ffi_lowering(target)(ctx, *args, **dict(attrs))


def _ffi_batch(args, dims, *, target, results, attrs):
    """``vmap_method="broadcast_all"``: every operand and result gets the batch axis first."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    xs = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
          for a, d in zip(args, dims)]
    batched = tuple(jax.core.ShapedArray((size, *r.shape), r.dtype) for r in results)
    return _ffi_p.bind(*xs, target=target, results=batched, attrs=attrs), [0] * len(results)


_ffi_p = CustomCallPrimitive("te_jax_ffi", abstract_eval=lambda *avals, target, results, attrs: results,
                             lower=_ffi_lower, platforms=None, multiple_results=True, batcher=_ffi_batch)


def ffi(target: str, results, *args, **attrs) -> list:
    """The custom call ``target`` with ``results`` (ShapeDtypeStructs) and FFI attributes ``attrs``."""
    results = (results,) if isinstance(results, jax.ShapeDtypeStruct) else tuple(results)
    avals = tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in results)
    return _ffi_p.bind(*args, target=target, results=avals, attrs=tuple(sorted(attrs.items())))


def per_matrix(fn: Callable, n_lead: int) -> Callable:
    """``fn`` of unbatched operands, mapped over ``n_lead`` leading axes of every operand."""
    for _ in range(n_lead):
        fn = jax.vmap(fn)
    return fn


@dataclasses.dataclass(frozen=True)
class MatrixOp:
    """Static description of one sharded op (hashable: it is a static argument).

    Attributes:
      target: the FFI target the body runs (for jaxpr printouts and messages).
      body: ``body(op, shards, *args)`` -> tuple of results, on one device's blocks.
      config: what the body needs besides the arrays (hashable).
      operands, results: space-separated axis tokens after the leading axes.
      sizes: ``(M, N)`` of the matrices.
      reduce: per result, None, "max" or "sum" (see the module docstring).
      shard_n: whether N may stay sharded (False: the op needs whole rows).
      align: extra granularity of ``(M, N)`` shards.
    """

    target: str
    body: Callable[..., tuple]
    config: Any
    operands: tuple[str, ...]
    results: tuple[str, ...]
    sizes: tuple[int, int]
    reduce: tuple[str | None, ...] = ()
    shard_n: bool = True
    align: tuple[int, int] = (1, 1)

    def __repr__(self) -> str:
        return f"MatrixOp({self.target}, operands={self.operands}, results={self.results})"


def _dims(tokens: str) -> tuple[Dim, ...]:
    out = []
    for t in tokens.split():
        if t == "~":
            out.append((None, 1))
        else:
            f, _, unit = t.partition("/")
            out.append((f, int(unit or 1)))
    return tuple(out)


def _granularity(op: MatrixOp, factor: str) -> int:
    """Rows (columns) per indivisible piece: the lcm of every token's unit and ``align``."""
    units = [u for v in op.operands + op.results for f, u in _dims(v) if f == factor]
    return math.lcm(op.align["mn".index(factor)], *units)


# ---- the matrix ops' rules ---------------------------------------------------------


@functools.cache
def _warn_no_parser() -> None:
    warnings.warn(f"te_jax: this jax ({jax.__version__}) lacks jax._src.sharding_impls.parse_flatten_op_sharding; "
                  "te_jax's quantize/norm/activation custom calls will gather their sharded operands (correct, "
                  "but slower). Use a jax release te_jax supports (README).", RuntimeWarning, stacklevel=3)


def _spec_of(sharding, mesh) -> tuple:
    """The PartitionSpec entries of an operand's sharding; () (replicated) when not a mesh sharding.

    Shardings arrive undecoded (``decode_shardings=False``) because Shardy may
    split a mesh axis into sub-axes over uneven blocks, which no PartitionSpec
    can express: such an operand is gathered, with a ``ShardingGatherWarning``.
    A sharding the parser does not handle at all raises.
    """
    if hasattr(sharding, "spec"):
        return tuple(sharding.spec)
    if _parse_hlo_sharding is None:  # pragma: no cover
        _warn_no_parser()
        return ()
    try:
        return tuple(_parse_hlo_sharding(sharding._hlo_sharding, mesh)[0])
    except ValueError as err:  # jax's IndivisibleError: the tiling splits a mesh axis into sub-axes
        warnings.warn(f"te_jax: an operand's sharding splits a mesh axis into sub-axes ({err}); no PartitionSpec "
                      "expresses it, so the custom call gathers that operand (correct, but slower). Shard it along "
                      "whole mesh axes to keep it split.", ShardingGatherWarning, stacklevel=2)
        return ()


def _plan(op: MatrixOp, mesh, arg_shapes):
    """``(shards, arg shardings, result shardings)`` that keep whole blocks where they are."""
    specs = [_spec_of(s.sharding, mesh) + (None,) * len(s.shape) for s in arg_shapes]
    n_lead = len(arg_shapes[0].shape) - len(_dims(op.operands[0]))
    take = AxisClaims(mesh).take
    lead = [take(specs[0][i], arg_shapes[0].shape[i]) for i in range(n_lead)]
    chosen: dict[str, tuple[str, ...] | None] = {"m": None, "n": None}
    for f, size in zip("mn", op.sizes):
        if f == "n" and not op.shard_n:
            continue
        units = size // _granularity(op, f)
        entries = [e for v, s in zip(op.operands, specs) for (g, _), e in zip(_dims(v), s[n_lead:]) if g == f]
        for entry in entries:
            if entry is not None and (got := take(entry, units)):
                chosen[f] = got
                break

    def sharding(tokens: str) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*lead, *(chosen[f] if f else None for f, _ in _dims(tokens))))

    shards = Shards(chosen["m"] or (), chosen["n"] or (), tuple(mesh.shape.items()))
    return shards, tuple(map(sharding, op.operands)), tuple(map(sharding, op.results))


def _run(op: MatrixOp, shards: Shards, *args) -> tuple:
    """The body, then one all-reduce per (kind, mesh axes) group of partial results."""
    outs = list(op.body(op, shards, *args))
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for i, kind in enumerate(op.reduce):
        if kind is None:
            continue
        have = {f for f, _ in _dims(op.results[i])}
        axes = (() if "m" in have else shards.m) + (() if "n" in have else shards.n)
        if axes:
            groups.setdefault((kind, axes), []).append(i)
    for (kind, axes), idx in groups.items():
        widths = [outs[i].shape[-1] for i in idx]
        reduced = all_reduce(jnp.concatenate([outs[i] for i in idx], axis=-1), kind, axes)
        for i, part in zip(idx, jnp.split(reduced, list(itertools.accumulate(widths))[:-1], axis=-1)):
            outs[i] = part
    return tuple(outs)


def _unsharded(op: MatrixOp, *args) -> tuple:
    return _run(op, Shards(), *args)


def _partition(op: MatrixOp, mesh, arg_shapes, result_shape):
    shards, arg_shardings, result_shardings = _plan(op, mesh, arg_shapes)
    return mesh, functools.partial(_run, op, shards), result_shardings, arg_shardings


def _sharding_rule(op: MatrixOp, mesh, value_types, result_types):
    """Shardy rule: leading axes ``...``, M and N as ``(mb mrK)`` compounds of whole pieces.

    Every ``~`` axis is its own need-replication factor, and so is N when
    ``shard_n`` is False or M (N) when a mesh axis cannot split its blocks evenly.
    """
    grain = {f: _granularity(op, f) for f in "mn"}
    sizes: dict[str, int] = {}
    whole: set[str] = set()
    fixed: list[str] = []
    seen: set[str] = set()

    def factor(f: str, unit: int) -> str:
        seen.add(f)
        if grain[f] == 1:
            whole.add(f)
            return f
        k = grain[f] // unit
        if k == 1:
            whole.add(f"{f}b")
            return f"{f}b"
        sizes[f"{f}r{k}"] = k
        return f"({f}b {f}r{k})"

    values = []
    for vi, tokens in enumerate(op.operands + op.results):
        names = []
        for di, (f, unit) in enumerate(_dims(tokens)):
            if f is None:
                fixed.append(f"z{vi}_{di}")
                names.append(fixed[-1])
            else:
                names.append(factor(f, unit))
        values.append("... " + " ".join(names))
    for f, size in zip("mn", op.sizes):
        if f in seen and grain[f] > 1 and f"{f}b" not in whole:
            sizes[f"{f}b"] = size // grain[f]
    replicate = list(fixed)
    axis_sizes = [s for s in mesh.shape.values() if s > 1]
    for f, size in zip("mn", op.sizes):
        # Blocks that a mesh axis cannot split evenly would make Shardy split that axis into
        # sub-axes over the blocks (not a NamedSharding): gather them instead.
        uneven = any((size // grain[f]) % s for s in axis_sizes)
        if f in seen and (uneven or (f == "n" and not op.shard_n)):
            replicate += [name for name in (f, f"{f}b", *sizes) if name in whole or
                          (name in sizes and name.startswith(f))]
    order: dict[str, int] = {}
    for name in re.findall(r"[a-z]\w*", " ".join(values)):
        order.setdefault(name, len(order))
    replicate = sorted(set(replicate), key=order.__getitem__)  # Shardy wants them in factor order
    k = len(op.operands)
    rule = ", ".join(values[:k]) + " -> " + ", ".join(values[k:])
    return rule, dict(need_replication_factors=tuple(replicate), **sizes)


# ---- batching ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _VmapRule:
    """Every operand gets the vmapped axis as its first leading axis (``broadcast_all``)."""

    op: MatrixOp

    def __call__(self, axis_size: int, in_batched, *args):
        xs = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        outs = call(self.op, *xs)
        return outs, tuple(True for _ in outs)

    def __repr__(self) -> str:
        return f"broadcast_all(target_name={self.op.target})"


_matrix_op = Partitioned(_unsharded, partition=_partition, sharding_rule=_sharding_rule, vmap_rule=_VmapRule,
                         infer=lambda op, mesh, arg_shapes, result_shape: _plan(op, mesh, arg_shapes)[2],
                         decode_shardings=False)


def call(op: MatrixOp, *args) -> tuple:
    """Runs ``op`` on ``args``: partitioned under ``jit`` with shardings, batched under ``vmap``."""
    return _matrix_op(op, *args)


__all__ = ["BACKENDS", "CustomCallPrimitive", "MatrixOp", "Partitioned", "ShardingGatherWarning", "Shards",
           "all_reduce", "call", "current", "device_local", "ffi", "fold_shard_index", "per_matrix", "resolve", "use"]
