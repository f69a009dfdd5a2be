"""MaxText 0.2.5 trains with te_jax: ``quantization=te_jax_<recipe>`` after ``te_jax.maxtext.register()``.

The MaxText tests need MaxText, which needs Python >= 3.12 (CI's environment is
Python 3.11: they skip there, saying so). The Linen-op tests run everywhere.
With the Python 3.12 environment of docs/integrations.md ("MaxText"):

    XLA_FLAGS=--xla_backend_optimization_level=0 \\
      .venv312/bin/python -m pytest -q -x -p no:cacheprovider -n 0 tests/integrations/test_maxtext.py

(jax 0.11's XLA:CPU no longer knows ``--xla_cpu_use_fusion_emitters``.)

The training tests run MaxText's own train loop (``train.train_loop``, its
jitted NNX train step, synthetic data: one fixed batch, so the loss falls
steadily) on a tiny llama-style dense decoder and a tiny mixtral MoE decoder
(``sparse_matmul=False``: the experts' einsums; and ``sparse_matmul=True,
megablox=False``: the experts on ``ragged_dot``), 30 steps each, in bfloat16,
under MaxText's own ``quantization=fp8`` (the measure of FP8 noise) and under
te_jax's current, delayed and block recipes (delayed refused in the dropless
path): 14 runs, about 8 minutes on two CPU cores (``-k "not trains"``: the
rest, about 1.5 minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.core import DenseQuantizers
from te_jax.core.dot_general import einsum as te_einsum
import te_jax.maxtext
from te_jax.maxtext import DotGeneralOp, EinsumOp
from te_jax.quantize import overwrite

OWG = overwrite.OVERWRITE_COLLECTION
HAS_MAXTEXT = sys.version_info >= (3, 12) and importlib.util.find_spec("maxtext") is not None
needs_maxtext = pytest.mark.skipif(
    not HAS_MAXTEXT, reason="MaxText is not installed (it needs Python >= 3.12; CI runs 3.11): make the .venv312 of "
                            "docs/integrations.md ('MaxText') and run this file with it")

RECIPES = {"current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling(), "block": R.Float8BlockScaling()}


def _rand(seed: int, shape, dtype=jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---- the Linen ops MaxText calls (no MaxText needed) ----------------------------------------------------------


class _Injected(nn.Module):
    """``te_jax.flax.DotGeneral`` under an autocast of the caller: what ``DotGeneralOp`` must equal."""

    @nn.compact
    def __call__(self, x, w, dn):
        return tf.DotGeneral(name="te_jax")(x, w, dn)


@pytest.mark.parametrize("name", list(RECIPES))
def test_dot_general_op_is_the_injected_dot_general_under_its_recipe(name):
    """Forward, gradients and the state's new value are te_jax.flax.DotGeneral's under te_jax.autocast(recipe)."""
    recipe = RECIPES[name]
    x, w = _rand(1, (4, 6, 3, 128)), _rand(2, (3, 128, 256)) * 0.05  # two contracted axes, as MaxText's "out"
    dn = (((2, 3), (0, 1)), ((), ()))
    op = DotGeneralOp(recipe)
    variables = op.init(jax.random.key(0), x, w, dn)
    with te_jax.autocast(recipe=recipe):
        ref_vars = _Injected().init(jax.random.key(0), x, w, dn)
    assert jax.tree.structure(variables) == jax.tree.structure(ref_vars)

    def loss(apply, variables, x, w):
        return jnp.sum(jnp.sin(apply(variables, x, w, dn).astype(jnp.float32)))

    got = jax.value_and_grad(loss, argnums=(1, 2, 3))(op.apply, variables, x, w)
    with te_jax.autocast(recipe=recipe):
        want = jax.value_and_grad(loss, argnums=(1, 2, 3))(_Injected().apply, ref_vars, x, w)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    y, exact = op.apply(variables, x, w, dn), jax.lax.dot_general(x, w, dn)
    assert 0 < _rel(y, exact) < 0.1, "quantized: close to the bfloat16 product, not equal to it"
    if name == "delayed":  # the gradient of the state is its new value: the amaxes of this step
        new = got[1][0][OWG]["te_jax"]
        assert float(jnp.max(new["linear_input"]["amax_history"])) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))


@pytest.mark.parametrize("equation,lhs_shape,rhs_shape", [
    ("BSM,EMH -> BSEH", (2, 8, 128), (4, 128, 128)),  # MaxText's dropless MoE up projections
    ("BSEH,EHM -> BSEM", (2, 8, 4, 128), (4, 128, 128)),  # its down projection: E is a batch letter
    ("EBCM,EMH -> EBCH", (4, 2, 8, 128), (4, 128, 128)),  # capacity-factor MoE
])
def test_einsum_op_is_te_jax_einsum(equation, lhs_shape, rhs_shape):
    """EinsumOp computes te_jax.core.einsum bit for bit (current scaling), FP8-close to jnp.einsum."""
    recipe = RECIPES["current"]
    x, w = _rand(3, lhs_shape), _rand(4, rhs_shape) * 0.05
    op = EinsumOp(recipe)
    variables = op.init(jax.random.key(0), equation, x, w)
    assert not variables, "a stateless recipe creates no variables"
    y = op.apply(variables, equation, x, w)
    want, _ = te_einsum(equation, x, w, quantizers=DenseQuantizers.from_recipe(recipe, ()))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert 0 < _rel(y, jnp.einsum(equation, x, w)) < 0.1


def test_einsum_op_creates_the_per_expert_state_maxtext_initializes_once():
    """MaxText initializes the experts' einsums with a 1x1 product; the down projection's state must exist then."""
    recipe, experts = RECIPES["delayed"], 4
    tiny = jnp.zeros((1, 1), jnp.bfloat16)

    # The initialization's batched 1x1 product (the "batched" state's) runs on the grouped GEMM, K = N = 1 zero
    # padded to the CUDA kernels' 16: lowered for CUDA (on any machine: what XLA:GPU compiles), it passes their
    # checks. (Lowered alone: a jitted init drops it, its result unused; an eager init, as here, runs it.)
    ones = jnp.ones((experts, 1, 1), jnp.bfloat16)
    batched = jax.jit(lambda a, b: DotGeneralOp(recipe).init_with_output(jax.random.key(0), a, b,
                                                                          (((2,), (1,)), ((0,), (0,)))))
    hlo = batched.trace(ones, ones).lower(lowering_platforms=("cuda",)).as_text()
    calls = hlo.count("custom_call @te_jax_grouped_gemm_fp8(")
    assert calls == 1, f"{calls} grouped GEMM calls in the CUDA program of the batched 1x1 product, not 1"
    variables = EinsumOp(recipe, batch_groups=experts).init(jax.random.key(0), "ab,bc->ac", tiny, tiny)
    state = variables[OWG]
    assert set(state) == {"dot_general", "batched"}, set(state)
    shapes = {k: state[k]["te_jax"]["linear_weight"]["amax_history"].shape for k in state}
    assert shapes["batched"][0] == experts and len(shapes["dot_general"]) == 1, f"weight amax histories {shapes}"
    eq, x, w = "BSEH,EHM -> BSEM", _rand(5, (2, 8, experts, 128)), _rand(6, (experts, 128, 128))
    w = w * jnp.arange(1, experts + 1, dtype=w.dtype)[:, None, None]  # a different amax per expert

    def loss(variables):
        return jnp.sum(EinsumOp(recipe, batch_groups=experts).apply(variables, eq, x, w).astype(jnp.float32) ** 2)

    new = jax.grad(loss)(variables)[OWG]["batched"]["te_jax"]["linear_weight"]["amax_history"]
    want = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(jnp.max(new, axis=-1)), np.asarray(want),
                                  err_msg="each expert's new weight amax (got, want)")
    with pytest.raises(ValueError, match="te_jax: .*has no _overwrite_with_gradient state"):  # none prepared
        bare = EinsumOp(recipe).init(jax.random.key(0), "ab,bc->ac", tiny, tiny)
        EinsumOp(recipe).apply(bare, eq, x, w)


# ---- MaxText: the config names and configure_quantization --------------------------------------------------


def _maxtext_argv(run_name: str, out: str, **overrides) -> list:
    import maxtext  # pylint: disable=import-outside-toplevel

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    settings = dict(run_name=run_name, base_output_directory=out, hardware="cpu", skip_jax_distributed_system=True,
                    dataset_type="synthetic", enable_checkpointing=False, enable_tensorboard=False,
                    enable_goodput_recording=False, monitor_goodput=False, jax_cache_dir="", attention="dot_product",
                    log_period=1000)
    settings.update(overrides)
    return [None, base] + [f"{k}={v}" for k, v in settings.items()]


def _config(tmp_path, **overrides):
    from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

    te_jax.maxtext.register()
    return pyconfig.initialize(_maxtext_argv("config", str(tmp_path), **overrides))


@needs_maxtext
def test_register_adds_te_jax_names_to_maxtext_and_keeps_refusing_others(tmp_path):
    names = te_jax.maxtext.register()
    assert {"te_jax_current", "te_jax_delayed", "te_jax_block", "te_jax_mxfp8", "te_jax_nvfp4"} <= set(names)
    assert _config(tmp_path, quantization="te_jax_block").quantization == "te_jax_block"
    assert _config(tmp_path, quantization="fp8").quantization == "fp8"  # MaxText's own names still validate
    with pytest.raises(Exception, match="te_jax_current"):  # pydantic's error lists the te_jax names too
        _config(tmp_path, quantization="te_jax_bogus")
    with pytest.raises(ValueError, match="te_jax: .*must start with 'te_jax_'"):
        te_jax.maxtext.register({"current": R.Float8CurrentScaling()})
    with pytest.raises(ValueError, match="te_jax: .*not a te_jax recipe"):
        te_jax.maxtext.register({"te_jax_x": "current"})
    from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

    original = quantizations.configure_quantization.te_jax_original
    mine = te_jax.maxtext.register({"te_jax_fast_current": R.Float8CurrentScaling(backward_fast_accumulation=True)})
    assert "te_jax_fast_current" in mine and "te_jax_delayed" in mine, "registering again extends the table"
    assert quantizations.configure_quantization.te_jax_original is original, "the wrapper wraps MaxText's only"


@needs_maxtext
def test_configure_quantization_answers_te_jax_names_only(tmp_path):
    from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel
    from te_jax.maxtext.quantization import TeJaxQuantization  # pylint: disable=import-outside-toplevel

    te_jax.maxtext.register()  # before the calls below look configure_quantization up (before _config runs)
    quant = quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_delayed"))
    assert isinstance(quant, TeJaxQuantization) and isinstance(quant.recipe, R.DelayedScaling)
    assert quant.quant_mode == "train" and not quant.needs_apply_rngs and quant.quantize_dtype is None
    assert not quantizations.in_serve_mode(quant) and quant.get_block_size() == 1
    fp8 = quantizations.configure_quantization(_config(tmp_path, quantization="fp8"))
    assert type(fp8) is quantizations.Fp8Quantization  # pylint: disable=unidiomatic-typecheck
    assert quantizations.configure_quantization(_config(tmp_path, quantization="")) is None
    block = quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_block"))
    assert block.get_block_size() == 128 and block != quant and hash(block) != hash(quant)
    accumulating = dict(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="te_jax: .*gradient_accumulation_steps=2"):
        quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_delayed", **accumulating))
    stateless = quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_current", **accumulating))
    assert isinstance(stateless.recipe, R.Float8CurrentScaling)
    with pytest.raises(ValueError, match="te_jax: .*training only"):
        quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_current"), quant_mode_str="serve")
    # MoE experts on megablox or tokamax kernels (MaxText's defaults) would stay bf16: refused, naming the fix
    moe = {**MODELS["moe"], "sparse_matmul": True}
    for kernels in (dict(megablox=True), dict(megablox=False, use_tokamax_gmm=True)):
        with pytest.raises(ValueError, match=r"te_jax: .*stay in bfloat16: set megablox=False and use_tokamax_gmm"):
            quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_current", **moe, **kernels))
    dropless = quantizations.configure_quantization(_config(tmp_path, quantization="te_jax_current", **moe,
                                                            megablox=False))
    assert isinstance(dropless, TeJaxQuantization)
    assert quantizations.configure_quantization(_config(tmp_path, quantization="fp8", **moe)) is not None  # MaxText's


# ---- MaxText: training ---------------------------------------------------------------------------------------

STEPS = 30
DIMS = dict(base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=4, head_dim=32, base_mlp_dim=256,
            base_num_decoder_layers=2, vocab_size=256, max_target_length=64, per_device_batch_size=4, steps=STEPS,
            learning_rate=3e-3)
MODELS = {
    "dense": {},  # MaxText's default decoder: llama2-style
    "moe": dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, base_mlp_dim=128,
                base_moe_mlp_dim=128, sparse_matmul=False),
    # MaxText's dropless path: the experts on ragged_dot (te_jax.ragged_dot under a te_jax recipe)
    "moe_sparse": dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, base_mlp_dim=128,
                       base_moe_mlp_dim=128, sparse_matmul=True, megablox=False),
}
_LOSSES: dict[tuple[str, str], list[float]] = {}


def _train(tmp_path_factory, model: str, quantization: str):
    """MaxText's train loop on ``model`` for STEPS steps: (losses per step, the final NNX train state)."""
    from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
    from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

    te_jax.maxtext.register()
    out = str(tmp_path_factory.mktemp(f"{model}_{quantization or 'bf16'}"))
    metrics = os.path.join(out, "metrics.jsonl")
    config = pyconfig.initialize(_maxtext_argv(f"{model}_{quantization or 'bf16'}", out, quantization=quantization,
                                               metrics_file=metrics, **{**DIMS, **MODELS[model]}))
    state = train.train_loop(config, None)
    with open(metrics, encoding="utf8") as f:
        losses = [json.loads(line)["learning/loss"] for line in f]
    return losses, state


