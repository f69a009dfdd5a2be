"""Names shared by several layers of te_jax (Flax collections, RNG streams).

This module imports nothing, so any layer may read it.
"""

FP8_COLLECTION = "fp8_meta"  # Flax collection holding the delayed-scaling state of every layer
STATS_COLLECTION = "fp8_stats"  # Flax collection holding the quantization statistics (inspect=True)
QUANTIZE_RNG = "quantize"  # Flax RNG stream that seeds NVFP4 stochastic rounding

__all__ = ["FP8_COLLECTION", "QUANTIZE_RNG", "STATS_COLLECTION"]
