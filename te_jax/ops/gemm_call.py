"""The GEMM custom call as a primitive: lowered per platform, partitioned, batched.

``call(layout, *args)`` runs one ``te_jax_gemm_*`` custom call (contract:
``docs/gemm_ffi.md``), a ``te_jax.ops.primitive`` family: the lowering decides
the workspace result per platform (empty on CPU, sized for the CUDA handlers
on GPU) and checks cuBLASLt's alignment when lowering for CUDA; the partition
rule never gathers a sharded operand (a sharded contraction gives float32
partial products and one psum) and pads each device's blocks to that
alignment on every platform (``aligned``: a split may leave 8 of 16 rows on a
device); the vmap rule makes a vmapped axis a leading
axis of the custom call (per-tensor scales that vary along it become one
scale per matrix).

MXFP8 and NVFP4 GEMMs lowered for a GPU below compute capability 10.0 run the
CUDA handler's documented emulation (each operand dequantized to bfloat16,
then a bfloat16 GEMM accumulating in float32; docs/gemm_ffi.md): lowering
warns once with a ``GemmEmulationWarning`` (``emulation_warning`` decides).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops.partitioned import CustomCallPrimitive, Partitioned
from te_jax.ops.quantize import pad_to_blocks
from te_jax.ops.sharding import AxisClaims, MeshResource, axes_of, check_mesh_axes, mesh_axes
from te_jax.spec import modes

CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024
_SCALARS = {"a_t": "a_tm", "b_t": "b_tm"}  # per-tensor value -> one value per matrix of the leading axes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of one custom call: what each argument is and how it tiles.

    Roles: "a"/"b" the operands, "a_s"/"b_s" block scales ``[..., rows/r, K/k_block]``,
    "a_t"/"b_t" per-tensor ``[1]`` values, "a_tm"/"b_tm" one value per matrix
    ``[..., 1]``, "bias" (appended when ``has_bias``).
    """

    target: str
    roles: tuple[str, ...]
    attrs: tuple[tuple[str, bool], ...] = ()
    out_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    has_bias: bool = False
    n_lead: int = 0  # A's leading axes
    b_batched: bool = False  # B carries A's leading axes
    pack: int = 1  # K elements per stored column of A and B (2: packed NVFP4)
    k_block: int = 0  # K elements per block scale (0: no block scales)
    a_rows: int = 1  # rows of A per block-scale row (128: 2D blocks)
    b_rows: int = 1
    keep_n: tuple[str, ...] = ()  # mesh axes that stay on N when they shard both A's M and B's N
    scatter_rows: tuple[str, ...] = ()  # mesh axes whose partial products are reduce-scattered over M

    @property
    def all_roles(self) -> tuple[str, ...]:
        return self.roles + (("bias",) if self.has_bias else ())


# ---- the custom call, lowered per platform -------------------------------------------


def workspace_bytes(target: str, a_shape, b_shape, k: int, out_dtype, bias_dtype=None) -> int:
    """The CUDA handlers' workspace: cuBLASLt's 32 MiB plus their scratch (docs/gemm_ffi.md, "Workspace")."""
    mode = modes.by_gemm_target(target)
    rows_a, rows_b = math.prod(a_shape[:-1]), math.prod(b_shape[:-1])
    mats_a, mats_b = math.prod(a_shape[:-2]), math.prod(b_shape[:-2])  # matrices per operand (1 if 2-D)
    scratch = mode.gemm_scratch(rows_a, rows_b, k, mats_a, mats_b)
    narrow = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    # The emulation (below the native capability) stages a float16 output in float32.
    staged = (bias_dtype is not None and jnp.dtype(bias_dtype) == jnp.float32 and jnp.dtype(out_dtype) in narrow) or (
        mode.native_gemm_capability > 9.0 and jnp.dtype(out_dtype) == jnp.float16)
    return CUBLAS_WORKSPACE_BYTES + scratch + (4 * rows_a * b_shape[-2] if staged else 0) + 4096


