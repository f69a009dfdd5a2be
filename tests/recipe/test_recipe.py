"""Recipes: fields and defaults, validation, roles, and that every field changes behaviour."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers, dense
from te_jax.quantize import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from te_jax.quantize.delayed import init_state

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FORWARD = ("linear_input", "linear_weight")


GEMM_FIELDS = ("fast_accumulation", "backward_fast_accumulation", "gemm_autotune")  # every recipe's
PER_TENSOR = (R.DelayedScaling, R.Float8CurrentScaling)
BLOCK_SCALED = (R.MXFP8BlockScaling, R.NVFP4BlockScaling, R.Float8BlockScaling)


def _defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in GEMM_FIELDS}


def test_fields_and_defaults_are_the_issues():
    # Every recipe's keyword-only GEMM fields. fast_accumulation: True for per-tensor FP8, False for the
    # block-scaled recipes (their GEMMs always accumulate in float32), None (each GEMM's mode default) for
    # CustomRecipe, whose quantizers may mix modes.
    fast_default = {**{r: True for r in PER_TENSOR}, **{r: False for r in BLOCK_SCALED}, R.CustomRecipe: None}
    for rec, fast in fast_default.items():
        fields = {f.name: f for f in dataclasses.fields(rec)}
        assert all(fields[name].kw_only for name in GEMM_FIELDS), rec
        assert fields["fast_accumulation"].default is fast, rec
        assert fields["backward_fast_accumulation"].default is False, rec
        assert fields["gemm_autotune"].default is False, rec
    assert _defaults(R.DelayedScaling) == dict(
        margin=0, fp8_format=R.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
        scaling_factor_compute_algo=None, reduce_amax=True, amax_reduction="max")
    assert _defaults(R.Float8CurrentScaling) == dict(fp8_format=R.Format.HYBRID, use_power_2_scales=False,
                                                     amax_epsilon=0.0)
    assert _defaults(R.MXFP8BlockScaling) == dict(fp8_format=R.Format.E4M3)
    assert _defaults(R.NVFP4BlockScaling) == dict(disable_rht=False, disable_stochastic_rounding=False,
                                                  disable_2d_quantization=False)
    assert _defaults(R.Float8BlockScaling) == dict(fp8_format=R.Format.E4M3, x_block_scaling_dim=1,
                                                   w_block_scaling_dim=2, grad_block_scaling_dim=1,
                                                   use_f32_scales=False)
    assert [f.name for f in dataclasses.fields(R.CustomRecipe)] == [*GEMM_FIELDS, "qfactory"]
    assert {f.name for f in R.Format} == {"E4M3", "E5M2", "HYBRID"}


ALL_DEFAULT = [R.DelayedScaling(), R.Float8CurrentScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling(),
               R.Float8BlockScaling(), R.CustomRecipe(qfactory=lambda role: None)]


@pytest.mark.parametrize("rec", ALL_DEFAULT, ids=lambda r: type(r).__name__)
def test_frozen_hashable_static(rec):
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.__setattr__(dataclasses.fields(rec)[0].name, None)
    assert hash(rec) == hash(dataclasses.replace(rec)) and rec == dataclasses.replace(rec)
    traces = []

    def f(x, r):
        traces.append(r)
        return x + 1

    f = jax.jit(f, static_argnums=1)
    assert float(f(1.0, rec)) == 2.0 and float(f(2.0, dataclasses.replace(rec))) == 3.0
    assert len(traces) == 1  # an equal recipe hits jit's cache


BAD = [
    (R.DelayedScaling, dict(margin=-1), "margin must be an int >= 0"),
    (R.DelayedScaling, dict(margin=1.5), "margin"),
    (R.DelayedScaling, dict(fp8_format=R.Format.E5M2), "Format.E4M3, Format.HYBRID"),
    (R.DelayedScaling, dict(fp8_format="fp16"), "Format.E4M3, Format.HYBRID"),
    (R.DelayedScaling, dict(amax_history_len=0), ">= 1"),
    (R.DelayedScaling, dict(amax_compute_algo="mean"), "'max', 'most_recent'"),
    (R.DelayedScaling, dict(scaling_factor_compute_algo="x"), "None or a callable"),
    (R.DelayedScaling, dict(reduce_amax=1), "True or False"),
    (R.DelayedScaling, dict(amax_reduction="sum"), "('max', 'mean')"),
    (R.Float8CurrentScaling, dict(fp8_format=R.Format.E5M2), "Format.E4M3, Format.HYBRID"),
    (R.Float8CurrentScaling, dict(use_power_2_scales="yes"), "True or False"),
    (R.Float8CurrentScaling, dict(amax_epsilon=-1.0), "finite number >= 0"),
    (R.Float8CurrentScaling, dict(amax_epsilon=float("inf")), "finite number >= 0"),
    (R.MXFP8BlockScaling, dict(fp8_format=R.Format.E5M2), "Format.E4M3, Format.HYBRID"),
    (R.NVFP4BlockScaling, dict(disable_rht=None), "True or False"),
    (R.NVFP4BlockScaling, dict(disable_stochastic_rounding=0), "True or False"),
    (R.NVFP4BlockScaling, dict(disable_2d_quantization="no"), "True or False"),
    (R.Float8BlockScaling, dict(x_block_scaling_dim=3), "(1, 2)"),
    (R.Float8BlockScaling, dict(w_block_scaling_dim=0), "(1, 2)"),
    (R.Float8BlockScaling, dict(grad_block_scaling_dim=2), "at most one block dim"),
    (R.Float8BlockScaling, dict(x_block_scaling_dim=2), "at most one block dim"),
    (R.Float8BlockScaling, dict(use_f32_scales=None), "True or False"),
    (R.Float8BlockScaling, dict(fp8_format=R.Format.E5M2), "E5M2 operands"),
    (R.CustomRecipe, dict(qfactory=3), "callable"),
]


@pytest.mark.parametrize("cls,kwargs,message", BAD, ids=[f"{c.__name__}-{list(k)[0]}" for c, k, _ in BAD])
def test_validation_names_allowed_values(cls, kwargs, message):
    with pytest.raises(ValueError, match="te_jax") as err:
        cls(**kwargs)
    assert message in str(err.value)


def test_format_accepts_names():
    assert R.DelayedScaling(fp8_format="E4M3").fp8_format is R.Format.E4M3
    assert R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1).quantizer("linear_input").block_2d


# ---- roles -----------------------------------------------------------------------------


def test_role_is_a_string_with_a_path():
    role = R.Role("linear_input", ("TransformerLayer_0", "mlp", "wi"))
    assert role == "linear_input" and role in ("linear_input", "linear_weight") and hash(role) == hash("linear_input")
    assert role.path == ("TransformerLayer_0", "mlp", "wi") and role.path_str == "TransformerLayer_0/mlp/wi"
    assert R.Role("linear_weight", "a/b").path == ("a", "b") and R.Role("linear_weight").path == ()
    assert {role: 1}["linear_input"] == 1
    back = pickle.loads(pickle.dumps(role))
    assert back == role and back.path == role.path
    with pytest.raises(AttributeError):
        role.path = ()
    with pytest.raises(ValueError, match="roles are"):
        R.Role("linear_bias")
    with pytest.raises(ValueError, match="roles are"):
        R.DelayedScaling().quantizer("weight")


EXPECTED = {  # recipe -> role -> (type, dtype) or None
    "DelayedScaling": (R.DelayedScaling(), DelayedScalingQuantizer, (E4, E4, None, E5, None)),
    "DelayedScaling-E4M3": (R.DelayedScaling(fp8_format=R.Format.E4M3), DelayedScalingQuantizer,
                            (E4, E4, None, E4, None)),
    "Float8CurrentScaling": (R.Float8CurrentScaling(), CurrentScalingQuantizer, (E4, E4, None, E5, None)),
    "MXFP8BlockScaling": (R.MXFP8BlockScaling(), MXFP8Quantizer, (E4, E4, None, E4, None)),
    "MXFP8BlockScaling-HYBRID": (R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID), MXFP8Quantizer,
                                 (E4, E4, None, E5, None)),
    "Float8BlockScaling": (R.Float8BlockScaling(), Float8BlockQuantizer, (E4, E4, None, E4, None)),
    "Float8BlockScaling-HYBRID": (R.Float8BlockScaling(fp8_format=R.Format.HYBRID), Float8BlockQuantizer,
                                  (E4, E4, None, E5, None)),
    "NVFP4BlockScaling": (R.NVFP4BlockScaling(), NVFP4Quantizer, ("fp4",) * 2 + (None, "fp4", None)),
}


@pytest.mark.parametrize("name", EXPECTED)
@pytest.mark.parametrize("index,role", list(enumerate(R.ROLES)))
def test_every_role(name, index, role):
    rec, cls, dtypes = EXPECTED[name]
    for r in (role, R.Role(role, ("layer",))):
        q = rec.quantizer(r)
        if dtypes[index] is None:
            assert q is None
            continue
        assert isinstance(q, cls)
        want = jnp.dtype(jnp.float4_e2m1fn) if dtypes[index] == "fp4" else dtypes[index]
        assert jnp.dtype(q.dtype) == want


def test_custom_recipe_gets_roles_with_paths():
    seen = []

    def qfactory(role):
        seen.append((str(role), role.path))
        return CurrentScalingQuantizer(jnp.float8_e5m2) if role.path[-1] == "b" and role == "linear_input" else None

    q = DenseQuantizers.from_recipe(R.CustomRecipe(qfactory), ("a", "b"))
    assert seen == [(r, ("a", "b")) for r in R.ROLES]
    assert q.input == CurrentScalingQuantizer(jnp.float8_e5m2) and q.weight is None
    assert DenseQuantizers.from_recipe(R.CustomRecipe(qfactory), ("a", "c")).input is None
    with pytest.raises(TypeError, match="return None or an object with quantize"):
        R.CustomRecipe(lambda role: 3).quantizer("linear_input")


# ---- every field changes behaviour -------------------------------------------------------


def _steps(q, amaxes):
    state = q.init_state()
    for a in amaxes:
        state = q.update_state(state, jnp.float32(a))
    return float(state["scale"][0])


def test_delayed_fields_change_the_state_update():
    base = R.DelayedScaling(amax_history_len=4)
    q = lambda **kw: dataclasses.replace(base, **kw).quantizer("linear_input")  # noqa: E731
    assert _steps(q(), [2.0]) == 224.0
    assert _steps(q(margin=1), [2.0]) == 112.0
    assert _steps(q(margin=3), [2.0]) == 28.0
    # history length: the spike of 8 leaves a window of 2 after 2 steps, not one of 4
    assert _steps(q(), [8.0, 1.0, 1.0]) == 56.0
    assert _steps(q(amax_history_len=2), [8.0, 1.0, 1.0]) == 448.0
    assert q(amax_history_len=2).init_state()["amax_history"].shape == (2,)
    # amax_compute_algo
    assert _steps(q(amax_compute_algo="most_recent"), [8.0, 1.0]) == 448.0
    assert _steps(q(), [8.0, 1.0]) == 56.0
    assert _steps(q(amax_compute_algo=lambda h: 2 * jnp.max(h)), [8.0, 1.0]) == 28.0
    # scaling_factor_compute_algo
    sf = lambda amax, scale, fp8_max, recipe: fp8_max / amax / 4 + recipe.margin  # noqa: E731  (TE's signature)
    assert _steps(q(scaling_factor_compute_algo=sf), [2.0]) == 56.0
    assert _steps(q(scaling_factor_compute_algo=sf, margin=1), [2.0]) == 57.0
    # format: the gradient quantizer's dtype and fp8_max
    grad_q = dataclasses.replace(base, fp8_format=R.Format.E4M3).quantizer("linear_grad_output")
    assert grad_q.dtype == E4 and _steps(grad_q, [2.0]) == 224.0
    assert _steps(base.quantizer("linear_grad_output"), [2.0]) == 28672.0
    # reduce_amax / amax_reduction reach the quantizer (their effect: test_reduction_in_the_jaxpr, 8-device test)
    assert q(reduce_amax=False).reduce_amax is False and q(amax_reduction="mean").amax_reduction == "mean"


def _reduction_jaxpr(rec, mesh_resource=None):
    mesh = jax.make_mesh((1,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    q = DenseQuantizers.from_recipe(rec)
    x, k = jnp.ones((32, 32)), jnp.ones((32, 32))

    def step(x, k, st):
        return jax.grad(lambda x, st: jnp.sum(dense(x, k, quantizers=q, state=st)[0]), argnums=(0, 1))(x, st)

    f = jax.shard_map(step, mesh=mesh, in_specs=(jax.P("dp"), jax.P(), jax.P()), out_specs=(jax.P("dp"), jax.P()),
                      check_vma=False)
    with te_jax.autocast(recipe=rec, mesh_resource=mesh_resource), te_jax.train.fp8_state_updates():
        return str(jax.make_jaxpr(f)(x, k, q.init_state()))


def test_reduction_in_the_jaxpr():
    """reduce_amax and amax_reduction decide the collective over the MeshResource's axes."""
    base = R.DelayedScaling(amax_history_len=2)
    with_max = _reduction_jaxpr(base)
    assert with_max.count("pmax") == 3 and "psum" not in with_max
    with_mean = _reduction_jaxpr(dataclasses.replace(base, amax_reduction="mean"))
    assert "pmax" not in with_mean and with_mean.count("psum") == 3
    assert "pmax" not in _reduction_jaxpr(dataclasses.replace(base, reduce_amax=False))
    with pytest.raises(ValueError, match="MeshResource.tp_resource names the mesh axis 'tp'"):  # not on the mesh
        _reduction_jaxpr(base, te_jax.MeshResource(tp_resource="tp"))
    assert _reduction_jaxpr(base, te_jax.MeshResource(dp_resource="dp")).count("pmax") == 3


