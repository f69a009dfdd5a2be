"""The backend choice and the matrix ops: their custom call and sharding rules.

The matrix ops (quantize, dequantize, the fused norm / activation kernels)
are one family of the custom-call primitive base (``te_jax.ops.partitioned``:
``CustomCallPrimitive``, ``Partitioned``), as are the GEMM
(``te_jax.ops.gemm_call``) and the grouped GEMM (``te_jax.ops.grouped.call``).

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
5. Under a mesh with Explicit axes every family's results are typed with the
   shardings these rules compute them in (``te_jax.ops.sharding_types``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

try:  # what custom_partitioning itself decodes shardings with (private: checked, and warned about, below)
    from jax._src.sharding_impls import parse_flatten_op_sharding as _parse_hlo_sharding
except ImportError:  # pragma: no cover
    _parse_hlo_sharding = None

from te_jax.ops.partitioned import CustomCallPrimitive, Partitioned
from te_jax.ops.sharding import AxisClaims, ShardingGatherWarning, Shards, all_reduce, fold_shard_index
from te_jax.ops.sharding_types import explicit_mesh

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
      typed: traced under an Explicit mesh (its results get sharding types; ``call`` sets it).
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
    typed: bool = False

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
    ``shard_n`` is False or M (N) when a mesh axis cannot split its blocks
    evenly, and every axis of M (N) when it is one block. Under an Explicit
    mesh (``op.typed``) a result dimension the op computes whole is a factor
    of its own too: else Shardy would carry an operand's split onto it (the
    results' types say whole) and slice it, only for the type to gather it back.
    """
    grain = {f: _granularity(op, f) for f in "mn"}
    axis_sizes = [s for s in mesh.shape.values() if s > 1]
    gathered = {f for f, size in zip("mn", op.sizes)
                if any((size // grain[f]) % s for s in axis_sizes) or (f == "n" and not op.shard_n)}
    # One block (or none): nothing to split, and Shardy refuses a compound with a factor of size 1.
    single = {f for f, size in zip("mn", op.sizes) if grain[f] > 1 and size // grain[f] <= 1}
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
            if f is None or f in single or (op.typed and f in gathered and vi >= len(op.operands)):
                fixed.append(f"z{vi}_{di}")
                names.append(fixed[-1])
            else:
                names.append(factor(f, unit))
        values.append("... " + " ".join(names))
    for f, size in zip("mn", op.sizes):
        if f in seen and grain[f] > 1 and f"{f}b" not in whole:
            sizes[f"{f}b"] = size // grain[f]
    replicate = list(fixed)
    for f in "mn":
        # Blocks that a mesh axis cannot split evenly would make Shardy split that axis into
        # sub-axes over the blocks (not a NamedSharding): gather them instead.
        if f in seen and f in gathered:
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
    if explicit_mesh() is not None and not op.typed:
        op = dataclasses.replace(op, typed=True)
    return _matrix_op(op, *args)


__all__ = ["BACKENDS", "MatrixOp", "ShardingGatherWarning", "Shards", "all_reduce", "call", "current", "ffi",
           "fold_shard_index", "per_matrix", "resolve", "use"]