def _check_cuda_shapes(lay: Layout, a_shape, b_shape) -> None:
    """What cuBLASLt needs beyond the CPU handler: 16-aligned M, N, K; K % 32 for MXFP8 and NVFP4."""
    m, n, k = a_shape[-2], b_shape[-2], a_shape[-1] * lay.pack
    k_multiple = modes.by_gemm_target(lay.target).gemm_k_multiple
    if m % 16 or n % 16 or k % k_multiple:
        raise ValueError(f"te_jax: {lay.target} on CUDA needs M and N to be multiples of 16 and K of {k_multiple} "
                         f"(cuBLASLt's aligned rows), got M={m}, N={n}, K={k}; pad the operands")


def aligned(lay: Layout, args: tuple, bias) -> tuple[tuple, jax.Array | None]:
    """The operands zero padded to the shapes every GEMM handler takes; the same arrays when they have them.

    The handlers take M and N multiples of 16 (cuBLASLt's aligned rows), 2D
    blocks of whole 128 rows, and K a multiple of the mode's
    ``gemm_k_multiple`` and of its scale block (block scales of a partial K
    block are given: ``ceil(K / block)`` columns). Zero codes add nothing
    along K whatever their (zero byte) scales, and the padded rows of M and N
    are cut off the output, so the result is that of the operands as given.
    """
    k_multiple = math.lcm(modes.by_gemm_target(lay.target).gemm_k_multiple, max(lay.k_block, 1))
    rows_per_scale_row = {"a": lay.a_rows, "b": lay.b_rows}
    padded = []
    for role, x in zip(lay.roles, args):
        if role in ("a", "b"):
            x = pad_to_blocks(x, math.lcm(16, rows_per_scale_row[role]), k_multiple // lay.pack)
        elif role in ("a_s", "b_s"):
            rows = rows_per_scale_row[role[0]]
            x = pad_to_blocks(x, math.lcm(16, rows) // rows, k_multiple // lay.k_block)
        padded.append(x)
    n = padded[lay.roles.index("b")].shape[-2]
    if bias is not None and bias.shape[0] != n:
        bias = jnp.pad(bias, (0, n - bias.shape[0]))
    return tuple(padded), bias


class GemmEmulationWarning(UserWarning):
    """A GEMM lowered for a GPU without its native kernels runs the documented emulation."""


def emulation_warning(target: str, compute_capability: float | None) -> str | None:
    """The warning for lowering GEMM ``target`` for a GPU of ``compute_capability``, or None when it runs natively.

    None also when the capability is unknown (None).
    """
    mode = modes.by_gemm_target(target)
    if compute_capability is None or compute_capability >= mode.native_gemm_capability:
        return None
    return (f"te_jax: {mode.label} GEMMs ({target}) on a GPU of compute capability {compute_capability:.1f} run "
            f"the documented emulation: each operand is dequantized to bfloat16, then multiplied by a bfloat16 GEMM "
            f"accumulating in float32 (docs/gemm_ffi.md), without {mode.label}'s speed-up. Native kernels need "
            f"compute capability {mode.native_gemm_capability:.1f}; for speed on this GPU use a per-tensor or "
            "Float8 block recipe. Silence with warnings.filterwarnings('ignore', category=GemmEmulationWarning).")


def _cuda_compute_capability() -> float | None:
    """The first CUDA device's compute capability (None when it does not say)."""
    try:
        return float(jax.devices("cuda")[0].compute_capability)
    except (RuntimeError, AttributeError, ValueError, TypeError, IndexError):
        return None


def _lower(platform: str, ctx, *args, lay: Layout):
    a, b = ctx.avals_in[lay.roles.index("a")], ctx.avals_in[lay.roles.index("b")]
    size = 0
    if platform == "cuda":
        message = emulation_warning(lay.target, _cuda_compute_capability())
        if message:  # the default warnings filter shows it once per message
            warnings.warn(message, GemmEmulationWarning, stacklevel=2)
        _check_cuda_shapes(lay, a.shape, b.shape)
        size = workspace_bytes(lay.target, a.shape, b.shape, a.shape[-1] * lay.pack, lay.out_dtype,
                               ctx.avals_in[-1].dtype if lay.has_bias else None)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, jax.core.ShapedArray((size,), jnp.uint8)])
    return jax.ffi.ffi_lowering(lay.target)(ctx, *args, **dict(lay.attrs))[:1]


