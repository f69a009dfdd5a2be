"""The declared quantizer and bundle interfaces, and the named delayed-scaling state types."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.core import bundles as B
from te_jax.core.bundles import GemmBundle, MultiGemmBundle, QuantizerBundle
from te_jax.moe.experts import ExpertQuantizers, MoEQuantizers
from te_jax.quantize import delayed
from te_jax.quantize import protocols as P
from te_jax.quantize.delayed import DelayedState, StateUpdate
from te_jax.core import DenseQuantizers, MLPQuantizers


@dataclasses.dataclass(frozen=True)
class _Plain:
    """A custom quantizer with nothing but ``quantize``."""

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None):
        return te_jax.quantize.CurrentScalingQuantizer().quantize(x, rowwise=rowwise, colwise=colwise,
                                                                 flatten_axis=flatten_axis)


@dataclasses.dataclass(frozen=True)
class _Counting(_Plain):
    """The documented minimum of a stateful quantizer: init_state and update_state (counts its uses)."""

    def init_state(self):
        return {"count": jnp.zeros((1,), jnp.float32)}

    def update_state(self, state, amax):
        return {"count": state["count"] + 1}


def test_builtin_and_custom_quantizers_meet_the_declared_protocols():
    d, c = te_jax.quantize.DelayedScalingQuantizer(), te_jax.quantize.CurrentScalingQuantizer()
    nv = te_jax.quantize.NVFP4Quantizer(stochastic_rounding=True)
    assert isinstance(d, P.StatefulQuantizer) and B.as_stateful(d) is d
    assert all(isinstance(q, (P.Quantizer, P.FusedCast, P.HasScalingMode)) for q in (d, c, nv))
    assert not isinstance(c, P.StatefulQuantizer) and B.as_stateful(c) is None and B.as_stateful(None) is None
    assert isinstance(c, P.QuantizeLike) and not isinstance(d, P.QuantizeLike)
    assert B.rounds_stochastically(nv) and not B.rounds_stochastically(c) and not B.rounds_stochastically(None)
    plain = _Plain()
    assert isinstance(plain, P.Quantizer) and B.as_stateful(plain) is None
    assert not isinstance(plain, (P.FusedCast, P.HasScalingMode, P.QuantizeLike, P.StochasticRounding))
    assert B.scaling_mode_of(plain) is None and B.scaling_mode_of(c) is c.scaling_mode
    completed = B.as_stateful(_Counting())
    assert isinstance(completed, P.StatefulQuantizer) and completed.reduce_amax is False


def test_bundles_meet_the_declared_bundle_protocols():
    dq = DenseQuantizers(input=te_jax.quantize.DelayedScalingQuantizer(amax_history_len=2))
    eq = ExpertQuantizers(dq, 3)
    for b in (dq, eq):
        assert isinstance(b, GemmBundle) and not isinstance(b, MultiGemmBundle)
    for b in (MLPQuantizers(dq, dq), MoEQuantizers(eq, eq)):
        assert isinstance(b, MultiGemmBundle) and isinstance(b, QuantizerBundle)
        assert set(b.init_state()) == {"wi", "wo"} and b.quantized_roles() == {"wi": ("linear_input",),
                                                                                "wo": ("linear_input",)}
    assert eq.init_state()["linear_input"]["amax_history"].shape == (2,)  # only the weight's has the expert axis
    weight = DenseQuantizers(weight=te_jax.quantize.DelayedScalingQuantizer(amax_history_len=2))
    assert ExpertQuantizers(weight, 3).init_state()["linear_weight"]["scale"].shape == (3, 1)


def test_a_custom_quantizer_with_init_and_update_state_only_keeps_its_state():
    x, k = jnp.ones((4, 32), jnp.float32), jnp.ones((32, 16), jnp.float32)
    q = DenseQuantizers(input=_Counting())
    state = q.init_state()
    assert set(state) == {"linear_input"}
    _, new = te_jax.dense(x, k, quantizers=q, state=state)
    assert float(new["linear_input"]["count"][0]) == 1.0

    def loss(state):
        return jnp.sum(te_jax.dense(x, k, quantizers=q, state=state)[0])

    with te_jax.train.fp8_state_updates():
        grads = jax.grad(loss)(state)
    assert float(grads["linear_input"]["count"][0]) == 1.0  # its update is its own gradient form


def test_the_state_and_its_update_form_are_named():
    st = delayed.init_state(3)
    assert isinstance(st, dict) and delayed.is_state(st)  # the stored layout is the documented dict
    view = DelayedState.of(st)
    assert delayed.is_state(view) and view._asdict().keys() == st.keys()
    q = te_jax.quantize.DelayedScalingQuantizer(amax_history_len=3)
    rejects = te_jax.quantize.DelayedScalingQuantizer(amax_history_len=3,
                                                      scaling_factor_compute_algo=lambda a, s, m, mg: a * jnp.nan)
    # an Inf amax is skipped (recorded as 0): on a zero history it keeps the scale like amax 0; a scale the
    # scaling_factor_compute_algo gives that is not finite and positive keeps it and wins merges
    for q_, amax, scale in ((q, 2.0, -224.0), (q, 0.0, delayed.KEEP_ZERO_AMAX), (q, np.inf, delayed.KEEP_ZERO_AMAX),
                            (rejects, 2.0, delayed.KEEP_NONFINITE_AMAX)):
        update = StateUpdate.of(q_.state_gradient(st, jnp.float32(amax)))
        assert float(update.scale[0]) == scale, amax
        new = delayed.decode_update(view, update)
        assert float(new.scale[0]) == (224.0 if scale == -224.0 else 1.0)
    unused = StateUpdate(jnp.full((3,), -jnp.inf), jnp.full((1,), -jnp.inf))
    kept = delayed.decode_update(DelayedState(jnp.arange(3.0), jnp.full((1,), 7.0)), unused)
    assert np.array_equal(kept.amax_history, [0, 1, 2]) and float(kept.scale[0]) == 7.0
