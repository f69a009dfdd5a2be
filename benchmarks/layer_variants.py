"""The layer variants of bench_layers.py and how each one's training step is built (also used by bench_profile.py).

* ``RECIPES``, ``FLAX_FP8``, ``NNX_RECIPES``: the te_jax recipes and flax FP8 kinds the variants run under.
* ``FlaxLayer`` / ``te_layer``: the flax.linen reference of a section (bf16 or flax's FP8) and te_jax's layer.
* ``make_step`` / ``make_nnx_step`` -> ``CompiledStep``: one forward + backward step (Linen, NNX) with its
  variables bound, compiled ahead of time, that can feed its FP8 state update back (``advance_fp8_state``).
* ``_variants`` / ``_step_inputs`` / ``_build_step``: a section's variants, its two input sets, and a
  variant's step initialized, compiled and run once.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

import te_jax
import te_jax.flax as tf
from te_jax import recipe as R
from te_jax.train import apply_fp8_update

from timing import selected

BF16 = jnp.bfloat16
RECIPES = {
    "te delayed": R.DelayedScaling(),
    "te current": R.Float8CurrentScaling(),
    "te delayed, fast-accumulating backward": R.DelayedScaling(backward_fast_accumulation=True),
    "te current, fast-accumulating backward": R.Float8CurrentScaling(backward_fast_accumulation=True),
    "te block": R.Float8BlockScaling(),
    "te mxfp8": R.MXFP8BlockScaling(),
    "te nvfp4": R.NVFP4BlockScaling(),
}
FLAX_FP8 = {"flax fp8 (Fp8DotGeneral)": "direct", "flax fp8 (Fp8DotGeneralOp, qdq)": "qdq"}
FLAX_FP8_COLLECTION = nn.fp8_ops.OVERWRITE_WITH_GRADIENT  # flax's FP8 state; its "gradient" is the new state
NNX_RECIPES = {"te nnx delayed": R.DelayedScaling(), "te nnx current": R.Float8CurrentScaling()}
# LayerNormMLP with recompute_norm_act=True: the speed cost of the memory option
RECOMPUTE_RECIPES = {"te delayed, recompute_norm_act": R.DelayedScaling(),
                     "te current, recompute_norm_act": R.Float8CurrentScaling(),
                     "te block, recompute_norm_act": R.Float8BlockScaling()}


def _dot_cls(kind):
    if kind is None:
        return None
    return nn.Fp8DirectDotGeneralOp if kind == "direct" else nn.Fp8DotGeneralOp


class FlaxLayer(nn.Module):
    """The flax.linen reference of each section (bf16, optionally with flax's FP8 dot_general)."""

    section: str
    features: int
    out_features: int = 0  # the MLP's second Dense
    fp8: str | None = None
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        kw = dict(use_bias=self.bias, dtype=BF16, param_dtype=BF16, dot_general_cls=_dot_cls(self.fp8))
        if self.section != "dense":
            x = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(x)
        x = nn.Dense(self.features, **kw)(x)
        if self.section == "mlp":
            x = nn.Dense(self.out_features, **kw)(nn.gelu(x))
        return x


def te_layer(section: str, h: int, n: int, bias: bool, recompute_norm_act: bool = False) -> nn.Module:
    kw = dict(use_bias=bias, dtype=BF16, param_dtype=BF16)
    if section == "mlp":
        return tf.LayerNormMLP(intermediate_dim=n, activation="gelu", recompute_norm_act=recompute_norm_act, **kw)
    if section == "lndense":
        return tf.LayerNormDenseGeneral(n, **kw)
    return tf.DenseGeneral(n, **kw)


class _WithInput(nnx.Module):
    """An NNX layer and its input as a parameter, so that the step also computes the input's gradient."""

    def __init__(self, layer: nnx.Module, x: jax.Array):
        self.layer, self.x = layer, nnx.Param(x)


def make_nnx_step(model: nnx.Module, recipe) -> CompiledStep:
    """The NNX form of ``make_step``: the step returns ``(loss, {"grads": ..., "fp8": the layer's new FP8 state})``.

    Only the FP8 state comes out, as the Linen step's: returning the unchanged parameters too would add a copy
    of every weight to the timed step.
    """
    graphdef, state = nnx.split(model)
    fp8_state = (te_jax.nnx.FP8Meta, te_jax.nnx.FP8Stats)

    def next_variables(state, out):
        layer = nnx.merge(graphdef, state)
        nnx.update(layer, out["fp8"])
        return nnx.state(layer)

    def step(state, x, c, key):
        del key  # per-tensor recipes draw no random numbers
        holder = _WithInput(nnx.merge(graphdef, state), x)

        def loss_fn(h):
            return jnp.sum(h.layer(h.x[...]).astype(jnp.float32) * c)

        with te_jax.autocast(recipe=recipe):
            loss, grads = te_jax.nnx.value_and_grad(loss_fn)(holder)
        return loss, {"grads": grads, "fp8": nnx.state(holder.layer, fp8_state)}

    return CompiledStep(step, state, jax.random.key(123), next_variables=next_variables)


def _next_linen_variables(variables, grads):
    """Linen variables with the FP8 state (te_jax's and flax's) replaced by the step's update."""
    variables = dict(variables)
    if te_jax.FP8_COLLECTION in variables:
        variables[te_jax.FP8_COLLECTION] = apply_fp8_update(variables[te_jax.FP8_COLLECTION],
                                                          grads[te_jax.FP8_COLLECTION])
    if FLAX_FP8_COLLECTION in variables:
        variables[FLAX_FP8_COLLECTION] = grads[FLAX_FP8_COLLECTION]
    return variables


def make_step(model, variables, recipe):
    """A jitted fwd+bwd step ``(variables, x, c) -> (loss, grads)``; grads include x's (and fp8_meta's)."""

    def step(variables, x, c, key):
        def loss_fn(v):
            inner = {k: val for k, val in v.items() if k != "x"}
            y = model.apply(inner, v["x"], rngs={"quantize": key})
            return jnp.sum(y.astype(jnp.float32) * c)

        ctx = te_jax.autocast(recipe=recipe) if recipe is not None else te_jax.autocast(enabled=False)
        with ctx:
            return te_jax.train.value_and_grad(loss_fn)({**variables, "x": x})

    return CompiledStep(step, variables, jax.random.key(123))


class CompiledStep:
    """``step(variables, x, c, key)`` with its variables and key bound, compiled ahead of time on the
    first call (or by ``compile``), so the compile's time can be told apart from the step's."""

    def __init__(self, step, variables, key, next_variables: Callable = _next_linen_variables):
        self.step, self.variables, self.key, self.compiled = step, variables, key, None
        self.next_variables = next_variables  # (variables, the step's second output) -> the next variables

    def compile(self, x, c) -> float:
        """Compiles for ``x``, ``c``; returns the seconds it took."""
        start = time.perf_counter()
        self.compiled = jax.jit(self.step).lower(self.variables, x, c, self.key).compile()
        return time.perf_counter() - start

    def __call__(self, x, c):
        if self.compiled is None:
            self.compile(x, c)
        return self.compiled(self.variables, x, c, self.key)

    def advance_fp8_state(self, sets, steps: int) -> None:
        """Runs ``steps`` steps, each time replacing the FP8 state (te_jax's and flax's) by the step's update.

        Delayed scaling then quantizes with scales derived from the data's amaxes, as it does in
        training, rather than with the initial scale 1, under which the small initial weights become
        mostly subnormal or zero FP8 codes (and the GEMMs on them draw less power).
        """
        for i in range(steps):
            _, out = self(*sets[i % len(sets)])
            self.variables = jax.block_until_ready(self.next_variables(self.variables, out))


def _variants(section: str, only: str) -> list[tuple[str, str, object]]:
    """The section's variants as (name, "flax", "te", "te-recompute" or "nnx", flax FP8 kind or recipe), those matching ``only``."""
    variants = [("bf16 flax", "flax", None), *((name, "flax", kind) for name, kind in FLAX_FP8.items()),
                *((name, "te", r) for name, r in RECIPES.items()
                  if section == "mlp" or name.startswith(("te delayed", "te current")) or name == "te block"),
                *((name, "nnx", r) for name, r in NNX_RECIPES.items() if section == "mlp"),
                *((name, "te-recompute", r) for name, r in RECOMPUTE_RECIPES.items() if section == "mlp")]
    return selected(variants, only)


def _step_inputs(section: str, t: int, h: int, n: int, key) -> list[tuple[jax.Array, jax.Array]]:
    """Two input sets ``(x, c)`` of a step: x [T, H] bfloat16 and the loss weights c (float32, y's shape)."""
    return [(jax.random.normal(jax.random.fold_in(key, s), (t, h), jnp.float32).astype(BF16),
             jax.random.normal(jax.random.fold_in(key, 10 + s), (t, h if section == "mlp" else n), jnp.float32))
            for s in range(2)]


def _build_step(row: dict, section: str, h: int, n: int, impl: str, arg, sets, args) -> CompiledStep:
    """A variant's step, initialized, compiled and run once; records init_s and compile_s in ``row``.

    Each phase is printed as it ends under ``--verbose``, so that a stall shows where it is.
    """
    name, x0 = row["name"], sets[0][0]
    start = time.perf_counter()
    if impl == "flax":
        model, recipe = FlaxLayer(section, n, out_features=h, fp8=arg, bias=args.bias), None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            variables = jax.jit(model.init)(jax.random.key(1), x0)
    elif impl == "nnx":
        with te_jax.autocast(recipe=arg):
            model = te_jax.nnx.LayerNormMLP(h, n, activation="gelu", use_bias=args.bias, dtype=BF16,
                                            param_dtype=BF16, rngs=nnx.Rngs(1))
    else:
        model, recipe = te_layer(section, h, n, args.bias, recompute_norm_act=impl == "te-recompute"), arg
        with te_jax.autocast(recipe=recipe):
            variables = jax.jit(model.init)(jax.random.key(1), x0)
    if impl == "nnx":
        init_s = time.perf_counter() - start
        step = make_nnx_step(model, arg)
    else:
        jax.block_until_ready(variables)
        init_s = time.perf_counter() - start
        step = make_step(model, variables, recipe)
    if args.verbose:
        print(f"    {name}: init {init_s:.1f} s", flush=True)
    compile_s = step.compile(*sets[0])
    if args.verbose:
        print(f"    {name}: compile {compile_s:.1f} s", flush=True)
    start = time.perf_counter()
    jax.block_until_ready(step(*sets[0]))
    if args.verbose:
        print(f"    {name}: first step {time.perf_counter() - start:.1f} s", flush=True)
    if args.state_steps:
        step.advance_fp8_state(sets, args.state_steps)
    row.update(init_s=init_s, compile_s=compile_s, state_steps=args.state_steps)
    return step