def _abstract_eval(*avals, lay: Layout):
    a, b = avals[lay.roles.index("a")], avals[lay.roles.index("b")]
    return jax.core.ShapedArray((*a.shape[:-1], b.shape[-2]), lay.out_dtype)


# A primitive, so that its workspace result and the CUDA checks are decided when lowering for a platform.
_gemm_p = CustomCallPrimitive("te_jax_gemm", abstract_eval=_abstract_eval, lower=_lower)


def _ffi_call(lay: Layout, *args):
    if not lay.has_bias:
        args = (*args, jnp.zeros((0,), lay.out_dtype))
    return _gemm_p.bind(*args, lay=lay)


def _local_call(lay: Layout, *args):
    """``_ffi_call`` on one device's blocks (a partition rule's body), zero padded as ``aligned`` pads, the output
    cut back.

    ``te_jax.ops.gemm`` aligns the whole operands, but a split of M, N or K
    over mesh axes may leave blocks the CUDA handlers refuse (M = 16 rows over
    two devices: 8 each). Padded on every platform, so that what a CPU mesh
    runs a GPU mesh runs too; blocks that are aligned pass as they are.
    """
    operands, bias = aligned(lay, args[:len(lay.roles)], args[-1] if lay.has_bias else None)
    m, n = args[lay.roles.index("a")].shape[-2], args[lay.roles.index("b")].shape[-2]
    out = _ffi_call(lay, *operands, *(() if bias is None else (bias,)))
    return out if out.shape[-2:] == (m, n) else out[..., :m, :n]


# ---- sharding ----------------------------------------------------------------------


def _sharding_rule(lay: Layout, mesh, value_types, result_types):
    """Shardy rule: leading axes and M pass through from A, N from B, K is reduced.

    Block-scaled K is the compound ``(kb kq)``: only whole blocks (kb) get
    sharded, and the scales' K/k_block axis is kb. 2D blocks do the same to M
    or N. A dimension of one block is a plain factor (Shardy refuses a
    compound with a factor of size 1; one block cannot be split anyway), its
    scales' axis a factor of its own.
    """
    a_type, b_type = value_types[lay.roles.index("a")], value_types[lay.roles.index("b")]
    blocked_m = lay.a_rows > 1 and a_type.shape[-2] > lay.a_rows
    blocked_n = lay.b_rows > 1 and b_type.shape[-2] > lay.b_rows
    blocked_k = bool(lay.k_block) and a_type.shape[-1] * lay.pack > lay.k_block
    lead = [f"l{i}" for i in range(lay.n_lead)]
    m, n = ("(mb mq)" if blocked_m else "m"), ("(nb nq)" if blocked_n else "n")
    k = "(kb kq)" if blocked_k else "k"
    b_lead = lead if lay.b_batched else []
    dims = {
        "a": [*lead, m, k], "b": [*b_lead, n, k],
        "a_s": [*lead, "mb" if lay.a_rows > 1 else "m", "kb"],
        "b_s": [*b_lead, "nb" if lay.b_rows > 1 else "n", "kb"],
        "a_t": ["ta"], "b_t": ["tb"], "a_tm": [*lead, "ta"], "b_tm": [*b_lead, "tb"], "bias": [n],
    }
    rule = ", ".join(" ".join(dims[r]) for r in lay.all_roles) + " -> " + " ".join([*lead, m, n])
    sizes = {"mq": lay.a_rows} if blocked_m else {}
    sizes |= {"nq": lay.b_rows} if blocked_n else {}
    if blocked_k:
        sizes["kq"] = lay.k_block // lay.pack
    reduction = ("kb", "kq") if blocked_k else (("k", "kb") if lay.k_block else ("k",))
    return rule, dict(reduction_factors=reduction, **sizes)


