"""Training with FP8 state: ``value_and_grad``, ``TrainState`` and the state-update form.

The state after forward *and* backward comes back as the gradient of
``variables["fp8_meta"]``, in a form whose elementwise max merges two uses of
a state (``te_jax.train.step``); ``TrainState.apply_gradients`` hands the
optimizer the parameters only and turns that gradient into the new state.
"""

from te_jax.core.gemm_quant import FP8StateError, fp8_state_updates
from te_jax.train.step import (FP8Gradients, TrainState, accumulate_gradients, apply_fp8_update, apply_gradients, grad,
                               merge_fp8_updates, merge_gradients, to_max_merging, unused_update, value_and_grad)

__all__ = ["FP8Gradients", "FP8StateError", "TrainState", "accumulate_gradients", "apply_fp8_update",
           "apply_gradients", "fp8_state_updates", "grad", "merge_fp8_updates", "merge_gradients", "to_max_merging",
           "unused_update", "value_and_grad"]