def test_stateless_fields_change_quantization():
    x = jnp.concatenate([jnp.full((1, 128), 3e-4), jnp.linspace(-1e-3, 1e-3, 127 * 128).reshape(127, 128)])
    scale_inv = lambda rec, role="linear_input": rec.quantizer(role).quantize(x).scale_inv  # noqa: E731
    base = R.Float8CurrentScaling()
    s = float(scale_inv(base)[0])
    assert s == pytest.approx(1e-3 / 448, rel=1e-6)
    assert float(scale_inv(R.Float8CurrentScaling(use_power_2_scales=True))[0]) == 2.0 ** np.ceil(np.log2(s))
    assert float(scale_inv(R.Float8CurrentScaling(amax_epsilon=1.0))[0]) == pytest.approx(1 / 448)
    assert R.Float8CurrentScaling(fp8_format=R.Format.E4M3).quantizer("linear_grad_output").dtype == E4
    # Float8 block scaling: block dims pick 1x128 or 128x128 scales; use_f32_scales keeps exact scales
    blk = R.Float8BlockScaling()
    assert scale_inv(blk).shape == (128, 1) and scale_inv(blk, "linear_weight").shape == (1, 1)
    other = R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert scale_inv(other).shape == (1, 1) and scale_inv(other, "linear_weight").shape == (128, 1)
    grad2 = R.Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2)
    assert scale_inv(grad2, "linear_grad_output").shape == (1, 1)
    pow2 = np.asarray(scale_inv(blk))
    assert np.all(np.log2(pow2) == np.round(np.log2(pow2)))
    f32 = np.asarray(scale_inv(R.Float8BlockScaling(use_f32_scales=True)))
    assert not np.all(np.log2(f32) == np.round(np.log2(f32)))
    # NVFP4: flags reach the quantizers
    nv, off = R.NVFP4BlockScaling(), R.NVFP4BlockScaling(True, True, True)
    assert nv.quantizer("linear_weight").block_2d and not off.quantizer("linear_weight").block_2d
    assert nv.quantizer("linear_input").rht and not off.quantizer("linear_input").rht
    assert nv.quantizer("linear_grad_output").rht and not off.quantizer("linear_grad_output").rht
    assert nv.quantizer("linear_grad_output").stochastic_rounding
    assert not off.quantizer("linear_grad_output").stochastic_rounding