def _plan(lay: Layout, mesh, arg_shapes, wanted=None):
    """Shardings that keep every operand where it is: (args, result, K axes, M scatter axes, N scatter axes).

    Scales follow their data. A mesh axis serves one role (leading > M > K > N,
    except that the ``keep_n`` axes, tensor and sequence parallel, go to N
    first: the activation is gathered, the weight stays split); a sharding
    that does not split its dimension into whole blocks is dropped (that
    operand is gathered). A contraction split over mesh axes gives partial
    products that are summed over them; they are reduce-scattered instead over
    the axes the output is wanted split by (``wanted``, the result's sharding
    XLA asks for: an FSDP weight gradient) and, along the rows, over the
    ``scatter_rows`` axes (sequence parallel).
    """
    specs = [tuple(getattr(s.sharding, "spec", ())) + (None,) * len(s.shape) for s in arg_shapes]
    ia, ib = lay.roles.index("a"), lay.roles.index("b")
    a_shape, b_shape = arg_shapes[ia].shape, arg_shapes[ib].shape
    a_spec, b_spec = specs[ia][: len(a_shape)], specs[ib][: len(b_shape)]
    take = AxisClaims(mesh).take
    lead = [take(a_spec[i], a_shape[i]) for i in range(lay.n_lead)]
    n_units = b_shape[-2] // lay.b_rows
    n = take(tuple(x for x in mesh_axes(b_spec[-2]) if x in lay.keep_n) or None, n_units)
    m = take(a_spec[-2], a_shape[-2] // lay.a_rows)
    k_units = a_shape[-1] * lay.pack // (lay.k_block or 1)
    k = take(a_spec[-1], k_units) or take(b_spec[-1], k_units)
    n = n or take(b_spec[-2], n_units)
    b_lead = lead if lay.b_batched else []
    per_role = {"a": (*lead, m, k), "a_s": (*lead, m, k), "b": (*b_lead, n, k), "b_s": (*b_lead, n, k),
                "a_t": (None,), "b_t": (None,), "a_tm": (*lead, None), "b_tm": (*b_lead, None), "bias": (n,)}
    args = tuple(NamedSharding(mesh, PartitionSpec(*per_role[r])) for r in lay.all_roles)
    want = tuple(getattr(wanted, "spec", ())) + (None,) * (lay.n_lead + 2)
    size = lambda axes: math.prod(mesh.shape[x] for x in axes)  # noqa: E731

    def scatter(dim_axes, units, extra) -> tuple[str, ...]:
        axes = tuple(x for x in (k or ()) if x in extra)
        return axes if axes and units % (size(dim_axes or ()) * size(axes)) == 0 else ()

    scatter_m = scatter(m, a_shape[-2], set(lay.scatter_rows) | set(mesh_axes(want[lay.n_lead])))
    scatter_n = () if lay.has_bias else scatter(
        n, b_shape[-2], set(mesh_axes(want[lay.n_lead + 1])) - set(scatter_m))
    out_m, out_n = (*(m or ()), *scatter_m) or None, (*(n or ()), *scatter_n) or None
    return args, NamedSharding(mesh, PartitionSpec(*lead, out_m, out_n)), k, scatter_m, scatter_n


def _partition(lay: Layout, mesh, arg_shapes, result_shape):
    arg_shardings, out_sharding, k_axes, scatter_m, scatter_n = _plan(lay, mesh, arg_shapes, result_shape.sharding)
    if not k_axes:
        return mesh, functools.partial(_local_call, lay), out_sharding, arg_shardings
    partial_lay = dataclasses.replace(lay, out_dtype=jnp.dtype(jnp.float32), has_bias=False)
    summed = tuple(x for x in k_axes if x not in scatter_m + scatter_n)

    def partial_products(*args):
        # float32 partial sums over the local K; reduce-scattered over the axes the output is split by, summed
        # over the rest (one collective each), then bias and cast.
        operands = args[:-1] if lay.has_bias else args
        out = _local_call(partial_lay, *operands)
        if scatter_m:
            out = lax.psum_scatter(out, scatter_m, scatter_dimension=out.ndim - 2, tiled=True)
        if scatter_n:
            out = lax.psum_scatter(out, scatter_n, scatter_dimension=out.ndim - 1, tiled=True)
        if summed:
            out = lax.psum(out, summed)
        if lay.has_bias:
            out = out + args[-1].astype(jnp.float32)
        return out.astype(lay.out_dtype)

    return mesh, partial_products, out_sharding, arg_shardings


# ---- batching ----------------------------------------------------------------------


def _vmap_rule(lay: Layout, axis_size: int, in_batched, *args):
    """The vmapped axis becomes A's first leading axis (and B's, when B or its scales vary along it)."""
    roles = lay.all_roles
    b_batched = lay.b_batched or any(b for r, b in zip(roles, in_batched) if r[0] == "b" and r != "bias")
    ia = roles.index("a")
    lead = (axis_size, *args[ia].shape[int(in_batched[ia]):-2])

    def expand(x, role, batched):
        if role == "bias" or (role[0] == "b" and not b_batched) or (role in _SCALARS and not batched):
            return x
        x = x if batched else x[None]
        if role in _SCALARS or (role[0] == "b" and not lay.b_batched):  # shared so far: add A's leading axes
            x = x.reshape(x.shape[0], *(1,) * lay.n_lead, *x.shape[1:])
        return jnp.broadcast_to(x, (*lead, *x.shape[-1 if role in _SCALARS or role.endswith("_tm") else -2:]))

    xs = [expand(x, r, b) for x, r, b in zip(args, roles, in_batched)]
    new_roles = tuple(_SCALARS[r] if r in _SCALARS and b else r for r, b in zip(lay.roles, in_batched))
    new = dataclasses.replace(lay, roles=new_roles, n_lead=lay.n_lead + 1, b_batched=b_batched)
    if not (lay.has_bias and in_batched[-1]):
        return call(new, *xs), True
    # A bias per batch element: add it in float32 after the call, then cast, as the handler would.
    out = call(dataclasses.replace(new, out_dtype=jnp.dtype(jnp.float32), has_bias=False), *xs[:-1])
    bias = xs[-1].astype(jnp.float32).reshape(axis_size, *(1,) * (out.ndim - 2), xs[-1].shape[-1])
    return (out + bias).astype(lay.out_dtype), True


_gemm = Partitioned(_ffi_call, partition=_partition, sharding_rule=_sharding_rule,
                    infer=lambda lay, mesh, arg_shapes, result_shape: _plan(lay, mesh, arg_shapes)[1],
                    vmap_rule=lambda lay: functools.partial(_vmap_rule, lay))

def parallel_axes(mesh_resource: MeshResource | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(tensor + sequence parallel axes, sequence parallel axes)`` of ``mesh_resource`` (None: none)."""
    if mesh_resource is None:
        return (), ()
    sp = axes_of(mesh_resource.sp_resource)
    return axes_of(mesh_resource.tp_resource) + sp, sp


def call(lay: Layout, *args, mesh_resource: MeshResource | None = None):
    """Runs the custom call; ``mesh_resource``'s tp/sp axes give ``keep_n``/``scatter_rows`` unless ``lay`` has them.

    Its axes must be axes of the mesh in scope (a ValueError at trace time otherwise).
    """
    check_mesh_axes(mesh_resource, *args, where=f"GEMM {lay.target}")
    if not lay.keep_n and not lay.scatter_rows:
        keep_n, scatter_rows = parallel_axes(mesh_resource)
        lay = dataclasses.replace(lay, keep_n=keep_n, scatter_rows=scatter_rows)
    return _gemm(lay, *args)
