"""te_jax.moe on one device: the router, the dropless permutation, and permute -> grouped FFN -> unpermute.

Checks: top-k choice, gates and counts against numpy; the expert bias steers the choice but not the gates;
the load-balancing loss's value and gradient; trace-time errors; rows grouped by expert, stably; the
permuted pipeline (and its gradients) against the dense per-token reference, including every token on
one expert and experts with no tokens; the per-group reference GEMM against ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from moe_util import dense_moe_reference, grouped_ffn, grouped_matmul_reference, moe_weights, routing_logits

from te_jax import moe

T, E, H, F = 64, 8, 16, 32


def _np_softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _np_topk(scores, k):
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize("normalize", (True, False))
@pytest.mark.parametrize("k", (1, 2, 8))
def test_softmax_route_matches_numpy(k, normalize):
    logits = routing_logits(0, T, E, "random")
    r = jax.jit(lambda lg: moe.route(lg, k, normalize_gates=normalize))(logits)
    probs = _np_softmax(np.asarray(logits, np.float64))
    ids = _np_topk(probs, k)
    gates = np.take_along_axis(probs, ids, -1)
    if normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    np.testing.assert_array_equal(r.expert_ids, ids)
    assert r.expert_ids.dtype == jnp.int32 and r.gates.dtype == jnp.float32
    np.testing.assert_allclose(r.gates, gates, rtol=1e-5)
    np.testing.assert_array_equal(r.tokens_per_expert, np.bincount(ids.reshape(-1), minlength=E))
    assert r.tokens_per_expert.dtype == jnp.int32
    frac = np.bincount(ids.reshape(-1), minlength=E) / (T * k)
    np.testing.assert_allclose(r.aux_loss, E * np.sum(frac * probs.mean(0)), rtol=1e-5)


def test_sigmoid_bias_steers_the_choice_not_the_gates():
    logits = routing_logits(1, T, E, "random")
    bias = jnp.zeros(E).at[3].set(10.0).at[5].set(-10.0)  # expert 3 always chosen, expert 5 never
    r = moe.route(logits, 2, score_function="sigmoid", expert_bias=bias)
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    ids = _np_topk(scores + np.asarray(bias), 2)
    np.testing.assert_array_equal(r.expert_ids, ids)
    assert np.all(r.expert_ids[:, 0] == 3) and not np.any(r.expert_ids == 5)
    gates = np.take_along_axis(scores, ids, -1)
    np.testing.assert_allclose(r.gates, gates / gates.sum(-1, keepdims=True), rtol=1e-5)
    normalized = scores / scores.sum(-1, keepdims=True)
    frac = np.bincount(ids.reshape(-1), minlength=E) / (T * 2)
    np.testing.assert_allclose(r.aux_loss, E * np.sum(frac * normalized.mean(0)), rtol=1e-5)
    # No bias: the plain top-k of the scores; the bias gets no gradient.
    np.testing.assert_array_equal(moe.route(logits, 2, score_function="sigmoid").expert_ids, _np_topk(scores, 2))
    grad_bias = jax.grad(lambda b: jnp.sum(moe.route(logits, 2, score_function="sigmoid", expert_bias=b).gates))(bias)
    np.testing.assert_array_equal(grad_bias, np.zeros(E))


def test_load_balancing_loss_extremes_and_gradient():
    uniform = moe.route(jnp.zeros((T, E)), 2)  # uniform probabilities, whatever the loads: 1
    np.testing.assert_allclose(uniform.aux_loss, 1.0, rtol=1e-6)
    collapsed = moe.route(routing_logits(2, T, E, "skew") * 10, 1)  # all on one expert with p ~ 1: E
    np.testing.assert_allclose(collapsed.aux_loss, E, rtol=1e-4)
    np.testing.assert_array_equal(collapsed.tokens_per_expert, [0] * (E - 1) + [T])
    # Every token's logits 0.3 apart, so the finite differences never change the choice.
    logits = jnp.argsort(routing_logits(3, 16, E, "random"), axis=-1).astype(jnp.float32) * 0.3
    for fn in moe.SCORE_FUNCTIONS:
        def gates_and_loss(lg, fn=fn):
            r = moe.route(lg, 2, score_function=fn)
            return r.gates, r.aux_loss

        check_grads(jax.jit(gates_and_loss), (logits,), order=1, modes=["rev"], eps=1e-3, atol=1e-3, rtol=1e-3)


def test_update_expert_bias_moves_toward_balance():
    counts = jnp.array([10, 2, 6, 6], jnp.int32)  # mean 6
    np.testing.assert_allclose(moe.update_expert_bias(jnp.ones(4), counts, 0.5), [0.5, 1.5, 1.0, 1.0])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: moe.route(jnp.zeros((4, 3)), 4), "num_experts_per_tok"),
        (lambda: moe.route(jnp.zeros((4, 3)), 0), "num_experts_per_tok"),
        (lambda: moe.route(jnp.zeros((4, 3)), 2, score_function="relu"), "score_function"),
        (lambda: moe.route(jnp.zeros((4,)), 1), "logits"),
        (lambda: moe.route(jnp.zeros((2, 4, 3)), 1), "logits"),
        (lambda: moe.route(jnp.zeros((4, 3)), 1, expert_bias=jnp.zeros(4)), "expert_bias"),
        (lambda: moe.permute(jnp.zeros((4, 8)), jnp.zeros((5, 2), jnp.int32), 3), "expert_ids"),
        (lambda: moe.unpermute(jnp.zeros((7, 8)), moe.sort_assignments(jnp.zeros((4, 2), jnp.int32), 3),
                               jnp.ones((4, 2))), "y_sorted"),
        (lambda: moe.apply_experts(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2)),
                                   lambda x, g: x, num_experts=3, capacity=2), "capacity"),
    ],
)
def test_bad_input_fails_at_trace_time(call, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(call)


@pytest.mark.parametrize("case, k", [("random", 2), ("skew", 1), ("empty", 3)])
def test_permute_groups_rows_by_expert_stably(case, k):
    x = jax.random.normal(jax.random.key(4), (T, H))
    ids = moe.route(routing_logits(5, T, E, case), k).expert_ids
    x_sorted, perm = jax.jit(moe.permute, static_argnums=2)(x, ids, E)
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    assert x_sorted.shape == (T * k, H) and perm.group_sizes.dtype == jnp.int32
    np.testing.assert_array_equal(perm.group_sizes, np.bincount(flat, minlength=E))
    np.testing.assert_array_equal(perm.sorted_assignment, order)
    np.testing.assert_array_equal(x_sorted, np.asarray(x)[order // k])
    np.testing.assert_array_equal(np.asarray(perm.sorted_assignment)[perm.assignment_row], np.arange(T * k))
    if case != "random":
        assert np.any(np.asarray(perm.group_sizes) == 0)


@pytest.mark.parametrize("case, k", [("random", 2), ("skew", 1), ("empty", 3)])
def test_aligned_permutation(case, k):
    """align 16: each expert's rows start at a multiple of 16, zero rows between; the rows, gradients and
    unpermute equal the packed permutation's, and only gathers are added to the gradient program."""
    align = 16
    x = jax.random.normal(jax.random.key(4), (T, H))
    r = jax.jit(moe.route, static_argnums=1)(routing_logits(5, T, E, case), k)
    packed, perm = jax.jit(moe.permute, static_argnums=2)(x, r.expert_ids, E)
    aligned, perm_al = jax.jit(lambda x, ids: moe.permute(x, ids, E, align=align))(x, r.expert_ids)
    rows = moe.aligned_rows(T * k, E, align)
    assert aligned.shape == (rows, H) and rows % align == 0 and rows >= T * k + E * (align - 1)
    np.testing.assert_array_equal(perm_al.group_sizes, perm.group_sizes)
    sizes = np.asarray(perm.group_sizes)
    spans = -(-sizes // align) * align
    where = np.concatenate([np.arange(m) + s for m, s in zip(sizes, np.cumsum(spans) - spans)]).astype(int)
    np.testing.assert_array_equal(np.asarray(aligned)[where], packed)
    assert not np.any(np.delete(np.asarray(aligned), where, axis=0))
    np.testing.assert_array_equal(np.asarray(perm_al.assignment_row), where[np.asarray(perm.assignment_row)])
    assert np.all(np.delete(np.asarray(perm_al.sorted_assignment), where) == -1)

    def loss(x, gates, align):
        x_sorted, p = moe.permute(x, r.expert_ids, E, align=align)
        return jnp.sum(moe.unpermute(x_sorted * 2.0, p, gates) ** 2)

    grads = [jax.jit(jax.grad(functools.partial(loss, align=a), argnums=(0, 1)))(x, r.gates) for a in (1, align)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
    scatters = lambda f: jax.jit(f).lower(x, r.gates).as_text().count("stablehlo.scatter")  # noqa: E731
    aligned_loss = lambda x, g: loss(x, g, align)  # noqa: E731
    assert scatters(jax.grad(aligned_loss, argnums=(0, 1))) == scatters(aligned_loss)  # the forward's row counts
    with pytest.raises(ValueError, match="align must be a positive int"):
        moe.permute(x, r.expert_ids, E, align=0)


def test_aligned_and_packed_layouts_are_inverse_gathers():
    """aligned_layout of permute's packed rows is permute's aligned layout; packed_layout takes it back (zeros past
    the groups); each one's gradient is the other (no scatter added)."""
    x = jax.random.normal(jax.random.key(4), (T, H))
    r = moe.route(routing_logits(5, T, E, "skew"), 2)
    packed, perm = moe.permute(x, r.expert_ids, E)
    packed = jnp.concatenate([packed, jnp.full((5, H), 7.0)])  # rows past the groups, as dispatch may leave
    aligned = moe.aligned_layout(packed, perm.group_sizes, 16)
    np.testing.assert_array_equal(aligned, moe.permute(x, r.expert_ids, E, align=16)[0])
    back = moe.packed_layout(aligned, perm.group_sizes, 16, packed.shape[0])
    np.testing.assert_array_equal(back, packed.at[T * 2:].set(0.0))
    c = jax.random.normal(jax.random.key(6), aligned.shape)

    def loss(t):
        return jnp.sum(moe.packed_layout(moe.aligned_layout(t, perm.group_sizes, 16) * c, perm.group_sizes, 16,
                                         t.shape[0]) ** 2)

    def plain(t):  # the same moves written as gathers JAX differentiates (scatter-add gradients)
        sizes = np.asarray(perm.group_sizes)
        spans = -(-sizes // 16) * 16
        where = np.concatenate([np.arange(m) + s for m, s in zip(sizes, np.cumsum(spans) - spans)]).astype(int)
        moved = jnp.zeros(aligned.shape).at[where].set(t[:T * 2]) * c
        return jnp.sum(jnp.zeros(t.shape).at[:T * 2].set(moved[where]) ** 2)

    np.testing.assert_allclose(jax.grad(loss)(packed), jax.grad(plain)(packed), rtol=1e-6)
    assert jax.jit(jax.grad(loss)).lower(packed).as_text().count("stablehlo.scatter") == \
        jax.jit(loss).lower(packed).as_text().count("stablehlo.scatter")


def test_permutation_gradients_are_gathers():
    """The gradients of permute and unpermute add no scatter to the program (a scatter-add costs several gathers
    on a GPU): the forward's scatters (counting rows per expert) are all the gradient program has."""
    x = jax.random.normal(jax.random.key(4), (T, H))
    r = moe.route(routing_logits(5, T, E, "random"), 2)

    def loss(x, gates):
        x_sorted, perm = moe.permute(x, r.expert_ids, E)
        return jnp.sum(moe.unpermute(x_sorted * 2.0, perm, gates) ** 2)

    scatters = lambda f: jax.jit(f).lower(x, r.gates).as_text().count("stablehlo.scatter")  # noqa: E731
    assert scatters(jax.grad(loss, argnums=(0, 1))) == scatters(loss)
    got = jax.grad(loss, argnums=(0, 1))(x, r.gates)
    # The same function through plain gathers, differentiated by JAX (scatter-add gradients).
    def plain(x, gates):
        perm = moe.sort_assignments(r.expert_ids, E)
        rows = x[perm.sorted_assignment // 2] * 2.0
        per = rows[perm.assignment_row].reshape(T, 2, H) * gates[..., None]
        return jnp.sum((per[:, 0] + per[:, 1]) ** 2)
    want = jax.grad(plain, argnums=(0, 1))(x, r.gates)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align", (1, 16))
def test_row_gathers_read_indices_computed_once(align):
    """The permutation's row indices are computed once per row, not inside the gathers of ``[rows, H]``
    elements: the compiled program (forward and gradients, 64 experts, top-8) has no fusion that gathers rows
    and also runs a cumulative sum or a loop over the group sizes (on a GPU such a fusion ran ten times slower
    than the gather alone)."""
    tokens, k, experts, hidden = 256, 8, 64, 128
    x = jax.random.normal(jax.random.key(6), (tokens, hidden), jnp.bfloat16)
    r = moe.route(routing_logits(7, tokens, experts, "random"), k)

    def loss(x, gates):
        x_sorted, perm = moe.permute(x, r.expert_ids, experts, align=align)
        return jnp.sum(moe.unpermute(x_sorted * 2, perm, gates).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    assert "optimization_barrier" in step.lower(x, r.gates).as_text()
    computations = re.split(r"\n(?=\S)", step.lower(x, r.gates).compile().as_text())
    row_gathers = [c for c in computations if f"slice_sizes={{1,{hidden}}}" in c]
    assert row_gathers
    for c in row_gathers:
        assert not re.search(r"reduce-window|while\(|cumsum", c), c.split("\n", 1)[0]


def _pipeline_given(x, expert_ids, gates, w_in, w_out, k):
    x_sorted, perm = moe.permute(x, expert_ids, E)
    return moe.unpermute(grouped_ffn(w_in, w_out)(x_sorted, perm.group_sizes), perm, gates)


def _pipeline(x, logits, w_in, w_out, k):
    r = moe.route(logits, k, normalize_gates=k > 1)  # one normalised gate is 1, with no gradient
    return _pipeline_given(x, r.expert_ids, r.gates, w_in, w_out, k)


def _reference(x, logits, w_in, w_out, k):
    r = moe.route(logits, k, normalize_gates=k > 1)
    return dense_moe_reference(x, r.expert_ids, r.gates, w_in, w_out)


@pytest.mark.parametrize("case, k", [("random", 2), ("skew", 1), ("empty", 3)])
def test_permuted_ffn_matches_dense_reference_with_gradients(case, k):
    x = jax.random.normal(jax.random.key(6), (T, H))
    logits = routing_logits(7, T, E, case)
    w_in, w_out = moe_weights(8, E, H, F)
    args = (x, logits, w_in, w_out)
    got = jax.jit(_pipeline, static_argnums=4)(*args, k)
    want = jax.jit(_reference, static_argnums=4)(*args, k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    r = moe.route(logits, k)
    apply = jax.jit(lambda *a: moe.apply_experts(*a, grouped_ffn(w_in, w_out), num_experts=E))
    np.testing.assert_array_equal(apply(x, r.expert_ids, r.gates),
                                  jax.jit(_pipeline_given, static_argnums=5)(x, r.expert_ids, r.gates, w_in, w_out, k))

    cotangent = jax.random.normal(jax.random.key(9), (T, H))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(_pipeline(*a, k) * cotangent), argnums=(0, 1, 2, 3)))(*args)
    want_grads = jax.jit(jax.grad(lambda *a: jnp.sum(_reference(*a, k) * cotangent), argnums=(0, 1, 2, 3)))(*args)
    for name, g, w in zip(("x", "logits", "w_in", "w_out"), grads, want_grads):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale, err_msg=name)
    if case == "random":  # the gradient reaches the router through the gates (saturated elsewhere)
        assert float(jnp.max(jnp.abs(grads[1]))) > 1e-3
    if case == "empty":  # experts without tokens get exactly zero gradient
        np.testing.assert_array_equal(grads[2][E // 2:], 0)


def test_grouped_reference_matches_ragged_dot_and_zeros_past_the_sum():
    x = jax.random.normal(jax.random.key(10), (T, H))
    kernel = jax.random.normal(jax.random.key(11), (E, H, F))
    sizes = jnp.array([0, 30, 0, 0, 21, 5, 0, 0], jnp.int32)  # 56 of 64 rows
    cpu = jax.devices("cpu")[0]  # float32 products in full precision (a GPU's default matmul is not)
    x, kernel, sizes = jax.device_put((x, kernel, sizes), cpu)
    with jax.default_device(cpu):
        got = grouped_matmul_reference(x, kernel, sizes)
        want = jax.lax.ragged_dot(x, kernel, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[56:], 0)
    np.testing.assert_allclose(got[30:51], x[30:51] @ kernel[4], rtol=1e-5, atol=1e-5)


def test_nan_token_stays_in_its_row():
    """A NaN in one token's input or router logits makes that token's output NaN and no other's."""
    x = jax.random.normal(jax.random.key(12), (T, H))
    logits = routing_logits(13, T, E, "random")
    w_in, w_out = moe_weights(14, E, H, F)
    pipeline = jax.jit(_pipeline, static_argnums=4)
    clean = pipeline(x, logits, w_in, w_out, 2)
    for bad_x, bad_logits in ((x.at[5, 3].set(jnp.nan), logits), (x, logits.at[5].set(jnp.nan))):
        y = pipeline(bad_x, bad_logits, w_in, w_out, 2)
        assert np.all(np.isnan(y[5]))
        np.testing.assert_array_equal(np.delete(np.asarray(y), 5, 0), np.delete(np.asarray(clean), 5, 0))
        ids = moe.route(bad_logits, 2).expert_ids
        assert np.all((0 <= ids) & (ids < E))
