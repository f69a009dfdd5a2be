"""The scaling-mode registry: one ``ModeSpec`` per quantization format.

A mode is everything te_jax knows about one way of laying out quantized data
and its scales:

* ``FP8_TENSOR``: one float32 scale ``[1]`` per tensor (delayed and current
  scaling); fused as the casts "fp8_tensor" (a given scale) and "fp8_current".
* ``MXFP8``: 1x32 blocks, uint8 E8M0 scales; fused cast "mxfp8".
* ``FP8_BLOCK``: 1x128 blocks, float32 scales; fused cast "fp8_block".
* ``FP8_BLOCK_2D``: 128x128 blocks, float32 scales; not fused.
* ``NVFP4``: 1x16 blocks, float8_e4m3fn scales and a float32 global amax,
  optional Hadamard transform of the columnwise copy; fused cast "nvfp4".
* ``NVFP4_2D``: 16x16 blocks, otherwise as NVFP4 (no Hadamard); not fused.

Layout rules every mode follows: data is the matrix ``[M, N]`` (NVFP4: two
E2M1 codes per byte, ``[M, N/2]``); block scales are ``[M/rows, N/cols]``
except that NVFP4's 16x16 scales are stored like 1x16 ones (each of a block's
16 rows repeats its scale); the columnwise copy is the same mode applied to
the transposed matrix ``[N, M]``. A per-tensor scale is shared by both copies;
NVFP4 keeps one float32 global amax per copy.

Block modes take any ``M`` and ``N``: a partial block at the end of an axis
is quantized with zero padding, so its scale comes from its own elements.
Each copy keeps its last axis (the one a GEMM contracts) padded to whole
blocks, ``N' = ceil(N / cols) * cols``, and its rows as they are: data
``[M, N']``, scales ``[ceil(M / rows), N' / cols]`` (``scale_shape``). Zero
padding on the contraction axis adds nothing to a product, and
``ScaledTensor.dequantize`` cuts the padding off.

Python code asks this registry (``mode_spec``, ``by_cast_mode``,
``by_gemm_target``) rather than branching on the mode; adding a mode means
adding an entry here and its kernels. The block lengths themselves are
``te_jax.spec.numerics.MXFP8_BLOCK`` / ``NVFP4_BLOCK`` / ``FP8_BLOCK``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref


class ScalingMode(enum.Enum):
    """The family of a ScaledTensor's scale layout (with ``block_2d`` it names a registry entry)."""

    FP8_TENSOR = "fp8_tensor"  # one float32 scale per tensor (delayed and current scaling)
    MXFP8 = "mxfp8"  # 1x32 blocks, E8M0 scales
    FP8_BLOCK = "fp8_block"  # 1x128 or 128x128 blocks, float32 scales
    NVFP4 = "nvfp4"  # 1x16 (or 16x16) blocks, E4M3 scales, float32 global amax


def _fp8_tensor_dequantize(q, s, amax, out_dtype):
    return ref.dequantize_fp8_tensor(q, s, out_dtype=out_dtype)


def _mxfp8_dequantize(q, s, amax, out_dtype):
    return ref.dequantize_mxfp8(q, s, out_dtype=out_dtype)


def _fp8_block_dequantize(q, s, amax, out_dtype):
    return ref.dequantize_fp8_block(q, s, block_2d=False, out_dtype=out_dtype)


def _fp8_block_2d_dequantize(q, s, amax, out_dtype):
    return ref.dequantize_fp8_block(q, s, block_2d=True, out_dtype=out_dtype)


def _nvfp4_dequantize(q, s, amax, out_dtype):
    return ref.dequantize_nvfp4(q, s, amax, out_dtype=out_dtype)


def _scale_slots(rows_a: int, rows_b: int, k: int, mats_a: int, mats_b: int) -> int:
    return 256 * (mats_a + mats_b)  # one 256-byte aligned slot (or region) per matrix


