"""Recipes: frozen, hashable descriptions of how a layer's tensors are quantized.

Every recipe is a quantizer factory: ``recipe.quantizer(role)`` returns the
quantizer for one tensor of a linear layer, or None to keep that tensor in
high precision. The roles are the strings in ``ROLES``::

    linear_input        x of y = x @ W          (forward GEMM, and wgrad)
    linear_weight       W                       (forward GEMM, and dgrad)
    linear_output       y, the forward GEMM's output (quantized, then dequantized)
    linear_grad_output  dy, the gradient of y   (dgrad and wgrad GEMMs)
    linear_grad_input   dx, the dgrad GEMM's output (quantized, then dequantized)

Layers pass a ``Role``: a ``str`` that equals one of those names and also
carries the layer's module path, so a ``CustomRecipe`` can treat layers
differently::

    def qfactory(role):
        if role.path and role.path[0] == "embed":
            return None
        return CurrentScalingQuantizer(jnp.float8_e4m3fn) if role == "linear_input" else ...

Recipes are validated at construction: a bad value raises ValueError naming
the allowed values. They are hashable, so they can be static arguments of jit
and values of ``te_jax.autocast``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from te_jax.recipe.te_fields import check_te_fields
from te_jax.quantize.delayed import DelayedScalingQuantizer
from te_jax.quantize.protocols import Quantizer
from te_jax.quantize.delayed import check_config as check_delayed_config
from te_jax.quantize.quantizers import (
    CurrentScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

LINEAR_INPUT = "linear_input"
LINEAR_WEIGHT = "linear_weight"
LINEAR_OUTPUT = "linear_output"
LINEAR_GRAD_OUTPUT = "linear_grad_output"
LINEAR_GRAD_INPUT = "linear_grad_input"
ROLES = (LINEAR_INPUT, LINEAR_WEIGHT, LINEAR_OUTPUT, LINEAR_GRAD_OUTPUT, LINEAR_GRAD_INPUT)
GRADIENT_ROLES = (LINEAR_GRAD_OUTPUT, LINEAR_GRAD_INPUT)


class Role(str):
    """A role name (compares equal to the plain string) plus the layer's module path.

    Attributes:
      path: the module path of the layer, e.g. ``("TransformerLayer_0", "mlp", "wi")``;
        ``()`` when the caller has none.
    """

    path: tuple[str, ...]

    def __new__(cls, name: str, path: tuple[str, ...] | str = ()) -> Role:
        name = str(name)
        if name not in ROLES:
            raise ValueError(f"te_jax: unknown role {name!r}; roles are {ROLES}")
        if isinstance(path, str):
            path = tuple(p for p in path.split("/") if p)
        role = super().__new__(cls, name)
        object.__setattr__(role, "path", tuple(str(p) for p in path))
        return role

    def __setattr__(self, name, value):
        raise AttributeError("te_jax: Role is immutable")

    def __getnewargs__(self):
        return (str(self), self.path)

    @property
    def path_str(self) -> str:
        """The path joined with "/" (``"TransformerLayer_0/mlp/wi"``)."""
        return "/".join(self.path)

    @property
    def is_gradient(self) -> bool:
        return str(self) in GRADIENT_ROLES

    def __repr__(self) -> str:
        return f"Role({str(self)!r}, path={self.path!r})"


def as_role(role: str) -> Role:
    """``role`` as a Role (a plain string gets an empty path); unknown names raise ValueError."""
    return role if isinstance(role, Role) else Role(role)


class Format(enum.Enum):
    """FP8 formats: which FP8 dtype forward tensors and gradients use."""

    E4M3 = "E4M3"  # every tensor E4M3
    E5M2 = "E5M2"  # every tensor E5M2
    HYBRID = "HYBRID"  # E4M3 forward (input, weight, output), E5M2 gradients

    def dtype(self, role: str) -> jnp.dtype:
        """The FP8 dtype this format gives the tensor with ``role``."""
        if self is Format.E5M2 or (self is Format.HYBRID and as_role(role).is_gradient):
            return jnp.dtype(jnp.float8_e5m2)
        return jnp.dtype(jnp.float8_e4m3fn)


_GEMM_FORMATS = (Format.E4M3, Format.HYBRID)


def _check_choice(name: str, value, allowed) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"te_jax: {name} must be one of {allowed}, got {value!r}")


def _format(cls: str, value, allowed=_GEMM_FORMATS) -> Format:
    if isinstance(value, str) and value.upper() in Format.__members__:
        value = Format[value.upper()]
    if not isinstance(value, Format) or value not in allowed:
        hint = ""
        if value is Format.E5M2:
            hint = " (FP8 GEMMs cannot multiply two E5M2 operands, which the dgrad GEMM would)"
        names = ", ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(f"te_jax: {cls}.fp8_format must be one of {names}, got {value!r}{hint}")
    return value


def _operand_dtype(fp8_format: Format, role: str) -> Any:
    """``fp8_format``'s dtype for a GEMM operand ``role``; None for the GEMM outputs, kept in high precision."""
    role = as_role(role)
    if role in (LINEAR_OUTPUT, LINEAR_GRAD_INPUT):
        return None
    return fp8_format.dtype(role)