def _reference_losses(tmp_path_factory, model: str, quantization: str) -> list[float]:
    """MaxText's own losses on ``model``: bfloat16 (``""``) or its ``quantization=fp8`` (flax's Fp8DotGeneral)."""
    if (model, quantization) not in _LOSSES:
        _LOSSES[model, quantization] = _train(tmp_path_factory, model, quantization)[0]
    return _LOSSES[model, quantization]


def _owg_leaves(state) -> dict[str, jax.Array]:
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return {jax.tree_util.keystr(p): v for p, v in leaves if "amax_history" in jax.tree_util.keystr(p)}


@needs_maxtext
@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("model", list(MODELS))
def test_maxtext_trains_under_te_jax_recipes(tmp_path_factory, monkeypatch, model, recipe):
    """Loss within FP8 noise of bfloat16 at every step; quantization visibly on; delayed state stepped.

    FP8 noise is measured, not guessed: MaxText's own ``quantization=fp8`` on the same model and batch
    departs from bfloat16 by ``fp8_gap`` at most; te_jax may depart by at most 1.5x that (plus 0.02).
    In MaxText's dropless path the experts run on ``te_jax.ragged_dot`` (counted), and delayed scaling,
    which has nowhere to keep its state there, is refused when tracing.
    """
    import te_jax.maxtext.experts as experts

    routed = []
    monkeypatch.setattr(experts, "te_ragged_dot", lambda *a, **k: routed.append(k) or te_jax.ragged_dot(*a, **k))
    if model == "moe_sparse" and recipe == "delayed":
        with pytest.raises(ValueError, match=r"te_jax: MaxText quantization='te_jax_delayed' keeps FP8 state .* "
                                             r"sparse_matmul=False"):
            _train(tmp_path_factory, model, "te_jax_delayed")
        with pytest.raises(ValueError, match=r"te_jax: MaxText quantization='te_jax_nvfp4' rounds gradients "
                                             r"stochastically.*disable_stochastic_rounding=True"):
            _train(tmp_path_factory, model, "te_jax_nvfp4")
        return
    reference = _reference_losses(tmp_path_factory, model, "")
    fp8 = _reference_losses(tmp_path_factory, model, "fp8")
    losses, state = _train(tmp_path_factory, model, "te_jax_" + recipe)
    _LOSSES[model, recipe] = losses
    gap = np.abs(np.asarray(losses) - np.asarray(reference))
    fp8_gap = float(np.max(np.abs(np.asarray(fp8) - np.asarray(reference))))
    print(f"\n{model} {recipe}: loss {[round(v, 4) for v in losses[::5]]} last {losses[-1]:.4f} max gap "
          f"{gap.max():.4f}; bf16 {[round(v, 4) for v in reference[::5]]} last {reference[-1]:.4f}; MaxText fp8 "
          f"{[round(v, 4) for v in fp8[::5]]} last {fp8[-1]:.4f} max gap {fp8_gap:.4f}")
    assert len(losses) == len(reference) == len(fp8) == STEPS and np.all(np.isfinite(losses))
    assert losses[-1] < 0.1 * losses[0], "it learns the fixed batch"
    assert fp8_gap > 0, "MaxText's fp8 gave bfloat16's losses: the reference noise is not FP8's"
    assert np.all(gap <= 1.5 * fp8_gap + 0.02), f"beyond FP8 noise ({fp8_gap:.4f}): {gap.round(4).tolist()}"
    assert np.all(gap <= 0.05 + 0.1 * np.asarray(reference)), f"beyond FP8 noise: {gap.round(4).tolist()}"
    assert gap.max() > 0, "the same losses as bfloat16: te_jax did not quantize"
    # wi_0, wi_1 and wo each trace one te_jax.ragged_dot (the decoder layers scanned) in the dropless path only
    assert len(routed) == (3 if model == "moe_sparse" else 0), len(routed)
    histories = _owg_leaves(state)
    if recipe != "delayed":
        assert not histories, "a stateless recipe keeps no FP8 state"
        return
    assert histories, "delayed scaling keeps its state in MaxText's _overwrite_with_gradient variables"
    # Each MoE einsum holds the state of both of its products (MaxText creates the three alike, before their
    # equations are known; EinsumOp): the up projections step "dot_general", the down projection "batched".
    unused = ("['wi_0']['batched']", "['wi_1']['batched']", "['wo']['dot_general']")
    for path, history in histories.items():
        if any(u in path for u in unused):
            assert float(jnp.max(jnp.abs(history))) == 0, f"{path} is not used, so MaxText writes its zero gradient"
        else:
            assert float(jnp.max(history)) > 0, f"{path} was never stepped"
    if model == "moe":  # the experts' einsums (the down projection per expert) and the router
        assert any("['quant_einsums']['wo']['batched']" in p for p in histories), list(histories)
        assert any("['quant_einsums']['wi_0']['dot_general']" in p for p in histories), list(histories)
        assert any("['gate']" in p for p in histories), list(histories)
