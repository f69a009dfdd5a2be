"""``te_jax.inspect``: per-layer, per-role quantization statistics, for choosing and developing recipes.

Off by default. Turned on by ``te_jax.autocast(recipe=..., inspect=True)``
(part of jit's cache key, like the recipe). Then every quantized tensor of
every te_jax layer (inputs, weights, outputs, output gradients, input
gradients) gets the statistics of ``te_jax.core.stats`` (amax, scale,
underflow, saturation, relative error, spread of block scales), computed
inside the step from the copy its GEMM reads, and they come back through the
Flax collection ``"fp8_stats"`` (``STATS_COLLECTION``)::

    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = model.init(key, x)                     # creates "fp8_stats" (zeros, never read)
        loss, grads = te_jax.train.value_and_grad(loss_fn)(variables)
    stats = grads["fp8_stats"]                             # every role, forward and backward
    rows = te_jax.inspect.to_rows(stats)                  # [{"layer", "role", "amax", ...}, ...]

``inspect=te_jax.inspect.Sample(every=8)`` reads every 8th row of each
activation and gradient instead of all of them: the statistics of those rows,
for about an eighth of the cost (``amax`` stays exact where the quantizer
measured it).

Forward-only (``model.apply(..., mutable=["fp8_stats"])``) gives the forward
roles. Writers: ``JsonlWriter``, ``TensorBoardWriter`` (``te_jax.inspect.writers``),
``te_jax.inspect.report`` (matplotlib PNG); the command line
``python -m te_jax.inspect.cli`` compares recipes layer by layer. See docs/inspect.md.
"""

from te_jax.inspect.records import compare_table, format_table, mean_over, merge_max, to_rows
from te_jax.core.stats import SATURATION_MARGIN, STAT_NAMES, STATS_COLLECTION, Sample, tensor_stats, zeros
from te_jax.inspect.writers import JsonlWriter, TensorBoardWriter, read_jsonl

__all__ = [
    "JsonlWriter", "SATURATION_MARGIN", "STATS_COLLECTION", "STAT_NAMES", "Sample", "TensorBoardWriter",
    "compare_table", "format_table", "mean_over", "merge_max", "read_jsonl", "tensor_stats", "to_rows", "zeros",
]