def _bool(cls: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"te_jax: {cls}.{name} must be True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Base class: a recipe maps a role to a quantizer (or None for high precision).

    Attributes:
      fast_accumulation: (keyword only, every recipe) the forward GEMMs use
        Hopper's FP8 fast accumulation; False gives them split accumulation
        too (slower, closer to float32 sums). Per-tensor FP8 only: the
        block-scaled recipes default to False and refuse True (see
        ``BlockScaledRecipe``); CustomRecipe's default None leaves each GEMM
        its mode's default.
      backward_fast_accumulation: (keyword only, every recipe) the two
        backward GEMMs (dgrad, wgrad) use fast accumulation too. Off by
        default: gradients are summed with split accumulation. On, the
        backward pass is faster and its sums less exact, as in
        TransformerEngine-JAX's current scaling, which uses fast
        accumulation for all three GEMMs.
      gemm_autotune: (keyword only, every recipe) the GEMMs time cuBLASLt's
        candidate algorithms the first time each configuration runs and keep
        the fastest. Off by default: cuBLASLt's heuristic choice, so every
        run gives the same result bits.
    """

    fast_accumulation: bool | None = dataclasses.field(default=True, kw_only=True)
    backward_fast_accumulation: bool = dataclasses.field(default=False, kw_only=True)
    gemm_autotune: bool = dataclasses.field(default=False, kw_only=True)

    _fast_accumulation_may_be_none = False

    def __new__(cls, *args, **kwargs):
        # Before the dataclass __init__, whose bare "unexpected keyword argument" would name no fix.
        check_te_fields(cls.__name__, (f.name for f in dataclasses.fields(cls)), kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        if not (self.fast_accumulation is None and self._fast_accumulation_may_be_none):
            _bool(type(self).__name__, "fast_accumulation", self.fast_accumulation)
        _bool(type(self).__name__, "backward_fast_accumulation", self.backward_fast_accumulation)
        _bool(type(self).__name__, "gemm_autotune", self.gemm_autotune)

    def quantizer(self, role: str) -> Any:
        raise NotImplementedError


def _set(obj, name, value) -> None:
    object.__setattr__(obj, name, value)


def _check_scaling_factor_compute_algo(fn) -> None:
    """``fn`` must be None or callable as ``fn(amax, scale, fp8_max, recipe)``."""
    if fn is None:
        return
    wanted = "None or a callable f(amax, scale, fp8_max, recipe) -> new scale (TransformerEngine's signature)"
    if not callable(fn):
        raise ValueError(f"te_jax: DelayedScaling.scaling_factor_compute_algo must be {wanted}, got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(None, None, None, None)
    except TypeError as e:
        raise ValueError(f"te_jax: DelayedScaling.scaling_factor_compute_algo must be {wanted}; "
                         f"{getattr(fn, '__name__', fn)!r}{signature} cannot take those four arguments ({e})") from None


@dataclasses.dataclass(frozen=True)
class _ScalingFactorOfRecipe:
    """The quantizer's ``f(amax, scale, fp8_max, margin)`` calling the recipe's ``fn(amax, scale, fp8_max, recipe)``."""

    fn: Callable
    recipe: Recipe

    def __call__(self, amax, scale, fp8_max, margin):
        return self.fn(amax, scale, fp8_max, self.recipe)


@dataclasses.dataclass(frozen=True)
class BlockScaledRecipe(Recipe):
    """Base of the block-scaled recipes, whose GEMMs always accumulate in float32.

    Float8 block scaling's kernels promote every 128-long K block into float32
    sums; MXFP8 and NVFP4 run as block-scaled MMA (sm_100) or as a bfloat16
    GEMM (sm_90), both with float32 accumulation. FP8 fast accumulation
    cannot apply, so ``fast_accumulation`` and ``backward_fast_accumulation``
    default to False and True is refused.
    """

    fast_accumulation: bool = dataclasses.field(default=False, kw_only=True)
    backward_fast_accumulation: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        for name in ("fast_accumulation", "backward_fast_accumulation"):
            if getattr(self, name):
                raise ValueError(f"te_jax: {type(self).__name__}.{name} must be False: its GEMMs always accumulate "
                                 "in float32 (block-scaled kernels promote every block; MXFP8 and NVFP4 run as "
                                 "block-scaled MMA on sm_100 or a bfloat16 GEMM on sm_90), so FP8 fast accumulation "
                                 "cannot apply")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from an amax history kept in the "fp8_meta" collection.

    Attributes:
      margin: the scale is divided by ``2**margin`` (an int >= 0).
      fp8_format: Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3.
      amax_history_len: number of steps of amax history (>= 1). An amax that
        is NaN or Inf (one bad micro-batch) is recorded as 0, so the scale
        comes from the rest of the history instead of freezing for its
        length; the statistics count it as ``skipped_update``.
      amax_compute_algo: "max" (over the history), "most_recent", or a
        callable ``f(amax_history f32[L]) -> amax``.
      scaling_factor_compute_algo: None, or a callable
        ``f(amax, scale, fp8_max, recipe) -> new scale``, TransformerEngine's
        signature: ``amax`` is the f32[1] amax the history gives, ``scale``
        the current f32[1] scale, ``fp8_max`` the tensor format's largest
        value (a float: 448 for E4M3, 57344 for E5M2) and ``recipe`` this
        recipe (e.g. ``recipe.margin``). As for the default
        ``(fp8_max / amax) / 2**margin``, the old scale is kept where
        ``amax`` is 0 or not finite, and the result is capped at 2^126.
        A result that is NaN, Inf, 0 or negative also keeps the old scale
        (the statistics count it as ``skipped_update``); a result that is
        neither a scalar nor shaped like ``scale`` raises at trace time.
      reduce_amax: reduce amaxes over the autocast MeshResource's mesh axes
        (every manual axis when it gives none) inside shard_map, so every
        device keeps the same state. Under jit with shardings amaxes are
        global anyway. (With check_vma, state passed in replicated still
        comes back max-merged over the devices, as its type demands.)
      amax_reduction: "max" (lax.pmax) or "mean" (lax.pmean).
    """

    # The defaults are DelayedScalingQuantizer's, so the recipe and a quantizer built directly agree.
    margin: int = DelayedScalingQuantizer.margin
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = DelayedScalingQuantizer.amax_history_len
    amax_compute_algo: str | Callable = DelayedScalingQuantizer.amax_compute_algo
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = DelayedScalingQuantizer.reduce_amax
    amax_reduction: str = DelayedScalingQuantizer.amax_reduction

    def __post_init__(self):
        super().__post_init__()
        _set(self, "fp8_format", _format("DelayedScaling", self.fp8_format))
        # The recipe's scaling_factor_compute_algo takes the recipe, so its signature is checked here first.
        _check_scaling_factor_compute_algo(self.scaling_factor_compute_algo)
        check_delayed_config("DelayedScaling", margin=self.margin, amax_history_len=self.amax_history_len,
                             amax_compute_algo=self.amax_compute_algo,
                             scaling_factor_compute_algo=self.scaling_factor_compute_algo,
                             amax_reduction=self.amax_reduction)
        _bool("DelayedScaling", "reduce_amax", self.reduce_amax)

    def quantizer(self, role: str) -> DelayedScalingQuantizer | None:
        dtype = _operand_dtype(self.fp8_format, role)
        return None if dtype is None else DelayedScalingQuantizer(
            dtype=dtype,
            margin=self.margin,
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            scaling_factor_compute_algo=None if self.scaling_factor_compute_algo is None
            else _ScalingFactorOfRecipe(self.scaling_factor_compute_algo, self),
            reduce_amax=self.reduce_amax,
            amax_reduction=self.amax_reduction,
        )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale computed from each tensor's own amax; no state.

    Attributes:
      fp8_format: Format.HYBRID or Format.E4M3.
      use_power_2_scales: round each scale down to a power of two.
      amax_epsilon: lower bound on the amax used for the scale (finite, >= 0).
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        _set(self, "fp8_format", _format("Float8CurrentScaling", self.fp8_format))
        _bool("Float8CurrentScaling", "use_power_2_scales", self.use_power_2_scales)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"te_jax: Float8CurrentScaling.amax_epsilon must be a finite number >= 0, got {eps!r}")

    def quantizer(self, role: str) -> CurrentScalingQuantizer | None:
        dtype = _operand_dtype(self.fp8_format, role)
        return None if dtype is None else CurrentScalingQuantizer(
            dtype=dtype, power_2_scales=self.use_power_2_scales, amax_epsilon=float(self.amax_epsilon))


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(BlockScaledRecipe):
    """MXFP8: 1x32 blocks along the contraction axis with power-of-two (E8M0) scales.

    Attributes:
      fp8_format: Format.E4M3 (every tensor) or Format.HYBRID (E5M2 gradients).
    """

    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        super().__post_init__()
        _set(self, "fp8_format", _format("MXFP8BlockScaling", self.fp8_format))

    def quantizer(self, role: str) -> MXFP8Quantizer | None:
        dtype = _operand_dtype(self.fp8_format, role)
        return None if dtype is None else MXFP8Quantizer(dtype=dtype)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(BlockScaledRecipe):
    """NVFP4: E2M1 values in 16-element blocks with E4M3 block scales and a float32 global scale.

    By default weights use 16x16 (2D) blocks, the wgrad operands of inputs and
    gradients get a 16-point random Hadamard transform, and gradients are
    rounded stochastically (layers then need a PRNG key, see ``te_jax.dense``).

    Attributes:
      disable_rht: no random Hadamard transform on inputs and gradients.
      disable_stochastic_rounding: round gradients to nearest instead.
      disable_2d_quantization: weights use 1x16 blocks like the other tensors.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _bool("NVFP4BlockScaling", name, getattr(self, name))

    def quantizer(self, role: str) -> NVFP4Quantizer | None:
        role = as_role(role)
        if role == LINEAR_WEIGHT:
            return NVFP4Quantizer(block_2d=not self.disable_2d_quantization)
        if role == LINEAR_INPUT:
            return NVFP4Quantizer(rht=not self.disable_rht)
        if role == LINEAR_GRAD_OUTPUT:
            return NVFP4Quantizer(rht=not self.disable_rht, stochastic_rounding=not self.disable_stochastic_rounding)
        return None


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(BlockScaledRecipe):
    """Float8 block scaling: 1x128 (dim 1) or 128x128 (dim 2) blocks with float32 scales.

    A GEMM cannot take two 128x128-blocked operands, so at most one of the
    three block dims may be 2.

    Attributes:
      fp8_format: Format.E4M3 or Format.HYBRID.
      x_block_scaling_dim: 1 or 2, for inputs.
      w_block_scaling_dim: 1 or 2, for weights.
      grad_block_scaling_dim: 1 or 2, for output gradients.
      use_f32_scales: keep exact float32 scales instead of rounding them down
        to powers of two.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    use_f32_scales: bool = False

    def __post_init__(self):
        super().__post_init__()
        _set(self, "fp8_format", _format("Float8BlockScaling", self.fp8_format))
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}
        for name, dim in dims.items():
            _check_choice(f"Float8BlockScaling.{name}_block_scaling_dim", dim, (1, 2))
        two_d = [f"{name}_block_scaling_dim" for name, dim in dims.items() if dim == 2]
        if len(two_d) > 1:
            raise ValueError(
                f"te_jax: Float8BlockScaling: {' and '.join(two_d)} are both 2, but a GEMM cannot multiply two "
                "128x128-blocked operands; set at most one block dim to 2"
            )
        _bool("Float8BlockScaling", "use_f32_scales", self.use_f32_scales)

    def quantizer(self, role: str) -> Float8BlockQuantizer | None:
        role = as_role(role)
        dim = {LINEAR_INPUT: self.x_block_scaling_dim, LINEAR_WEIGHT: self.w_block_scaling_dim,
               LINEAR_GRAD_OUTPUT: self.grad_block_scaling_dim}.get(str(role))
        if dim is None:
            return None
        return Float8BlockQuantizer(
            dtype=self.fp8_format.dtype(role), block_2d=dim == 2, power_2_scales=not self.use_f32_scales
        )


