"""te_jax injected into flax.linen (DotGeneral as dot_general_cls) and the flax-named layers Dense and Einsum."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from qtest_util import BUILTIN_RECIPES, assert_same_bits
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.quantize import overwrite

OWG = overwrite.OVERWRITE_COLLECTION


def _rand(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _same_tree(a, b, what: str) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    jax.tree.map(lambda x, y: assert_same_bits(x, y, what), a, b)


class Block(nn.Module):
    """flax's attention, DenseGeneral (two contracted axes) and Dense, each taking a ``dot_general_cls``."""

    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        dg = self.dot_general_cls
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_dot_general_cls=dg, out_dot_general_cls=dg)(x)
        h = nn.DenseGeneral((2, 16), dot_general_cls=dg)(x)
        x = x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), dot_general_cls=dg)(nn.gelu(h))
        return nn.Dense(8, dot_general_cls=dg)(x)


X = _rand(0, (2, 16, 32))

FLAX_LAYERS = {
    "Dense": (lambda dg: nn.Dense(12, dot_general_cls=dg), (4, 6, 32)),
    "DenseGeneral": (lambda dg: nn.DenseGeneral((3, 4), axis=(-2, -1), dot_general_cls=dg), (4, 6, 8)),
    "DenseGeneral_batch": (lambda dg: nn.DenseGeneral(5, axis=-1, batch_dims=(0,), dot_general_cls=dg), (3, 6, 8)),
    "attention": (lambda dg: nn.MultiHeadDotProductAttention(num_heads=2, qkv_dot_general_cls=dg,
                                                             out_dot_general_cls=dg), (2, 5, 8)),
    "block": (lambda dg: Block(dg), (2, 16, 32)),
}


