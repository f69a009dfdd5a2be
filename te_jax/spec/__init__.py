"""The specification floor: what every kernel must compute, as data and pure JAX.

The formats' scalar numerics (``numerics``), the scaling-mode registry
(``modes``, which also holds ``ScaledTensor`` and ``CastSpec`` as data),
the pure-JAX reference twins of the kernels (``reference``,
``reference_norm_act``) and the names several floors share (``names``).
Nothing here imports any other part of te_jax.
"""

from te_jax.spec import modes, names, numerics, reference, reference_norm_act
from te_jax.spec.modes import ModeSpec, ScalingMode, mode_spec
from te_jax.spec.modes import CastOutputs, CastSpec, ScaledTensor, flattened_shape

__all__ = ["CastOutputs", "CastSpec", "ModeSpec", "ScaledTensor", "ScalingMode", "flattened_shape", "mode_spec",
           "modes", "names", "numerics", "reference", "reference_norm_act"]