@dataclasses.dataclass(frozen=True)
class CustomRecipe(Recipe):
    """A recipe defined by a quantizer factory.

    Attributes:
      qfactory: ``f(role: Role) -> quantizer | None``. A quantizer is any
        object following the protocol in ``te_jax.quantize.quantizers``
        (``CurrentScalingQuantizer`` is the basic building block); None keeps
        that tensor in high precision. Quantizers returned for
        "linear_output" and "linear_grad_input" quantize those GEMM outputs too.
    """

    qfactory: Callable[[Role], Any]
    fast_accumulation: bool | None = dataclasses.field(default=None, kw_only=True)

    _fast_accumulation_may_be_none = True  # None: each GEMM's mode default (its quantizers may mix modes)

    def __post_init__(self):
        super().__post_init__()
        if not callable(self.qfactory):
            raise ValueError(f"te_jax: CustomRecipe.qfactory must be a callable f(role) -> quantizer | None, "
                             f"got {self.qfactory!r}")

    def quantizer(self, role: str) -> Quantizer | None:
        role = as_role(role)
        q = self.qfactory(role)
        if q is not None and not (isinstance(q, Quantizer) and callable(q.quantize)):
            raise TypeError(f"te_jax: CustomRecipe.qfactory returned {q!r} for {role!r}; return None or an "
                            "object with quantize(x, state=None, *, rowwise, colwise, flatten_axis, key) "
                            "(te_jax.quantize.Quantizer)")
        return q


BUILTIN = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
"""The built-in recipes by short name. ``load_recipe`` also takes each one's class
name (``"DelayedScaling"``) and its snake case (``"delayed_scaling"``)."""