@pytest.mark.parametrize("layer", list(FLAX_LAYERS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_outside_autocast_injection_is_flax_bit_for_bit(layer, dtype):
    make, shape = FLAX_LAYERS[layer]
    x = _rand(1, shape, dtype)
    ours, theirs = make(tf.DotGeneral), make(None)
    v_ours, v_theirs = ours.init(jax.random.key(0), x), theirs.init(jax.random.key(0), x)
    _same_tree(v_ours, v_theirs, "variables")  # no state: nothing but flax's parameters
    with te_jax.autocast(enabled=False):
        y = jax.jit(ours.apply)(v_theirs, x)
    assert_same_bits(y, jax.jit(theirs.apply)(v_theirs, x), layer)


def _grads(model, variables, x, recipe):
    """``(y, grads)`` of a fixed random-cotangent loss; the whole variables are differentiated (flax's OWG way)."""
    ct = _rand(99, model.apply(variables, x).shape)

    @jax.jit
    def run(variables):
        def loss(v):
            y = model.apply(v, x, rngs={"quantize": jax.random.key(5)})
            return jnp.sum(y * ct), y
        return jax.grad(loss, has_aux=True)(variables)

    with te_jax.autocast(recipe=recipe) if recipe is not None else te_jax.autocast(enabled=False):
        grads, y = run(variables)
    return y, grads


@pytest.mark.parametrize("recipe", list(BUILTIN_RECIPES))
def test_every_recipe_injected_within_fp8_bounds(recipe):
    model = Block(tf.DotGeneral)
    with te_jax.autocast(recipe=BUILTIN_RECIPES[recipe]):
        variables = jax.jit(model.init)(jax.random.key(0), X)
    assert (OWG in variables) == (recipe == "delayed")
    if recipe == "delayed":  # one step calibrates the scales (they start at 1): the gradient is the new state
        _, grads = _grads(model, variables, X, BUILTIN_RECIPES[recipe])
        variables = {**variables, OWG: grads[OWG]}
        scales = [float(overwrite.to_delayed(s).scale[0])
                  for s in jax.tree.leaves(variables[OWG], is_leaf=overwrite.is_state)]
        assert len(scales) == 7 * 3 and all(s != 1.0 for s in scales)  # 7 products, 3 stateful roles each
    y, grads = _grads(model, variables, X, BUILTIN_RECIPES[recipe])
    y_hp, grads_hp = _grads(model, variables, X, None)
    # E4M3 operands give ~5% error per GEMM on random data, E5M2 ~10%, NVFP4 ~15%; a wrong copy or role ~100%.
    tol = 0.3 if recipe == "nvfp4" else 0.08
    assert _rel(y, y_hp) < tol, f"y: relative error {_rel(y, y_hp):.4f} >= {tol} (recipe {recipe})"
    bound = 2 * tol + 0.1
    for layer, (got, want) in _layer_grads(grads["params"], grads_hp["params"]).items():
        err = _rel(got, want)
        assert err < bound, f"gradient of {layer} (kernel and bias): relative error {err:.4f} >= {bound}"


def _layer_grads(grads, grads_hp) -> dict:
    """``{layer path: (gradient, high-precision gradient)}``, each layer's parameters flattened into one vector.

    A layer is judged as a whole: flax adds the bias outside the injected product, so te_jax computes no part of
    a bias gradient, the output gradient summed over the tokens (the output gradient the layer's kernel
    gradient, te_jax's wgrad, takes too). On its own such a small sum is too noisy a measure of the FP8 error:
    the key bias's is 0 in exact arithmetic (softmax ignores it), and the query bias's (32 elements, behind
    attention's softmax backward) measured 0.22-0.30 under current scaling when the parameters moved by 2^-11
    (a GPU's TF32 and accumulation-order rounding), around the 0.26 bound every kernel gradient meets with
    margin (at most 0.14; a whole layer's at most 0.14, NVFP4's 0.44 against 0.7).
    """
    flat_hp = dict(jax.tree_util.tree_flatten_with_path(grads_hp)[0])
    layers: dict = {}
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        layer = jax.tree_util.keystr(path[:-1])
        layers.setdefault(layer, []).append((g, flat_hp[path]))
    return {layer: tuple(jnp.concatenate([jnp.ravel(pair[i]) for pair in pairs]) for i in (0, 1))
            for layer, pairs in layers.items()}


def test_dense_general_batch_dims_run_on_the_grouped_gemm():
    model = nn.DenseGeneral(24, axis=-1, batch_dims=(0,), dot_general_cls=tf.DotGeneral)  # N = 24: padded to 32
    x = _rand(3, (3, 16, 32))
    v = model.init(jax.random.key(0), x)
    y_hp = nn.DenseGeneral(24, axis=-1, batch_dims=(0,)).apply(v, x)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        err = _rel(jax.jit(model.apply)(v, x), y_hp)
    assert err < 0.08, f"y: relative error {err:.4f} >= 0.08"
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=recipe):
        vd = jax.jit(model.init)(jax.random.key(0), x)
        weight = vd[OWG]["DotGeneral_0"]["linear_weight"]
        assert weight["amax_history"].shape == (3, 4), weight["amax_history"].shape  # one per batch element
        _, grads = _grads(model, vd, x, recipe)
    hist = overwrite.to_delayed(grads[OWG]["DotGeneral_0"]["linear_weight"]).amax_history
    np.testing.assert_array_equal(hist[:, -1], jnp.max(jnp.abs(vd["params"]["kernel"]), axis=(1, 2)),
                                  err_msg="the new weight amax of each batch element (got, want)")


def _lowers_for_cuda(fn, *args) -> str:
    """The StableHLO of ``jax.jit(fn)(*args)`` lowered for CUDA (on any machine): what XLA:GPU would compile.

    The CUDA lowering of te_jax's custom calls runs their CUDA-only checks (the shapes the kernels tile), so a
    product the GPU would refuse fails here on a CPU too.
    """
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


class _AfterDense(nn.Module):
    """An unquantized ``nn.Dense`` (its kernel's gradient needs the next layer's dgrad), then ``layer``."""

    layer: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.layer(nn.Dense(x.shape[-1])(x))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("layer", ["DenseGeneral_batch", "Einsum_batch"])
def test_batch_axes_lower_for_cuda_whatever_k_and_n(layer, recipe):
    """Batch axes run on the grouped GEMM, whose CUDA kernels take K and N in multiples of 16 under per-tensor
    scaling: te_jax zero pads them (here N = 5; K = 8, N = 6), so the GPU takes what the CPU takes."""
    if layer == "DenseGeneral_batch":
        inner, x = nn.DenseGeneral(5, axis=-1, batch_dims=(0,), dot_general_cls=tf.DotGeneral), _rand(1, (3, 6, 16))
    else:
        inner, x = tf.Einsum((4, 8, 6), "bhd,hdf->bhf"), _rand(1, (3, 4, 8))
    model = _AfterDense(inner)
    with te_jax.autocast(recipe=BUILTIN_RECIPES[recipe]):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        step = te_jax.train.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))
        hlo = _lowers_for_cuda(step, variables)
    calls = hlo.count("custom_call @te_jax_grouped_gemm_fp8(")
    assert calls == 3, f"{calls} grouped GEMM calls in the CUDA program, not 3 (forward, dgrad, wgrad)"


def test_the_recipe_sees_the_parent_layers_path():
    seen = []

    def factory(role):
        seen.append((tuple(role.path), str(role)))
        return te_jax.quantize.CurrentScalingQuantizer() if role.path[-1:] == ("query",) else None

    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_dot_general_cls=tf.DotGeneral,
                                            out_dot_general_cls=tf.DotGeneral)
    x = _rand(1, (2, 5, 8))
    v = model.init(jax.random.key(0), x)
    with te_jax.autocast(recipe=R.CustomRecipe(factory)):
        y = model.apply(v, x)
    paths = {p for p, _ in seen}
    assert paths == {(n,) for n in ("query", "key", "value", "out")}, paths
    plain = nn.MultiHeadDotProductAttention(num_heads=2).apply(v, x)
    assert not np.array_equal(y, plain) and _rel(y, plain) < 0.08  # only the query projection quantized


