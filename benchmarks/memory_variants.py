"""The variants bench_memory.py compiles (issue 41): each a train step of one model, built on abstract inputs
(``jax.ShapeDtypeStruct``) for XLA's memory analysis or initialized for a measured run.

Sections: ``mlp`` (LayerNormMLP at bench_layers.py's shape), ``moe`` (bench_moe.py's layer shapes), ``gpt``
(examples/gpt's train step per preset). Also the attention stand-in used on a CPU (see bench_memory.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples.gpt, appended: an installed te_jax wins over the source tree
    sys.path.append(str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:  # layer_variants, bench_moe, timing
    sys.path.append(str(ROOT / "benchmarks"))

import te_jax  # noqa: E402
import te_jax.flax as tf  # noqa: E402
from te_jax import recipe as R  # noqa: E402

MLP_SHAPE = (8192, 8192, 28672)  # T, H, F: bench_layers.py's LayerNormMLP
TINY_MLP_SHAPE = (256, 128, 512)
RECIPES = "delayed,current,mxfp8,block"
PRESETS = "125m,1.3b,moe-1b"

# ---- what one variant is ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    """A variant's step, ready to lower: ``step(*args)`` (a plain function, jitted with ``jit_kwargs``, or a
    jitted one); ``loss(args[0])`` (a scalar of the differentiated argument, or None) for the residual
    analysis; ``advance(args, out)`` the next step's args (measured runs; None: the same args)."""

    step: Callable
    args: tuple
    loss: Callable | None = None
    advance: Callable | None = None
    jit_kwargs: dict = dataclasses.field(default_factory=dict)

    def jitted(self, name: str):
        """The step jitted; a plain function is renamed ``name`` first, which names its XLA module (and dump)."""
        if hasattr(self.step, "lower"):
            return self.step
        self.step.__name__ = self.step.__qualname__ = name
        return jax.jit(self.step, **self.jit_kwargs)


@dataclasses.dataclass(frozen=True)
class Variant:
    section: str
    case: str
    name: str
    build: Callable[[bool], Built]  # abstract -> Built
    at_batch: Callable[[int], Variant] | None = None  # gpt: the same variant at another batch size

    @property
    def key(self) -> str:
        return f"{self.section} | {self.case} | {self.name}"


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def autocast(recipe):
    return te_jax.autocast(recipe=recipe) if recipe is not None else te_jax.autocast(enabled=False)


# ---- the attention stand-in (CPU) ------------------------------------------------------------------------


@jax.custom_vjp
def _kept_like_cudnn(q, k, v):
    return _standin_fwd(q, k, v)[0]


