"""Mesh axes te_jax knows about, the cross-device reduction of amaxes, and the custom calls' sharding helpers.

``MeshResource`` names which axes of the user's mesh play which role; it is
given to ``te_jax.autocast(mesh_resource=...)``. Inside ``shard_map`` the
amaxes that delayed scaling keeps are reduced over those axes (the ones that
are manual there), so every device ends a step with the same state. Under
plain ``jit`` with sharded arrays an amax is already a global value and
nothing needs reducing.

Every axis a ``MeshResource`` names must be an axis of the mesh in scope
(``check_mesh_axes``): a misspelled axis raises at trace time instead of
reducing over nothing.

The sharding types of meshes with Explicit axes are
``te_jax.ops.sharding_types``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from te_jax.spec import numerics as nm

Resource = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Which mesh axes are data, tensor, fully-sharded-data, sequence and expert parallel.

    Attributes:
      dp_resource, tp_resource, fsdp_resource, sp_resource: a mesh axis name,
        a tuple of names, or None.
      ep_resource: the mesh axis (one name) the experts of ``te_jax.flax.MoE``
        are split over; tokens are split over it too, and exchanged with
        all-to-all inside the layer. None: no expert parallelism.
    """

    dp_resource: Resource = None
    tp_resource: Resource = None
    fsdp_resource: Resource = None
    sp_resource: Resource = None
    ep_resource: str | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, field.name, value)
            names = value if isinstance(value, tuple) else (value,)
            if value is not None and not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"te_jax: MeshResource.{field.name} must be a mesh axis name, a tuple of names, or None; "
                    f"got {value!r}"
                )
        if isinstance(self.ep_resource, tuple):
            raise ValueError(f"te_jax: MeshResource.ep_resource must be one mesh axis name or None, got "
                             f"{self.ep_resource!r}")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis named, in field order, without repeats."""
        out: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            for name in value if isinstance(value, tuple) else (value,):
                if name is not None and name not in out:
                    out.append(name)
        return tuple(out)


# The logical axis names te_jax's layers give their parameters (``kernel_axes=...``, TransformerLayer's
# ``logical_axes=True``) and the names for activations; see ``logical_axis_rules``.
PARAM_AXES = ("embed", "heads", "qkv", "kv", "mlp", "act", "expert")
ACTIVATION_AXES = ("batch", "length", "hidden")


def axes_of(value: Resource) -> tuple[str, ...]:
    """A MeshResource entry (None, an axis name or a tuple of them) as a tuple of axis names."""
    return () if value is None else ((value,) if isinstance(value, str) else tuple(value))


def _rule_value(axes: tuple[str, ...]) -> Resource:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def logical_axis_rules(mesh_resource: MeshResource, rules=()) -> tuple[tuple[str, Resource], ...]:
    """Flax logical axis rules for te_jax's axis names on ``mesh_resource``'s mesh axes, after ``rules``.

    Parameters: "embed" (the model width) is split over the FSDP axes, "heads"
    and "mlp" over the tensor-parallel axes (column-parallel first GEMMs,
    row-parallel second ones), "expert" (an MoE's experts) over the
    expert-parallel axis; "kv" (head width), "act" (the gated pair) and
    "qkv" (a key/value group's queries, key and value) are not split.
    Activations: "batch" over the data, FSDP and expert-parallel axes, "length" over the
    sequence-parallel axes, "hidden" not split. A name ``rules`` already maps
    keeps the user's mapping (their rules come first, and flax uses the first
    rule that names an axis).

    Args:
      mesh_resource: which mesh axes are dp, tp, fsdp, sp and ep.
      rules: the user's existing rules, e.g. ``(("vocab", "tp"),)``.

    Returns:
      ``rules`` followed by te_jax's rules for the names it does not map, for
      ``flax.linen.logical_axis_rules``.
    """
    if not isinstance(mesh_resource, MeshResource):
        raise TypeError(f"te_jax: logical_axis_rules needs a te_jax.MeshResource, got {type(mesh_resource).__name__}")
    rules = tuple((str(name), value) for name, value in rules)
    dp, fsdp = axes_of(mesh_resource.dp_resource), axes_of(mesh_resource.fsdp_resource)
    tp, sp = axes_of(mesh_resource.tp_resource), axes_of(mesh_resource.sp_resource)
    ep = axes_of(mesh_resource.ep_resource)
    ours = (("embed", fsdp), ("heads", tp), ("mlp", tp), ("expert", ep), ("qkv", ()), ("kv", ()), ("act", ()),
            ("batch", tuple(dict.fromkeys(dp + fsdp + ep))), ("length", sp), ("hidden", ()))
    taken = {name for name, _ in rules}
    return rules + tuple((name, _rule_value(axes)) for name, axes in ours if name not in taken)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual where this is traced (inside ``shard_map``), else ()."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def amax_reduction_axes(mesh_resource: MeshResource | None) -> tuple[str, ...]:
    """The manual axes an amax is reduced over: those ``mesh_resource`` names, or all when it is None."""
    bound = manual_axes()
    if mesh_resource is None:
        return bound
    check_mesh_axes(mesh_resource, where="the amax reduction")
    return tuple(a for a in mesh_resource.axes if a in bound)


def reduce_amax(amax: jax.Array, reduction: str = "max", mesh_resource: MeshResource | None = None) -> jax.Array:
    """``amax`` reduced across devices (lax.pmax, or lax.pmean for "mean"); unchanged outside shard_map."""
    if reduction not in ("max", "mean"):
        raise ValueError(f"te_jax: amax reduction must be 'max' or 'mean', got {reduction!r}")
    axes = amax_reduction_axes(mesh_resource)
    if not axes:
        return amax
    return lax.pmax(amax, axes) if reduction == "max" else lax.pmean(amax, axes)


# ---- the mesh in scope, and the axes a MeshResource names checked against it -----------------


def mesh_in_scope(*arrays):
    """The mesh ops are traced under, or None.

    jax's abstract mesh (``jax.set_mesh``, inside ``shard_map``), else the
    mesh in the type of the first of ``arrays`` that has one (plain ``jit``
    on arrays with a ``NamedSharding``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    for x in arrays:
        if not isinstance(x, (jax.Array, jax.core.Tracer)):
            continue
        typed = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if typed is not None and not typed.empty:
            return typed
    return None


def check_mesh_axes(mesh_resource: MeshResource | None, *arrays, where: str = "te_jax") -> None:
    """Raises ValueError at trace time when ``mesh_resource`` names an axis the mesh in scope lacks.

    Without a mesh in scope (one device, no ``jax.set_mesh``, operands without
    a NamedSharding) there is nothing to check against.

    Args:
      mesh_resource: the MeshResource an op uses (None: nothing to check).
      arrays: the op's operands, whose types name the mesh under plain ``jit``.
      where: the op or layer, for the message.
    """
    if mesh_resource is None:
        return
    mesh = mesh_in_scope(*arrays)
    if mesh is None:
        return
    names = tuple(mesh.axis_names)
    for field in dataclasses.fields(mesh_resource):
        for axis in axes_of(getattr(mesh_resource, field.name)):
            if axis not in names:
                raise ValueError(
                    f"te_jax: {where}: MeshResource.{field.name} names the mesh axis {axis!r}, which the mesh in "
                    f"scope lacks (its axes: {names}); name axes of this mesh in te_jax.MeshResource (None for a "
                    f"role the mesh does not have)")


# ---- what a value's type says about its sharding ----------------------------------------------


def explicit_axes(x) -> tuple[str, ...]:
    """The Explicit mesh axes in ``x``'s type (none outside ``jax.set_mesh`` with Explicit axes)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", ()) or ()
    return tuple(name for name, kind in zip(mesh.axis_names, types) if kind == AxisType.Explicit) if types else ()


def dim_shards(x, dim: int) -> int:
    """How many devices ``x``'s dimension ``dim`` is split over, as its type says (Explicit axes; else 1)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or len(spec) <= dim or spec[dim] is None:
        return 1
    axes = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
    return math.prod(sharding.mesh.shape[a] for a in axes)


# ---- shard_map's varying-axes types (check_vma) ------------------------------------------


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` is typed as varying over (empty outside shard_map or without check_vma)."""
    aval = jax.typeof(x)
    typ = getattr(aval, "manual_axis_type", None)
    return frozenset(typ.varying if typ is not None else getattr(aval, "vma", ()))


def to_varying(x, axes) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (no data movement)."""
    axes = tuple(sorted(set(axes) - varying_axes(x)))
    if not axes:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # jax < 0.8.2


def match_cotangent(ct, true_axes: frozenset[str], want_axes: frozenset[str], reduction: str = "sum"):
    """A cotangent that really varies over ``true_axes`` as the type of an input varying over ``want_axes``.

    Axes the input does not vary over are reduced (psum, as JAX's own
    transposes do; or pmax for FP8 state), so custom VJPs built on custom
    calls (whose results carry no varying-axes type) type-check in shard_map.
    """
    ct = to_varying(ct, true_axes)
    extra = tuple(sorted(true_axes - want_axes))
    if extra:
        ct = lax.psum(ct, extra) if reduction == "sum" else lax.pmax(ct, extra)
    return to_varying(ct, want_axes)


# ---- what the custom calls' partition rules share (te_jax.ops.primitive) ------------


def mesh_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple of mesh axis names."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class AxisClaims:
    """Hands mesh axes to dimensions, each axis to one dimension at most (the GEMM's rule too)."""

    def __init__(self, mesh):
        self.mesh, self.used = mesh, set()

    def take(self, entry, units: int) -> tuple[str, ...] | None:
        """The axes of ``entry`` not yet taken, if they split ``units`` evenly (then they are taken), else None."""
        axes = tuple(a for a in mesh_axes(entry) if a not in self.used)
        if not axes or units % math.prod(self.mesh.shape[a] for a in axes):
            return None
        self.used.update(axes)
        return axes


def all_reduce(x: jax.Array, kind: str, axes: tuple[str, ...]) -> jax.Array:
    """pmax of non-negative float32 ``x`` on its bits, or psum in float32, over ``axes``."""
    if not axes:
        return x
    if kind == "max":
        return nm.bits_f32(lax.pmax(nm.f32_bits(x), axes))
    return lax.psum(x.astype(jnp.float32), axes)


class ShardingGatherWarning(UserWarning):
    """A custom call gathers an operand whose sharding it cannot express (warned once per sharding)."""


@dataclasses.dataclass(frozen=True)
class Shards:
    """Which mesh axes split this device's block of the matrices (empty: not split)."""

    m: tuple[str, ...] = ()
    n: tuple[str, ...] = ()
    axis_sizes: tuple[tuple[str, int], ...] = ()

    @property
    def matrix(self) -> tuple[str, ...]:
        """The mesh axes that split one matrix."""
        return self.m + self.n

    @property
    def count(self) -> int:
        """Blocks per matrix."""
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[a] for a in self.matrix)

    def index(self) -> jax.Array:
        """This device's block of the matrix as a linear uint32 index (M axes major)."""
        sizes = dict(self.axis_sizes)
        idx = jnp.uint32(0)
        for a in self.matrix:
            idx = idx * jnp.uint32(sizes[a]) + lax.axis_index(a).astype(jnp.uint32)
        return idx

    def pmax(self, amax: jax.Array) -> jax.Array:
        """The max of non-negative float32 values over the matrix's blocks (one all-reduce).

        Compared as bit patterns, so NaN and Inf order exactly as ``nm.abs_max`` does.
        """
        return all_reduce(amax, "max", self.matrix)


def fold_shard_index(words: jax.Array, shards: Shards) -> jax.Array:
    """PRNG key words ``[..., 2]`` made distinct per block (unchanged with one block).

    ``k0 ^= mix32(i + 0x9E3779B9)``, ``k1 ^= mix32(i + 0x7F4A7C15)`` for block ``i``.
    """
    if shards.count == 1:
        return words
    i = shards.index()
    salt = jnp.stack([nm.mix32(i + jnp.uint32(0x9E3779B9)), nm.mix32(i + jnp.uint32(0x7F4A7C15))])
    return words ^ salt