def _fwd_bwd(rec, key=0, n=128):
    q = DenseQuantizers.from_recipe(rec)
    # Rows and columns span 2^0 .. 2^-7 in magnitude, so one amax per 1x128 block and one per 128x128
    # block give scales many powers of 2 apart (with power-of-2 scales, a milder input leaves the two
    # layouts' results within an ulp of each other).
    ramp = jnp.exp2(-(jnp.arange(n) % 8).astype(jnp.float32))
    spread = ramp[:, None] * ramp[None, :]
    x = jax.random.normal(jax.random.key(1), (n, n), jnp.float32) * spread
    k = jax.random.normal(jax.random.key(2), (n, n), jnp.float32) / 8
    c = jax.random.normal(jax.random.key(3), (n, n), jnp.float32) * spread

    @jax.jit
    def run(x, k, key):
        def loss(x, k):
            y, _ = dense(x, k, quantizers=q, state=q.init_state(), key=jax.random.key(key))
            return jnp.sum(y * c), y
        with te_jax.train.fp8_state_updates():  # the state's update is not needed here
            (_, y), (dx, dk) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, k)
        return y, dx, dk

    return [np.asarray(a) for a in run(x, k, key)]


FIELD_VARIANTS = [  # (default recipe, variant, which of (y, dx, dk) must change)
    (R.Float8CurrentScaling(), R.Float8CurrentScaling(fp8_format=R.Format.E4M3), (1, 2)),
    (R.Float8CurrentScaling(), R.Float8CurrentScaling(use_power_2_scales=True), (0, 1, 2)),
    (R.Float8CurrentScaling(), R.Float8CurrentScaling(amax_epsilon=100.0), (0, 1, 2)),
    (R.MXFP8BlockScaling(), R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID), (1, 2)),
    (R.DelayedScaling(amax_history_len=2), R.DelayedScaling(amax_history_len=2, fp8_format=R.Format.E4M3), (1, 2)),
    (R.Float8BlockScaling(), R.Float8BlockScaling(fp8_format=R.Format.HYBRID), (1, 2)),
    (R.Float8BlockScaling(), R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1), (0, 1, 2)),
    (R.Float8BlockScaling(), R.Float8BlockScaling(w_block_scaling_dim=1), (0, 1)),
    (R.Float8BlockScaling(w_block_scaling_dim=1), R.Float8BlockScaling(w_block_scaling_dim=1,
                                                                       grad_block_scaling_dim=2), (1, 2)),
    (R.Float8BlockScaling(), R.Float8BlockScaling(use_f32_scales=True), (0, 1, 2)),
    (R.NVFP4BlockScaling(), R.NVFP4BlockScaling(disable_rht=True), (2,)),
    (R.NVFP4BlockScaling(), R.NVFP4BlockScaling(disable_2d_quantization=True), (0, 1)),
    (R.NVFP4BlockScaling(), R.NVFP4BlockScaling(disable_stochastic_rounding=True), (1, 2)),
]


