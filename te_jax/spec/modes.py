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
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

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
