"""Sharding types under meshes with Explicit axes: what te_jax's results and gradients are typed as.

``jax.make_mesh`` creates ``jax.sharding.AxisType.Explicit`` axes by default:
under ``jax.set_mesh`` every value then carries a sharding type
(``jax.typeof(x).sharding.spec``) that jax's own ops propagate and that
``with_sharding_constraint`` asserts. A custom call's results carry none, so
te_jax types them itself, in three places:

* every custom call (``te_jax.ops.primitive.Partitioned``): each result gets
  the sharding its partition rule computes it in (no data moves);
* every functional op and layer (``te_jax.core``): its output gets the type
  jax gives its high-precision equivalent (``product_type``: ``x @ kernel +
  bias``; a norm or an activation keeps its input's), where te_jax may
  move data (a slice, a gather) to lay it out so;
* every custom VJP: a gradient is typed as its primal (``ArgType``,
  ``cotangent_as``), as jax's transposes type them.

Where jax itself types nothing te_jax could follow (the MoE's per-token
scatters and top-k, the grouped ops' row gathers and ragged products:
``jax.lax.ragged_dot`` has no Explicit typing) the op runs with the mesh's
axes Auto (``untyped``, ``untyped_op``, as ``jax.sharding.auto_axes``) and
only its results are typed. ``reshape`` and ``dot_general`` are jax's, typed
also where jax refuses to (a split axis merged with another; a contraction
split on both sides): that dimension is unsplit, or the partial products summed.

Elsewhere (no mesh, Auto axes only, inside a body traced per device) values
carry no type and every function here returns its input unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from te_jax.ops.sharding import match_cotangent, mesh_axes, varying_axes


def explicit_mesh():
    """The abstract mesh in scope when it has an Explicit axis (``jax.set_mesh``), else None.

    Only there do values carry sharding types that te_jax must give its results.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return mesh