def _standin_fwd(q, k, v):
    q, k, v = jax.lax.optimization_barrier((q, k, v))  # materialized in their dtype, as cuDNN takes them
    g = q.shape[2] // k.shape[2]
    o = jax.lax.optimization_barrier((q * jnp.repeat(k, g, axis=2) + jnp.repeat(v, g, axis=2)).astype(q.dtype))
    stats = jnp.sum(q.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # [B, N, T] float32, as cuDNN's
    return o, (q, k, v, o, stats)


def _standin_bwd(res, do):
    q, k, v, o, stats = res
    g = q.shape[2] // k.shape[2]
    s = do.astype(jnp.float32) * o.astype(jnp.float32) + stats.transpose(0, 2, 1)[..., None]
    dkv = s.reshape(*s.shape[:2], k.shape[2], g, s.shape[-1]).sum(3)
    return ((s * jnp.repeat(k, g, axis=2)).astype(q.dtype), (dkv * k).astype(k.dtype), (dkv * v).astype(v.dtype))


_kept_like_cudnn.defvjp(_standin_fwd, _standin_bwd)


def _attention_standin(q, k, v, *args, **kwargs):
    """``jax.nn.dot_product_attention``'s memory under cuDNN (keeps q, k, v, o, [B, N, T] statistics); not its values."""
    return _kept_like_cudnn(q, k, v)


@contextlib.contextmanager
def attention(kind: str):
    """A context in which ``jax.nn.dot_product_attention`` is the stand-in ("standin") or itself ("native").

    With the stand-in, te_jax's attention layers choose "cudnn" as they would on a GPU (their output projection
    then keeps no FP8 copy of the attention output that cuDNN keeps).
    """
    if kind == "native":
        yield
        return
    import te_jax.flax.transformer as linen_transformer
    import te_jax.nnx.transformer as nnx_transformer

    cudnn = lambda q, mask=None: "cudnn"  # noqa: E731
    with mock.patch.object(jax.nn, "dot_product_attention", _attention_standin), \
            mock.patch.object(linen_transformer, "choose_attention_implementation", cudnn), \
            mock.patch.object(nnx_transformer, "choose_attention_implementation", cudnn):
        yield


# ---- the sections ----------------------------------------------------------------------------------------


def _layer_step(model, recipe, shape, abstract_only: bool, x_dtype=jnp.bfloat16) -> Built:
    """layer_variants.make_step's step (fwd + bwd of ``sum(y * c)``, grads of x, params, FP8 state)."""
    from layer_variants import make_step

    t, h, _ = shape
    key = jax.random.key(1)
    x = jax.ShapeDtypeStruct((t, h), x_dtype)
    c = jax.ShapeDtypeStruct((t, h), jnp.float32)
    with autocast(recipe):
        variables = jax.eval_shape(model.init, key, x) if abstract_only else jax.jit(model.init)(key, jnp.zeros(x.shape, x.dtype))
    if not abstract_only:
        x = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(x_dtype)
        c = jax.random.normal(jax.random.key(3), c.shape, jnp.float32)
    stepper = make_step(model, variables, recipe)

    def loss(variables):
        with autocast(recipe):
            y = model.apply(variables, jnp.ones((t, h), x_dtype), rngs={"quantize": key})
        return jnp.sum(y.astype(jnp.float32))

    return Built(stepper.step, (variables, x, c, stepper.key), loss)


def _te_reference_mlp(shape, recipe_name: str | None):
    """TransformerEngine-JAX's LayerNormMLP (where importable) as a Built factory, else None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None

    def build(abstract_only: bool) -> Built:
        import transformer_engine.jax as te
        import transformer_engine.jax.flax as te_flax
        from transformer_engine.common import recipe as te_recipe

        t, h, f = shape
        recipes = {"delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
                   "block": getattr(te_recipe, "Float8BlockScaling", None)}
        rec = recipes[recipe_name]() if recipe_name else None

        def ctx():  # TransformerEngine 2.8 renamed fp8_autocast(fp8_recipe=) to autocast(recipe=)
            if hasattr(te, "autocast"):
                return te.autocast(enabled=rec is not None, recipe=rec)
            return te.fp8_autocast(enabled=rec is not None, fp8_recipe=rec)

        model = te_flax.LayerNormMLP(intermediate_dim=f, activations=("gelu",), use_bias=False, dtype=jnp.bfloat16)
        x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
        with ctx():
            variables = (jax.eval_shape(model.init, jax.random.key(1), x) if abstract_only
                         else jax.jit(model.init)(jax.random.key(1), jnp.zeros(x.shape, x.dtype)))
        if not abstract_only:
            x = jax.random.normal(jax.random.key(2), x.shape, jnp.bfloat16)

        def step(variables, x):
            def loss(v, x):
                with ctx():
                    y, _ = model.apply(v, x, mutable=True)
                return jnp.sum(y.astype(jnp.float32))
            return jax.value_and_grad(loss, argnums=(0, 1))(variables, x)

        return Built(step, (variables, x))

    return build


def mlp_variants(args) -> list[Variant]:
    from layer_variants import FlaxLayer

    shape = TINY_MLP_SHAPE if args.tiny else MLP_SHAPE
    t, h, f = shape
    case = f"LayerNormMLP T={t} H={h} F={f}"
    out = [Variant("mlp", case, "bf16 flax.linen",
                   lambda a: _layer_step(FlaxLayer("mlp", f, out_features=h), None, shape, a)),
           Variant("mlp", case, "flax fp8 (Fp8DirectDotGeneralOp)",
                   lambda a: _layer_step(FlaxLayer("mlp", f, out_features=h, fp8="direct"), None, shape, a))]
    for name in [None, *recipe_names(args)]:
        recipe = None if name is None else R.load_recipe(name)
        for option in args.options:
            rc = option == "recompute_norm_act"
            label = f"te {name or 'bf16 (autocast off)'}" + (", recompute_norm_act" if rc else "")
            out.append(Variant("mlp", case, label, lambda a, recipe=recipe, rc=rc: _layer_step(
                tf.LayerNormMLP(intermediate_dim=f, activation="gelu", use_bias=False, dtype=jnp.bfloat16,
                                param_dtype=jnp.bfloat16, recompute_norm_act=rc), recipe, shape, a)))
        reference = _te_reference_mlp(shape, name)
        if reference is not None and name in (None, "delayed", "current", "block"):
            out.append(Variant("mlp", case, f"TransformerEngine-JAX {name or 'bf16'}", reference))
    return out


def moe_variants(args) -> list[Variant]:
    import bench_moe

    out = []
    for label, experts, top_k, tokens, hidden, width in (bench_moe.TINY_LAYERS if args.tiny else bench_moe.LAYERS):
        case = f"MoE {label} E={experts} top-{top_k} T={tokens} H={hidden} F={width}"
        layer = bench_moe._layer(experts, top_k, width)

        def build(abstract_only, recipe=None, einsum=False, layer=layer, tokens=tokens, hidden=hidden,
                  top_k=top_k):
            x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
            with autocast(recipe):
                variables = (jax.eval_shape(layer.init, jax.random.key(4), x) if abstract_only
                             else jax.jit(layer.init)(jax.random.key(4), jnp.zeros(x.shape, x.dtype)))
            c = x
            if not abstract_only:
                x = jax.random.normal(jax.random.key(5), x.shape, jnp.bfloat16)
                c = jax.random.normal(jax.random.key(6), x.shape, jnp.bfloat16)
            if einsum:
                def step(p, x, c):
                    return jax.grad(lambda p, x: jnp.sum((bench_moe.einsum_moe(p, x, top_k) * c)
                                                         .astype(jnp.float32)), argnums=(0, 1))(p, x)
                return Built(step, (variables["params"], x, c))

            def loss(variables):
                with autocast(recipe):
                    return jnp.sum(layer.apply(variables, jnp.ones((tokens, hidden), jnp.bfloat16))
                                   .astype(jnp.float32))
            return Built(bench_moe._layer_step(layer, recipe), (variables, x, c), loss)

        out.append(Variant("moe", case, "bf16 einsum cap 1.0", lambda a, b=build: b(a, einsum=True)))
        out.append(Variant("moe", case, "te bf16 (autocast off, ragged_dot)", lambda a, b=build: b(a)))
        for name in recipe_names(args):
            out.append(Variant("moe", case, f"te {name}", lambda a, b=build, n=name: b(a, R.load_recipe(n))))
    return out


def gpt_built(cfg, abstract_only: bool) -> Built:
    """examples/gpt/train.py's train step of ``cfg`` (its model, recipe, optimizer and step functions), with
    ``(state, tokens)``: shapes only (``abstract_only``), or ``train.build_run``'s initialized state."""
    from examples.gpt import parallel
    from examples.gpt import train as train_lib
    from examples.gpt.config import make_recipe
    from examples.gpt.model import aux_loss
    from examples.gpt.steps import autocast_for, cross_entropy, make_optimizer, make_train_step
    from te_jax.train import TrainState

    cfg = cfg.resolved()
    shape = cfg.check()
    recipe = make_recipe(cfg.recipe, cfg.model_config().layers)
    mesh, mesh_resource = parallel.make_mesh(shape), parallel.mesh_resource(shape)
    key = jax.random.key(cfg.seed)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)
    if abstract_only:  # build_run's state, as shapes
        model = train_lib.gpt_model(cfg)
        with autocast_for(recipe, mesh_resource, False, mesh):
            variables = jax.eval_shape(model.init, {"params": key, "quantize": key},
                                       jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32))
        variables, _ = parallel.param_specs(dict(variables), shape)
        state = jax.eval_shape(lambda v: TrainState.create(apply_fn=model.apply, params=v, tx=make_optimizer(cfg))
                               .replace(step=jnp.asarray(0, jnp.int32)), variables)
        step = make_train_step(model, recipe, mesh_resource, key, mesh=mesh)
    else:
        run = train_lib.build_run(cfg)
        model, state, step = run.model, run.state, run.train_step
        tokens = jax.device_put(jax.random.randint(jax.random.key(7), tokens.shape, 0, 256, jnp.int32),
                                run.batch_sharding)

    def loss(variables):
        t = jnp.zeros(tokens.shape, jnp.int32)
        with autocast_for(recipe, mesh_resource, False, mesh):
            logits, sown = model.apply(variables, t[:, :-1], rngs={"quantize": key}, mutable=["intermediates"])
        return cross_entropy(logits, t[:, 1:]) + aux_loss(sown)

    return Built(step, (state, tokens), lambda state: loss(state.params), lambda args, out: (out[0], args[1]),
                 {"donate_argnums": 0})


