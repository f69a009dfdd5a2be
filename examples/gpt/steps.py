"""The optimizer and the train and eval steps of the GPT example (used by examples/gpt/train.py).

* ``make_optimizer``: AdamW with warmup and cosine decay, after global-norm clipping, for the
  parameters only (te_jax.train.TrainState keeps the fp8_meta state out of it).
* ``autocast_for``: the ``te_jax.autocast`` block every trace of the model runs in (disabled for bf16).
* ``make_train_step`` / ``make_eval_step``: the train step (``te_jax.train.value_and_grad`` over the
  whole variables dict; with ``inspect``, the quantization statistics too) and the eval loss.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import optax

import te_jax
from examples.gpt import parallel
from examples.gpt.config import RunConfig
from examples.gpt.model import aux_loss
from te_jax import inspect as te_inspect
from te_jax import recipe as R
from te_jax.train import TrainState


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after clipping the global gradient norm.

    te_jax.train.TrainState hands this optimizer the parameters only, so the
    clipping and the weight decay never touch the fp8_meta state.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup, max(cfg.steps - 1, 1)), max(cfg.steps, 2), end_value=cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731  (kernels, embeddings)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


@contextlib.contextmanager
def autocast_for(recipe: R.Recipe | None, mesh_resource, inspect: bool | te_inspect.Sample = False,
                 mesh: jax.sharding.Mesh | None = None):
    """The autocast block every trace of the model runs in (disabled for bf16), on ``mesh`` when given.

    ``mesh`` becomes the current abstract mesh (``parallel.traced_on``): the
    expert-parallel MoE (``mesh_resource.ep_resource``) needs it.
    """
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(parallel.traced_on(mesh))
        if recipe is None:
            stack.enter_context(te_jax.autocast(enabled=False, mesh_resource=mesh_resource))
        else:
            stack.enter_context(te_jax.autocast(recipe=recipe, mesh_resource=mesh_resource, inspect=inspect))
        yield


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_train_step(model, recipe, mesh_resource, base_key, inspect: bool | te_inspect.Sample = False,
                    mesh: jax.sharding.Mesh | None = None):
    """The train step, traced on ``mesh`` when given; with ``inspect`` its metrics also hold the quantization
    statistics ("fp8_stats")."""

    def train_step(state: TrainState, tokens):
        key = jax.random.fold_in(base_key, state.step)  # new "quantize" key each step (NVFP4 rounding)

        def loss_fn(variables):
            logits, sown = state.apply_fn(variables, tokens[:, :-1], rngs={"quantize": key},
                                          mutable=["intermediates"])
            loss = cross_entropy(logits, tokens[:, 1:])
            return loss + aux_loss(sown), loss

        with autocast_for(recipe, mesh_resource, inspect, mesh):
            (_, loss), grads = te_jax.train.value_and_grad(loss_fn, has_aux=True)(state.params)
        squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads["params"])]
        grad_norm = jnp.sqrt(sum(squares))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if inspect:
            metrics[te_inspect.STATS_COLLECTION] = grads[te_inspect.STATS_COLLECTION]
        return state.apply_gradients(grads=grads), metrics

    return train_step


def make_eval_step(model, recipe, mesh_resource, mesh: jax.sharding.Mesh | None = None):
    def eval_step(variables, tokens):
        with autocast_for(recipe, mesh_resource, mesh=mesh):
            logits = model.apply(variables, tokens[:, :-1])
        return cross_entropy(logits, tokens[:, 1:])

    return eval_step