def test_statistics_are_recorded_like_te_jax_layers():
    model = nn.Dense(16, dot_general_cls=tf.DotGeneral)
    x = _rand(1, (8, 32))
    with te_jax.autocast(recipe=R.Float8CurrentScaling(), inspect=True):
        v = jax.jit(model.init)(jax.random.key(0), x)
        assert set(v["fp8_stats"]["DotGeneral_0"]) == {"linear_input", "linear_weight", "linear_grad_output"}
        _, fwd = jax.jit(lambda v, x: model.apply(v, x, mutable=["fp8_stats"]))(v, x)
    amax = fwd["fp8_stats"]["DotGeneral_0"]["linear_input"]["amax"]
    assert float(amax) == float(jnp.max(jnp.abs(x)))


def test_missing_state_is_a_clear_error():
    model = nn.Dense(16, dot_general_cls=tf.DotGeneral)
    x = _rand(1, (8, 32))
    v = model.init(jax.random.key(0), x)  # outside autocast: no state
    with te_jax.autocast(recipe=R.DelayedScaling()):
        with pytest.raises(ValueError, match="te_jax: DotGeneral at DotGeneral_0 has no _overwrite_with_gradient"):
            model.apply(v, x)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        with pytest.raises(ValueError, match="te_jax: DotGeneral: dimension_numbers .* contract no axis"):
            tf.DotGeneral().apply({}, x, x, (((), ()), ((), ())))


def test_dense_is_flax_dense():
    x = _rand(1, (4, 6, 32))
    theirs = nn.Dense(12)
    v = theirs.init(jax.random.key(0), x)
    ours = tf.Dense(12)
    _same_tree(ours.init(jax.random.key(0), x), v, "params")  # same names, shapes, initialization
    assert_same_bits(ours.apply(v, x), theirs.apply(v, x), "Dense")  # a flax checkpoint loads unchanged

    class Named(nn.Module):
        @nn.compact
        def __call__(self, x):
            return tf.Dense(3)(x)

    assert set(Named().init(jax.random.key(0), x)["params"]) == {"Dense_0"}
    kw = dict(use_bias=False, dtype=jnp.bfloat16, kernel_init=nn.initializers.normal(0.3))
    v = nn.Dense(12, **kw).init(jax.random.key(2), x)
    assert_same_bits(tf.Dense(12, **kw).apply(v, x), nn.Dense(12, **kw).apply(v, x), "Dense options")


def test_dense_under_a_recipe_is_dense_general():
    x = _rand(1, (4, 6, 32))
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=recipe):
        v = jax.jit(tf.Dense(12).init)(jax.random.key(0), x)
        assert set(v["fp8_meta"]) == {"linear_input", "linear_weight", "linear_grad_output"}
        got, new = jax.jit(lambda v, x: tf.Dense(12).apply(v, x, mutable=["fp8_meta"]))(v, x)
        want, new_ref = jax.jit(lambda v, x: tf.DenseGeneral(12).apply(v, x, mutable=["fp8_meta"]))(v, x)
    assert_same_bits(got, want, "y")
    _same_tree(new, new_ref, "fp8_meta")
    with te_jax.autocast(recipe=recipe), pytest.raises(ValueError, match="dot_general_cls cannot be combined"):
        tf.Dense(12, dot_general_cls=tf.DotGeneral).apply(v, x)


EINSUMS = [("abc,cde->abde", (5, 6, 7), (3, 4, 5)), ("bhd,hdf->bhf", (4, 8, 6), (3, 4, 8)),
           ("btd,dnh->bnth", (8, 2, 4), (2, 6, 8))]


@pytest.mark.parametrize("case", range(len(EINSUMS)))
def test_einsum_is_flax_einsum_and_within_fp8_bounds(case):
    eq, shape, x_shape = EINSUMS[case]
    x = _rand(case, x_shape)
    theirs, ours = nn.Einsum(shape, eq), tf.Einsum(shape, eq)
    v = theirs.init(jax.random.key(0), x)
    _same_tree(ours.init(jax.random.key(0), x), v, "params")
    assert_same_bits(ours.apply(v, x), theirs.apply(v, x), eq)
    assert_same_bits(tf.Einsum(shape).apply(v, x, eq), theirs.apply(v, x), eq)  # equation at the call
    y_hp = theirs.apply(v, x)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        err = _rel(jax.jit(ours.apply)(v, x), y_hp)
    assert err < 0.08, f"{eq}: relative error {err:.4f} >= 0.08"
    with te_jax.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
        vd = jax.jit(ours.init)(jax.random.key(0), x)
        _, new = jax.jit(lambda v, x: ours.apply(v, x, mutable=["fp8_meta"]))(vd, x)
    batch = case == 1  # the letter h: input, kernel and output (a batch axis): one weight history per head
    got = new["fp8_meta"]["linear_weight"]["amax_history"].shape
    assert got == ((shape[0], 4) if batch else (4,)), f"{eq}: weight amax history shape {got}"
    with pytest.raises(ValueError, match="exactly two operands"):
        tf.Einsum(shape, "ab,bc,cd->ad").init(jax.random.key(0), x)