def _fp8_block_scratch(rows_a: int, rows_b: int, k: int, mats_a: int, mats_b: int) -> int:
    return 4 * (rows_a + rows_b) * (k // nm.FP8_BLOCK) + _scale_slots(rows_a, rows_b, k, mats_a, mats_b)


def _bf16_operands_scratch(rows_a: int, rows_b: int, k: int, mats_a: int, mats_b: int) -> int:
    return 2 * (rows_a + rows_b) * k


def _nvfp4_scratch(rows_a: int, rows_b: int, k: int, mats_a: int, mats_b: int) -> int:
    return _bf16_operands_scratch(rows_a, rows_b, k, mats_a, mats_b) + 8 * mats_a  # plus alpha/beta per matrix


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """One scaling mode: its layout, its kernels and its reference twin.

    Attributes:
      name: the registry key.
      family: the ``ScalingMode`` a ScaledTensor of this mode carries.
      label: the name used in error messages.
      block: ``(rows, cols)`` of the elements that share one scale, or None
        for one scale per tensor.
      scale_dtype: dtype of the stored scales.
      pack: values per stored data element (2: NVFP4's packed codes).
      global_amax: each copy also keeps a float32 global amax (NVFP4).
      hadamard: the columnwise copy may carry the 16-point random Hadamard
        transform (NVFP4 with 1x16 blocks).
      cast_modes: the fused-cast modes (``CastSpec.mode``) that write this
        mode inside a norm / activation kernel; empty when it is never fused.
      quantize_target, dequantize_target, gemm_target: FFI targets.
      gemm_k_multiple: what K must be a multiple of for the CUDA GEMM.
      native_gemm_capability: the lowest CUDA compute capability with a
        native GEMM; below it the CUDA handler runs the documented emulation
        (dequantize to bfloat16, then a bfloat16 GEMM with float32 accumulation).
      gemm_scratch: ``(rows_a, rows_b, k, mats_a, mats_b) -> bytes`` of
        scratch the CUDA GEMM handler carves out of its workspace.
      reference_quantize: the pure-JAX twin of the quantize kernel
        (``te_jax.spec.reference``).
      reference_dequantize: ``(data, scales, amax, out_dtype) -> values``,
        the pure-JAX twin of the dequantize kernel.
    """

    name: str
    family: ScalingMode
    label: str
    block: tuple[int, int] | None
    scale_dtype: Any
    pack: int
    global_amax: bool
    hadamard: bool
    cast_modes: tuple[str, ...]
    quantize_target: str
    dequantize_target: str
    gemm_target: str
    gemm_k_multiple: int
    native_gemm_capability: float
    gemm_scratch: Callable[[int, int, int, int, int], int]
    reference_quantize: Callable
    reference_dequantize: Callable

    @property
    def per_tensor(self) -> bool:
        return self.block is None

    @property
    def block_2d(self) -> bool:
        return self.block is not None and self.block[0] > 1

    @property
    def block_cols(self) -> int:
        """Elements per scale along a row (1 for per-tensor modes)."""
        return 1 if self.block is None else self.block[1]

    @property
    def rows_per_scale_row(self) -> int:
        """Data rows per row of stored scales: 128 for 128x128 Float8 blocks, else 1.

        NVFP4 stores its 16x16 scales like 1x16 ones (each block's 16 rows repeat its scale).
        """
        return self.block[0] if self.block_2d and self.family is ScalingMode.FP8_BLOCK else 1

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int] | tuple[int]:
        """The stored scales of a copy of the matrix ``[rows, cols]`` (``[1]`` for a per-tensor mode).

        A partial block at the end of an axis has a scale of its own.
        """
        if self.block is None:
            return (1,)
        return (-(-rows // self.rows_per_scale_row), -(-cols // self.block[1]))

    def tiles(self, shape, *, rowwise: bool, colwise: bool) -> bool:
        """Whether whole blocks tile ``[..., M, N]`` along every axis the copies asked for split into blocks."""
        if self.block is None:
            return True
        m, n, block = shape[-2], shape[-1], self.block[1]
        return not (((rowwise or self.block_2d) and n % block) or ((colwise or self.block_2d) and m % block))

    def check_tiles(self, shape, *, rowwise: bool, colwise: bool) -> None:
        """Raises a ValueError when whole blocks do not tile ``[..., M, N]``, what a kernel itself requires.

        The te_jax ops pad a partial block before the kernel; this guards the
        kernels' own operands (quantized data, a fused cast's output).
        """
        if not self.tiles(shape, rowwise=rowwise, colwise=colwise):
            axes = "both axes" if self.block_2d else " and ".join(
                a for a, on in (("the last axis", rowwise), ("the row axis", colwise)) if on)
            raise ValueError(
                f"te_jax: a {self.label} kernel takes whole {self.block[0]}x{self.block[1]} blocks along {axes}; got "
                f"shape {tuple(shape)}. Partial blocks are handled above the kernels: the quantize ops (and "
                "quantizers) pad them, and te_jax.quantize.fused runs such a norm or activation unfused.")


FP8_TENSOR = ModeSpec(
    name="fp8_tensor", family=ScalingMode.FP8_TENSOR, label="per-tensor FP8", block=None,
    scale_dtype=jnp.dtype(jnp.float32), pack=1, global_amax=False, hadamard=False,
    cast_modes=("fp8_tensor", "fp8_current"), quantize_target="te_jax_quantize_fp8",
    dequantize_target="te_jax_dequantize_fp8", gemm_target="te_jax_gemm_fp8", gemm_k_multiple=16,
    native_gemm_capability=9.0, gemm_scratch=_scale_slots, reference_quantize=ref.quantize_fp8_tensor,
    reference_dequantize=_fp8_tensor_dequantize)
MXFP8 = ModeSpec(
    name="mxfp8", family=ScalingMode.MXFP8, label="MXFP8", block=(1, nm.MXFP8_BLOCK),
    scale_dtype=jnp.dtype(jnp.uint8), pack=1, global_amax=False, hadamard=False, cast_modes=("mxfp8",),
    quantize_target="te_jax_quantize_mxfp8", dequantize_target="te_jax_dequantize_mxfp8",
    gemm_target="te_jax_gemm_mxfp8", gemm_k_multiple=32, native_gemm_capability=10.0,
    gemm_scratch=_bf16_operands_scratch, reference_quantize=ref.quantize_mxfp8, reference_dequantize=_mxfp8_dequantize)
FP8_BLOCK = ModeSpec(
    name="fp8_block", family=ScalingMode.FP8_BLOCK, label="Float8 block scaling", block=(1, nm.FP8_BLOCK),
    scale_dtype=jnp.dtype(jnp.float32), pack=1, global_amax=False, hadamard=False, cast_modes=("fp8_block",),
    quantize_target="te_jax_quantize_fp8_block", dequantize_target="te_jax_dequantize_fp8_block",
    gemm_target="te_jax_gemm_fp8_block", gemm_k_multiple=16, native_gemm_capability=9.0,
    gemm_scratch=_fp8_block_scratch, reference_quantize=ref.quantize_fp8_block,
    reference_dequantize=_fp8_block_dequantize)
FP8_BLOCK_2D = dataclasses.replace(
    FP8_BLOCK, name="fp8_block_2d", block=(nm.FP8_BLOCK, nm.FP8_BLOCK), cast_modes=(),
    reference_dequantize=_fp8_block_2d_dequantize)
NVFP4 = ModeSpec(
    name="nvfp4", family=ScalingMode.NVFP4, label="NVFP4", block=(1, nm.NVFP4_BLOCK),
    scale_dtype=jnp.dtype(jnp.float8_e4m3fn), pack=2, global_amax=True, hadamard=True, cast_modes=("nvfp4",),
    quantize_target="te_jax_quantize_nvfp4", dequantize_target="te_jax_dequantize_nvfp4",
    gemm_target="te_jax_gemm_nvfp4", gemm_k_multiple=32, native_gemm_capability=10.0, gemm_scratch=_nvfp4_scratch,
    reference_quantize=ref.quantize_nvfp4, reference_dequantize=_nvfp4_dequantize)
NVFP4_2D = dataclasses.replace(NVFP4, name="nvfp4_2d", block=(nm.NVFP4_BLOCK, nm.NVFP4_BLOCK), hadamard=False,
                               cast_modes=())

MODES: dict[str, ModeSpec] = {m.name: m for m in (FP8_TENSOR, MXFP8, FP8_BLOCK, FP8_BLOCK_2D, NVFP4, NVFP4_2D)}
CAST_MODES: tuple[str, ...] = ("none", *(c for m in MODES.values() for c in m.cast_modes))


def mode_spec(family: ScalingMode, block_2d: bool = False) -> ModeSpec:
    """The registry entry of a ScaledTensor's ``(mode, block_2d)``."""
    for spec in MODES.values():
        if spec.family is family and spec.block_2d == bool(block_2d):
            return spec
    raise ValueError(f"te_jax: {family} has no {'2D' if block_2d else '1D'}-block mode")


def by_cast_mode(cast_mode: str) -> ModeSpec:
    """The mode a fused cast (``CastSpec.mode``, not "none") writes."""
    for spec in MODES.values():
        if cast_mode in spec.cast_modes:
            return spec
    raise ValueError(f"te_jax: unknown cast mode {cast_mode!r}; choose one of {CAST_MODES}")


def by_gemm_target(target: str) -> ModeSpec:
    """The (first) mode whose GEMM runs as the FFI target ``target``."""
    for spec in MODES.values():
        if spec.gemm_target == target:
            return spec
    raise ValueError(f"te_jax: {target!r} is not a GEMM target of any scaling mode")


__all__ = ["CAST_MODES", "FP8_BLOCK", "FP8_BLOCK_2D", "FP8_TENSOR", "MODES", "MXFP8", "ModeSpec", "NVFP4", "NVFP4_2D",
           "ScalingMode", "by_cast_mode", "by_gemm_target", "mode_spec"]


def flattened_shape(shape: tuple[int, ...], flatten_axis: int) -> tuple[int, int]:
    """``(M, N)``: the product of the axes before and from ``flatten_axis``."""
    axis = flatten_axis % len(shape) if flatten_axis < 0 else flatten_axis
    if not 0 < axis < len(shape) + (len(shape) == 1):
        raise ValueError(f"te_jax: flatten_axis {flatten_axis} is out of range for shape {shape}")
    return math.prod(shape[:axis]), math.prod(shape[axis:])


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "colwise_amax"],
    meta_fields=["mode", "qdtype", "shape", "flatten_axis", "block_2d", "rht"],
)
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """A quantized tensor of logical shape ``shape``, viewed as a matrix ``[M, N]``.

    In the block modes each copy's last axis is zero padded to whole blocks
    (``N'``, ``M'`` below: ``N``, ``M`` rounded up to the block; equal to them
    when the blocks tile the matrix), so a partial block has its own scale;
    ``te_jax.ops.quantize.dequantize`` returns the logical shape.

    Attributes:
      data: rowwise quantized matrix ``[M, N]`` (block modes ``[M, N']``;
        NVFP4: ``[M, N'/2]`` packed uint8), or None.
      scale_inv: rowwise decode scales: ``[1]`` float32 (per tensor),
        ``[M, N'/32]`` uint8 E8M0 codes (MXFP8), ``[M, N'/128]`` or
        ``[ceil(M/128), N'/128]`` float32 (FP8 block), ``[M, N'/16]`` E4M3 (NVFP4).
      colwise_data / colwise_scale_inv: the same for the transposed matrix
        ``[N, M]``, or None.
      amax: float32 ``[1]``: the tensor's amax (per-tensor modes; NVFP4's
        global amax), else None.
      colwise_amax: NVFP4's global amax of the columnwise copy (after the
        Hadamard transform when ``rht``), else None.
      mode, qdtype, shape, flatten_axis, block_2d, rht: static layout;
        ``(mode, block_2d)`` names the registry entry ``scaling_mode``.
    """

    data: jax.Array | None
    scale_inv: jax.Array | None
    colwise_data: jax.Array | None
    colwise_scale_inv: jax.Array | None
    amax: jax.Array | None
    colwise_amax: jax.Array | None
    mode: ScalingMode
    qdtype: jnp.dtype
    shape: tuple[int, ...]
    flatten_axis: int = -1
    block_2d: bool = False
    rht: bool = False

    @classmethod
    def from_kernel_outputs(
        cls, spec: ModeSpec, qdtype, shape, *, q, s, q_t=None, s_t=None, amax=None, amax_t=None, rowwise=True,
        colwise=False, flatten_axis: int = -1, rht: bool = False,
    ) -> ScaledTensor:
        """The ScaledTensor of logical ``shape`` from what a quantize kernel of mode ``spec`` wrote.

        ``q, s, q_t, s_t, amax, amax_t`` are the kernel's outputs in the layouts
        of ``te_jax.ops.quantize``; the mode decides which are kept: a
        per-tensor scale ``s`` serves both copies (``s_t`` is ignored), the
        amax is kept by per-tensor modes and NVFP4 (which also keeps the
        columnwise ``amax_t``), and ``rht`` marks NVFP4's transformed
        columnwise copy. Outputs of a copy that was not asked for are dropped.
        """
        if rht and not spec.hadamard:
            raise ValueError(f"te_jax: the Hadamard transform (rht) applies to NVFP4 1x16 blocks, not {spec.name}")
        return cls(
            data=q if rowwise else None,
            scale_inv=s if rowwise else None,
            colwise_data=q_t if colwise else None,
            colwise_scale_inv=(s if spec.per_tensor else s_t) if colwise else None,
            amax=amax if spec.per_tensor or spec.global_amax else None,
            colwise_amax=amax_t if spec.global_amax and colwise else None,
            mode=spec.family,
            qdtype=jnp.dtype(qdtype),
            shape=tuple(shape),
            flatten_axis=flatten_axis,
            block_2d=spec.block_2d,
            rht=bool(rht and colwise),
        )

    @property
    def scaling_mode(self) -> ModeSpec:
        """This tensor's entry in the scaling-mode registry."""
        return mode_spec(self.mode, self.block_2d)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return flattened_shape(self.shape, self.flatten_axis)

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_colwise(self) -> bool:
        return self.colwise_data is not None


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """How a fused kernel writes its output (the FFI attribute contract of the cast).

    Attributes:
      mode: "none" (unquantized), "fp8_tensor" (given scale, delayed scaling),
        "fp8_current", "mxfp8", "fp8_block" (1x128), "nvfp4" (1x16).
      qdtype: the FP8 dtype (FP8 modes), the output dtype ("none"; None: the
        input's dtype), ignored for "nvfp4".
      rowwise, colwise: which copies ("none": rowwise only).
      power_2: power-of-two scales ("fp8_current", "fp8_block").
      epsilon: amax lower bound ("fp8_current").
      rht: random Hadamard transform of the columnwise copy ("nvfp4").
      stochastic_rounding: ("nvfp4"), needs a PRNG key.
    """

    mode: str = "none"
    qdtype: Any = None
    rowwise: bool = True
    colwise: bool = False
    power_2: bool = False
    epsilon: float = 0.0
    rht: bool = False
    stochastic_rounding: bool = False

    @property
    def attrs(self) -> dict:
        """The FFI attributes of the cast (``csrc/common/norm_act.h``: ParseCastSpec)."""
        return dict(
            mode=self.mode, rowwise=bool(self.rowwise), colwise=bool(self.colwise), power_2=bool(self.power_2),
            amax_epsilon=np.float32(self.epsilon), rht=bool(self.rht and self.colwise),
            stochastic_rounding=bool(self.stochastic_rounding),
        )

    @property
    def scaling_mode(self) -> modes.ModeSpec:
        """The registry entry this cast writes (not defined for "none")."""
        return modes.by_cast_mode(self.mode)


class CastOutputs(NamedTuple):
    """The seven cast results of a fused op (empty ``[0]`` arrays where not produced)."""

    q: jax.Array
    s: jax.Array
    q_t: jax.Array
    s_t: jax.Array
    amax: jax.Array
    amax_t: jax.Array
    scale: jax.Array