def gpt_variants(args) -> list[Variant]:
    from examples.gpt.config import RunConfig
    from examples.gpt.presets import PRESETS as GPT_PRESETS

    out = []
    for preset in args.presets:
        moe = GPT_PRESETS[preset].model.experts > 0
        depths = [2, 4] if args.per_block else [args.layers]
        for depth in depths:
            case = f"GPT {preset}" + (f" @ {depth} blocks" if depth else "")
            runs = ([] if moe else [("bf16 flax.linen", "flax", "none", False)]) + [
                ("flax fp8 (Fp8DirectDotGeneralOp)", "flax-fp8", "none", False)]
            for name in ["bf16", *recipe_names(args)]:
                label = "te bf16 (autocast off)" if name == "bf16" else f"te {name}"
                runs += [(label + (", recompute_norm_act" if o == "recompute_norm_act" else ""), name, "none",
                          o == "recompute_norm_act") for o in args.options]
                runs += [(f"{label}, remat {p}", name, p, False) for p in args.remat if name in args.remat_recipes]
            for label, recipe, remat, rc in runs:
                cfg = RunConfig(preset=preset, recipe=recipe, remat=remat, recompute_norm_act=rc,
                                batch=args.batch, seq_len=args.seq_len, progress=False)
                out.append(_gpt_variant(case, label, cfg, depth))
    return out


def _gpt_variant(case: str, label: str, cfg, depth: int) -> Variant:
    """The GPT train step of ``cfg`` at ``depth`` blocks (0: the preset's), which can be rebuilt at another batch."""
    def build(a):
        if depth:
            from examples.gpt import presets as presets_lib
            p = presets_lib.PRESETS[cfg.preset]
            with mock.patch.dict(presets_lib.PRESETS, {cfg.preset: dataclasses.replace(
                    p, model=dataclasses.replace(p.model, layers=depth))}):
                return gpt_built(cfg, a)
        return gpt_built(cfg, a)

    return Variant("gpt", case, label, build,
                   lambda batch: _gpt_variant(case, label, dataclasses.replace(cfg, batch=batch), depth))


def recipe_names(args) -> list[str]:
    return [n for n in args.recipes if n]


SECTIONS = {"mlp": mlp_variants, "moe": moe_variants, "gpt": gpt_variants}