def type_entries(x, ndim: int | None = None) -> tuple[tuple[str, ...], ...] | None:
    """The mesh axes of each dimension in ``x``'s sharding type (None when its type has no mesh).

    ``x`` is an array or anything ``jax.typeof`` takes; ``ndim`` pads or cuts the result to that many dimensions.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    ndim = len(jax.typeof(x).shape) if ndim is None else ndim
    entries = tuple(mesh_axes(e) for e in tuple(sharding.spec)[:ndim])
    return entries + ((),) * (ndim - len(entries))


def as_spec(entries) -> PartitionSpec:
    """``type_entries``-style axes per dimension as a PartitionSpec."""
    return PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries))


def retype(x, entries):
    """``x`` with the sharding type ``entries`` (axes per dimension) under an Explicit mesh.

    ``x`` itself when ``entries`` or ``x`` is None, outside an Explicit mesh,
    or when it has that type already. A ``jax.sharding.reshard``: no data
    moves where the value is laid out so already.
    """
    if x is None or entries is None or explicit_mesh() is None:
        return x
    entries = tuple(tuple(e) for e in entries)
    if type_entries(x, len(entries)) == entries:
        return x
    return jax.sharding.reshard(x, as_spec(entries))


def partitioned_types(results, args, infer):
    """A custom call's ``results`` typed with the shardings its partition rule computes them in (no data moves).

    ``infer(mesh, arg_shapes)`` is the rule's result shardings for operands
    of ``args``' shapes and types (only an Explicit mesh's axes appear in a
    type): rows and columns split as the operands that split them, where
    whole blocks allow. A custom call's results carry no type of their own.
    """
    mesh = explicit_mesh()
    if mesh is None:
        return results
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, as_spec(type_entries(a) or ())))
              for a in args]
    shardings = infer(mesh, shapes)
    shardings = (shardings,) if isinstance(shardings, NamedSharding) else tuple(shardings)
    leaves, tree = jax.tree.flatten(results)
    return jax.tree.unflatten(tree, [retype(r, tuple(mesh_axes(e) for e in s.spec) + ((),) * (r.ndim - len(s.spec)))
                                     for r, s in zip(leaves, shardings)])


@dataclasses.dataclass(frozen=True)
class ArgType:
    """The type a custom VJP's cotangent of one array argument must have (hashable: part of a plan).

    Attributes:
      vary: the manual axes it varies over inside ``shard_map`` (``varying_axes``).
      entries: its sharding type's axes per dimension (``type_entries``), None without one.
    """

    vary: frozenset[str] = frozenset()
    entries: tuple[tuple[str, ...], ...] | None = None


def arg_type(x) -> ArgType:
    """The ``ArgType`` of array ``x`` (an empty one for None)."""
    return ArgType() if x is None else ArgType(varying_axes(x), type_entries(x))


def cotangent_as(ct, all_vary: frozenset[str], arg: ArgType, reduction: str = "sum"):
    """``ct`` typed as the cotangent of an argument of type ``arg`` (None passes).

    ``match_cotangent`` for shard_map's varying axes (``ct`` really varies
    over ``all_vary``), then ``retype`` to the argument's sharding type, as
    jax's own transposes type a gradient like its primal.
    """
    if ct is None:
        return None
    return retype(match_cotangent(ct, all_vary, arg.vary, reduction), arg.entries)


def product_type(x, x_free, kernel, kernel_free, bias=None) -> tuple[tuple[str, ...], ...] | None:
    """The sharding type jax gives ``lax.dot_general(x, kernel) + bias`` (None: no Explicit mesh).

    ``x``'s free axes ``x_free`` then ``kernel``'s ``kernel_free`` keep
    their mesh axes (a contraction is typed as jax types it, whichever side
    is split); the bias, broadcast over the kernel's free axes, types those it
    leaves unsplit. Where jax refuses the types (a mesh axis twice in the
    result; a contraction split on both sides, which te_jax's GEMMs sum), an
    axis keeps its first place.
    """
    if explicit_mesh() is None:
        return None
    xe, ke = type_entries(x) or ((),) * x.ndim, type_entries(kernel) or ((),) * kernel.ndim
    out = [xe[i] for i in x_free] + [ke[i] for i in kernel_free]
    if bias is not None:
        be = type_entries(bias) or ()
        tail = len(out) - len(be)
        out[tail:] = [o if o else b for o, b in zip(out[tail:], be)]
    return _first_places(out)


def _axes_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def like(y, x, drop: tuple[int, ...] = (), params=()):
    """``y`` typed as jax types an elementwise function of ``x`` (a norm, an activation).

    x's axes per dimension; ``drop``: dimensions of ``x`` that ``y`` lacks
    (the pair axis of a gated activation); a dimension whose size changed (a
    gated activation's halves) keeps its axes where they split it evenly.
    ``params`` (a norm's gamma and beta) broadcast over y's trailing
    dimensions: they type a dimension x leaves unsplit, as jax's broadcasting does.
    """
    mesh = explicit_mesh()
    entries = None if mesh is None else type_entries(x)
    if entries is None:
        return y
    kept = [e for i, e in enumerate(entries) if i not in drop]
    out = [e if not e or d % _axes_size(mesh, e) == 0 else () for e, d in zip(kept, y.shape)]
    for p in params:
        pe = () if p is None else (type_entries(p) or ())
        tail = len(out) - len(pe)
        out[tail:] = [o if o else e for o, e in zip(out[tail:], pe)]
    return retype(y, _first_places(out))


def _first_places(entries) -> tuple[tuple[str, ...], ...]:
    """``entries`` with every dimension that names an axis an earlier one names unsplit (a valid type)."""
    used: set[str] = set()
    typed = []
    for axes in entries:
        keep = tuple(axes) if not set(axes) & used else ()
        used.update(keep)
        typed.append(keep)
    return tuple(typed)


def _reshape_entries(old: tuple[int, ...], new: tuple[int, ...], entries, mesh) -> tuple[tuple[str, ...], ...]:
    """The axes per dimension of a reshape of ``old`` (typed ``entries``) to ``new`` that moves no data, where one does.

    Dimensions pair up in groups of equal extent. A group keeps a split only
    of its major input dimensions (a merge of ``[B@dp, S, H]`` to ``[B*S@dp,
    H]``, a split of ``[B*S@dp]`` to ``[B@dp, S]`` when dp divides B); any
    other split dimension is unsplit.
    """
    out: list[tuple[str, ...]] = [()] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        if old[i] == 1 or new[j] == 1:  # a size-1 dimension is never split: it pairs with nothing
            i, j = i + (old[i] == 1), j + (new[j] == 1)
            continue
        i2, j2, po, pn = i + 1, j + 1, old[i], new[j]
        while po != pn:
            if po < pn:
                po, i2 = po * old[i2], i2 + 1
            else:
                pn, j2 = pn * new[j2], j2 + 1
        group = entries[i:i2]
        split = [k for k, e in enumerate(group) if e]
        if split and split == list(range(len(split))):  # only the major input dimensions are split
            axes = tuple(a for e in group[:len(split)] for a in e)
            if j2 - j == 1 or (len(split) == 1 and new[j] % _axes_size(mesh, axes) == 0):
                out[j] = axes
        i, j = i2, j2
    return tuple(out)


def reshape(x, shape):
    """``x.reshape(shape)``, typed as jax types a reshape that moves no data; where jax refuses one (a split
    dimension that is not the major one of its group) that dimension is unsplit (its data moves)."""
    size = math.prod(x.shape)
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        rest = math.prod(d for d in shape if d != -1)
        shape = tuple(size // rest if d == -1 else d for d in shape)
    mesh = explicit_mesh()
    entries = None if mesh is None else type_entries(x)
    if entries is None or not any(entries) or size == 0 or tuple(x.shape) == shape:
        return x.reshape(shape)
    return lax.reshape(x, shape, out_sharding=as_spec(_reshape_entries(tuple(x.shape), shape, entries, mesh)))


def dot_general(lhs, rhs, dimension_numbers, precision=None, dot=None, **kwargs):
    """``dot(lhs, rhs, dimension_numbers, precision=precision, **kwargs)`` (default ``lax.dot_general``).

    Where jax refuses to type ``lax.dot_general`` under an Explicit mesh (a
    contraction split on both sides, a mesh axis twice in the result), the
    product gets ``product_type``'s sharding (``out_sharding``: jax sums the
    partial products), as te_jax's quantized GEMMs type theirs. A custom
    ``dot`` (a flax ``Fp8DotGeneral``) is called as it is.
    """
    if dot is not None and dot is not lax.dot_general:
        return dot(lhs, rhs, dimension_numbers, precision=precision, **kwargs)
    (lc, rc), (lb, rb) = dimension_numbers
    le, re = type_entries(lhs), type_entries(rhs)
    if explicit_mesh() is None or le is None or re is None:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)
    l_free = tuple(lb) + tuple(i for i in range(lhs.ndim) if i not in (*lc, *lb))
    r_free = tuple(i for i in range(rhs.ndim) if i not in (*rc, *rb))
    axes = [a for e in [le[i] for i in l_free] + [re[i] for i in r_free] for a in e]
    refused = any(le[i] and re[k] for i, k in zip(lc, rc)) or len(axes) != len(set(axes))
    if not refused:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)
    out = as_spec(product_type(lhs, l_free, rhs, r_free))
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, out_sharding=out, **kwargs)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


def untyped(fn, out_specs, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the mesh's Explicit axes Auto (as ``jax.sharding.auto_axes``), results typed.

    For plain-JAX code whose ops jax cannot type from split operands (the
    MoE's scatters and top-k by token): XLA partitions it as under an Auto
    mesh. ``out_specs(results)`` gives a pytree like the results with a
    PartitionSpec (None: replicated) per array. Outside an Explicit mesh
    this is ``fn(*args, **kwargs)``.
    """
    mesh = explicit_mesh()
    if mesh is None:
        return fn(*args, **kwargs)
    auto = mesh.update_axis_types({a: AxisType.Auto for a, t in zip(mesh.axis_names, mesh.axis_types)
                                   if t == AxisType.Explicit})
    with jax.sharding.use_abstract_mesh(auto):
        args, kwargs = jax.tree.map(lambda a: jax.sharding.reshard(a, PartitionSpec()) if _is_array(a) else a,
                                    (args, kwargs))
        out = fn(*args, **kwargs)
    leaves, tree = jax.tree.flatten(out)
    specs = tree.flatten_up_to(out_specs(out))
    typed = [retype(o, tuple(mesh_axes(e) for e in (spec or ())) + ((),) * (o.ndim - len(spec or ())))
             if _is_array(o) else o for o, spec in zip(leaves, specs)]
    return jax.tree.unflatten(tree, typed)


def dim_spec(x, dim: int):
    """The PartitionSpec entry of ``x``'s dimension ``dim`` in its sharding type (None: unsplit, or no type)."""
    entries = type_entries(x)
    return None if entries is None else as_spec(entries)[dim]


def specs_like(new, old):
    """A PartitionSpec per array of ``new``: its counterpart's type in ``old`` (same path, same shape), else P()."""
    typed = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(old)}

    def spec(path, leaf):
        was = typed.get(jax.tree_util.keystr(path))
        entries = None if was is None or jax.typeof(was).shape != jax.typeof(leaf).shape else type_entries(was)
        return PartitionSpec() if entries is None else as_spec(entries)

    return jax.tree_util.tree_map_with_path(spec, new)


def untyped_op(out_specs):
    """Decorator: the op runs as ``untyped`` runs a function, ``out_specs(results, arguments)`` typing its results.

    ``arguments`` maps the op's parameter names to the values it was called
    with (defaults applied). For ops whose plain-JAX parts jax cannot type
    from split operands (the grouped ops' row gathers and ragged products);
    its gradients come back typed as the arguments, as jax types them.
    """

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return untyped(fn, lambda out: out_specs(out, bound.arguments), *args, **kwargs)

        return run

    return wrap