@pytest.mark.parametrize("base,variant,changed", FIELD_VARIANTS, ids=[repr(v) for _, v, _ in FIELD_VARIANTS])
def test_every_field_changes_the_dense_layer(base, variant, changed):
    a, b = _fwd_bwd(base), _fwd_bwd(variant)
    for i, name in enumerate(("y", "dx", "dk")):
        assert np.array_equal(a[i], b[i]) != (i in changed), f"{name} {'unchanged' if i in changed else 'changed'}"


def test_stochastic_rounding_follows_the_key():
    a, b = _fwd_bwd(R.NVFP4BlockScaling(), key=0), _fwd_bwd(R.NVFP4BlockScaling(), key=1)
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[1], b[1])
    off = R.NVFP4BlockScaling(disable_stochastic_rounding=True)
    assert all(np.array_equal(u, v) for u, v in zip(_fwd_bwd(off, key=0), _fwd_bwd(off, key=1)))


# ---- load_recipe ---------------------------------------------------------------------------


def test_load_recipe(tmp_path, monkeypatch):
    gallery = Path(__file__).resolve().parents[2] / "recipes"
    monkeypatch.chdir(gallery.parent)
    rec = R.load_recipe("recipes/current_scaling_ref.py")
    assert isinstance(rec, R.CustomRecipe) and rec.quantizer("linear_output").dtype == E5
    assert isinstance(R.load_recipe("mixed_per_layer"), R.CustomRecipe)
    assert R.load_recipe("DelayedScaling") == R.DelayedScaling()
    assert R.load_recipe("nvfp4_block_scaling") == R.NVFP4BlockScaling()
    assert R.load_recipe("MXFP8BlockScaling") == R.MXFP8BlockScaling()
    (tmp_path / "mine.py").write_text("def qfactory(role):\n    return None\n")
    assert R.load_recipe(str(tmp_path / "mine.py")).quantizer("linear_input") is None
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="must define a function qfactory"):
        R.load_recipe(str(tmp_path / "empty.py"))
    with pytest.raises(FileNotFoundError):
        R.load_recipe("recipes/nope.py")
    with pytest.raises(ValueError, match="no recipe named 'no_such_recipe'. Names: delayed, current, block, mxfp8"):
        R.load_recipe("no_such_recipe")
    monkeypatch.chdir(tmp_path)  # the gallery is still found next to the package
    assert isinstance(R.load_recipe("current_scaling_ref"), R.CustomRecipe)


