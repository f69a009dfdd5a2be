"""``--mesh dp=..,fsdp=..,ep=..,tp=..``: the device mesh, te_jax's MeshResource, and where each array lives.

* dp: the batch is split over "dp" (and "fsdp" and "ep"); parameters are replicated.
* fsdp: also each weight is split over "fsdp" along its largest divisible axis
  (XLA gathers it for the GEMM and reduce-scatters its gradient).
* ep (MoE presets): the experts of each ``te_jax.flax.MoE`` are split over
  "ep" (their kernels' leading "expert" axis) and the batch is split over it
  too, as over a data axis: the devices of an expert group hold different
  sequences, and the layer sends each token's rows to its experts' devices
  with all-to-all. Every other parameter is replicated over "ep" (split over
  "fsdp" as above). The MeshResource autocast gets (``mesh_resource``)
  names "ep" only when it has more than one device: with one, the MoE runs
  without its shard_map.
* tp: the transformer layers name their parameters' axes (``logical_axes``)
  and ``LOGICAL_RULES`` map those names onto the mesh: attention heads and
  the MLP's hidden axis over "tp", the model axis over "fsdp". The experts
  are not tensor parallel (``RunConfig.check`` rejects tp with an MoE preset).

Everything runs under plain ``jax.jit`` with shardings; te_jax's custom calls
carry sharding rules, and the amaxes they compute are global values. The
``te_jax.MeshResource`` given to autocast names the same axes (it matters
inside shard_map, where amaxes are reduced over them: the expert-parallel
MoE's). The model is traced with the mesh as the current abstract mesh
(``traced_on``), which the expert-parallel MoE reads.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax

AXES = ("dp", "fsdp", "ep", "tp")
BATCH = ("dp", "fsdp", "ep")  # the MoE's token axes in its order: data axes, then the experts' axis
MESH_RESOURCE = te_jax.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp", ep_resource="ep")
LOGICAL_RULES = te_jax.ops.sharding.logical_axis_rules(MESH_RESOURCE)


def mesh_resource(shape: dict[str, int]) -> te_jax.MeshResource:
    """The MeshResource autocast gets on a mesh of ``shape``: ``MESH_RESOURCE``, without "ep" when it is 1."""
    return MESH_RESOURCE if shape["ep"] > 1 else dataclasses.replace(MESH_RESOURCE, ep_resource=None)


def traced_on(mesh: jax.sharding.Mesh):
    """A context that makes ``mesh`` the current abstract mesh; usable inside ``jax.jit`` (unlike set_mesh).

    te_jax.flax.MoE reads it to place its expert-parallel shard_map.
    """
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp=2,ep=4"`` -> {"dp": 2, "fsdp": 1, "ep": 4, "tp": 1} (missing axes are 1)."""
    shape = dict.fromkeys(AXES, 1)
    for part in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, _, size = part.partition("=")
        if name not in shape or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: bad entry {part!r}; write e.g. dp=2,fsdp=1,ep=1,tp=1")
        shape[name] = int(size)
    return shape


def setup_devices(spec: str, distributed: bool = False, coordinator: str | None = None,
                  num_processes: int | None = None, process_id: int | None = None) -> None:
    """Call before anything touches a device: enough fake CPU devices for the mesh, and multi-process init.

    With ``distributed``, ``jax.distributed.initialize`` gets the coordinator
    address, process count and id when given (on a cluster it detects them);
    each process then holds its share of the mesh's devices.
    """
    n = math.prod(parse_mesh(spec).values())
    local = n // num_processes if distributed and num_processes else n
    if local > 1:
        jax.config.update("jax_num_cpu_devices", local)  # only the CPU backend reads it
    if distributed:
        given = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
        jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})


def make_mesh(shape: dict[str, int]) -> jax.sharding.Mesh:
    n = math.prod(shape.values())
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--mesh needs {n} devices, found {len(devices)} ({jax.default_backend()})")
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(tuple(shape[a] for a in AXES)), AXES)


def _fsdp_spec(x, size: int) -> P:
    if size == 1 or x.ndim < 2:
        return P()
    for i in sorted(range(x.ndim), key=lambda i: -x.shape[i]):
        if x.shape[i] % size == 0:
            return P(*[("fsdp" if j == i else None) for j in range(x.ndim)])
    return P()


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def param_specs(variables, shape: dict[str, int]):
    """The unboxed variables and a {path: PartitionSpec} map of their leaves (also without the collection)."""
    logical = nn.get_partition_spec(variables)
    variables = nn.meta.unbox(variables)
    with nn.logical_axis_rules(LOGICAL_RULES):
        mesh_specs = nn.logical_to_mesh(logical)
    specs = {}
    for (path, x), (_, spec) in zip(jax.tree_util.tree_flatten_with_path(variables)[0],
                                    jax.tree_util.tree_flatten_with_path(
                                        mesh_specs, is_leaf=lambda s: isinstance(s, P))[0]):
        names = _names(path)
        specs[names] = specs[names[1:]] = spec if any(a is not None for a in spec) else _fsdp_spec(x, shape["fsdp"])
    return variables, specs


def state_shardings(state, specs: dict, mesh):
    """A sharding for every leaf of ``state``: a parameter's spec for it and for its optimizer moments."""

    def one(path, x):
        names = _names(path)
        for i in range(len(names)):  # the optimizer state's leaves end with their parameter's path
            if names[i:] in specs and len(specs[names[i:]]) <= np.ndim(x):
                return NamedSharding(mesh, specs[names[i:]])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, state)