def test_load_recipe_takes_every_listed_name():
    """The short names the example's --recipe takes, class names and snake cases, in any case, and the gallery."""
    short = {"delayed": R.DelayedScaling, "current": R.Float8CurrentScaling, "block": R.Float8BlockScaling,
             "mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling}
    names = R.recipe_names()
    assert names[:5] == list(short)
    assert {"current_scaling_ref", "mixed_per_layer", "nvfp4_first_last_bf16"} <= set(names)
    for name, cls in short.items():
        assert R.load_recipe(name) == R.load_recipe(name.upper()) == cls()
        assert type(R.load_recipe(cls.__name__.lower())) is cls and cls.__name__ in names
    assert {"delayed_scaling", "float8_current_scaling", "float8_block_scaling", "mxfp8_block_scaling",
            "nvfp4_block_scaling"} <= set(names)
    for name in names:  # a recipe placed by block position needs the model's depth (it has no default)
        assert isinstance(R.load_recipe(name, num_layers=4), R.Recipe), name
    with pytest.raises(ValueError) as err:
        R.load_recipe("delayd")
    assert all(name in str(err.value) for name in names)


def test_init_state_of_delayed_quantizer():
    st = R.DelayedScaling(amax_history_len=5).quantizer("linear_weight").init_state()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), st) == jax.tree.map(lambda a: (a.shape, a.dtype),
                                                                          init_state(5))
    assert np.all(np.asarray(st["amax_history"]) == 0) and float(st["scale"][0]) == 1.0


@pytest.mark.parametrize("rec", PER_TENSOR)
def test_fast_accumulation_reaches_the_forward_gemm(rec):
    """Every recipe takes fast_accumulation (keyword only); it sets the forward GEMM's, never the backward's."""
    import te_jax.flax as tf

    with pytest.raises(ValueError, match="fast_accumulation must be True or False"):
        rec(fast_accumulation="no")
    x = jnp.ones((128, 128), jnp.bfloat16)
    m = tf.DenseGeneral(128, dtype=jnp.bfloat16)
    for fast in (True, False):
        recipe = rec(fast_accumulation=fast)
        assert te_jax.core.DenseQuantizers.from_recipe(recipe).fast_accum is fast
        with te_jax.autocast(recipe=recipe), te_jax.train.fp8_state_updates():
            v = m.init(jax.random.key(0), x)
            text = jax.jit(jax.value_and_grad(lambda v, x: m.apply(v, x, rngs={"quantize": jax.random.key(1)}).astype(
                jnp.float32).sum(), argnums=(0, 1))).lower(v, x).as_text()
        flags = re.findall(r"fast_accum = (\w+)", text)
        assert flags == [str(fast).lower(), "false", "false"], flags  # forward, then dgrad and wgrad


@pytest.mark.parametrize("rec", BLOCK_SCALED)
def test_block_scaled_recipes_refuse_fast_accumulation(rec):
    """Block-scaled GEMMs always accumulate in float32: True is refused at construction, saying why."""
    for name in ("fast_accumulation", "backward_fast_accumulation"):
        with pytest.raises(ValueError, match=f"{rec.__name__}.{name} must be False: its GEMMs always accumulate"):
            rec(**{name: True})
        with pytest.raises(ValueError, match=f"{name} must be True or False"):
            rec(**{name: "no"})
    q = te_jax.core.DenseQuantizers.from_recipe(rec(fast_accumulation=False, backward_fast_accumulation=False))
    assert q.fast_accum is False and q.backward_fast_accum is False


def test_custom_recipe_fast_accumulation_may_be_the_modes_default():
    assert R.CustomRecipe(qfactory=lambda role: None).fast_accumulation is None
    for fast in (True, False):
        assert R.CustomRecipe(qfactory=lambda role: None, fast_accumulation=fast).fast_accumulation is fast
    with pytest.raises(ValueError, match="CustomRecipe.fast_accumulation must be True or False"):
        R.CustomRecipe(qfactory=lambda role: None, fast_accumulation=1)
    with pytest.raises(ValueError, match="DelayedScaling.fast_accumulation must be True or False"):
        R.DelayedScaling(fast_accumulation=None)  # None is CustomRecipe's alone


@pytest.mark.parametrize("rec", [*PER_TENSOR, *BLOCK_SCALED,
                                 functools.partial(R.CustomRecipe, qfactory=lambda r: None)])
def test_gemm_autotune_is_a_keyword_bool(rec):
    assert rec().gemm_autotune is False and rec(gemm_autotune=True).gemm_autotune is True
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="gemm_autotune must be True or False"):
            rec(gemm_autotune=bad)
