"""benchmarks/bench_gpt_options.py on CPU: a smoke run of the memory options timed in turns on one chained state,
each variant's own step, and the clear error for a variant whose parameters differ (the GPU runs the 1.3b preset)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import bench_gpt_options as bench  # noqa: E402
from examples.gpt import train as train_lib  # noqa: E402
from examples.gpt.config import RunConfig  # noqa: E402

SMALL = ["--preset", "tiny", "--batch", "2", "--seq-len", "32"]
TINY = RunConfig(preset="tiny", recipe="delayed", batch=2, seq_len=32, progress=False)


def test_every_variant_is_timed_on_one_chained_state(tmp_path, capsys):
    variants = ["none", "recompute_norm_act", "remat:fp8"]
    warmup, iters, trials = 1, 1, 2
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    result = bench.main([*SMALL, "--variants", ",".join(variants), "--warmup", str(warmup), "--iters", str(iters),
                         "--trials", str(trials), "--out", str(out), "--md", str(md)])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and len(r["trial_ms"]) == trials, r
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("temp_gib", "total_gib")), r
    assert rows["none"]["vs_none"] == 1.0 and rows["remat:fp8"]["vs_none"] > 0
    # One state went through every step of every variant: its step counter counts them all.
    assert result["steps_run"] == len(variants) * (warmup + iters * trials)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    table = md.read_text()
    assert "| variant | median ms | tokens/s | time vs none | temp GiB | total GiB |" in table
    assert all(f"| {name} |" in table for name in variants) and "peak_bytes_in_use" in table
    assert table in capsys.readouterr().out


def test_each_variant_steps_its_own_model_on_the_shared_state():
    """The state's apply_fn is the first variant's; each step swaps its own model in (remat and
    recompute_norm_act add optimization barriers to the ``none`` step's) and hands back the same tree.

    The ``none`` step has barriers of its own where attention runs on cuDNN (the default on a GPU):
    SelfAttention's output projection then recomputes its input's FP8 copy in the backward (a
    ``jax.checkpoint``), as it always does beside cuDNN's attention; under XLA's attention it has none."""
    from te_jax.core.layer_support import choose_attention_implementation

    configs = {name: bench.variant_config(TINY, name) for name in ("none", "remat:fp8", "recompute_norm_act")}
    run = train_lib.build_run(configs["none"])
    tokens = jnp.zeros((TINY.batch, TINY.seq_len + 1), jnp.int32)
    texts = {}
    for name, cfg in configs.items():
        lowered = bench.make_step(run, cfg).lower(run.state, tokens)
        assert jax.tree.structure(lowered.out_info[0]) == jax.tree.structure(run.state), name
        texts[name] = lowered.as_text()
    barriers = {name: text.count("optimization_barrier") for name, text in texts.items()}
    model = configs["none"].model_config()
    q = jax.ShapeDtypeStruct((TINY.batch, TINY.seq_len, model.heads, model.hidden // model.heads), jnp.bfloat16)
    attention = choose_attention_implementation(q)
    if attention == "cudnn":
        assert barriers["none"] > 0, f"under cuDNN's attention the none step has no optimization barrier: {barriers}"
    else:
        assert barriers["none"] == 0, f"under {attention} attention the none step has barriers: {barriers}"
    for name in ("remat:fp8", "recompute_norm_act"):
        assert barriers[name] > barriers["none"], (f"{name} adds no optimization barrier to the none step's "
                                                   f"({attention} attention): {barriers}")
    assert len(set(texts.values())) == len(texts), "two variants lowered to the same program"


def test_a_variant_with_other_parameters_is_refused():
    shared = bench.abstract_variables(TINY)
    bench.check_shares_state(shared, "none", {"remat:nothing": bench.abstract_variables(
        bench.variant_config(TINY, "remat:nothing"))})
    other = bench.abstract_variables(RunConfig(preset="tiny-moe", recipe="delayed", batch=2, seq_len=32))
    with pytest.raises(SystemExit, match=r"te_jax: bench_gpt_options: variant 'moe' has another parameter tree "
                                         r"than the state built from 'none' \(\['"):
        bench.check_shares_state(shared, "none", {"moe": other})


def test_first_difference_names_the_path_shape_and_dtype():
    leaf = jax.ShapeDtypeStruct
    ref = {"params": {"a": leaf((4, 8), jnp.bfloat16), "b": leaf((8,), jnp.float32)}}
    assert bench.first_difference(ref, ref) is None
    assert bench.first_difference(ref, {"params": {"a": ref["params"]["a"]}}) == "['params']['b'] is missing"
    assert bench.first_difference(ref, {"params": {**ref["params"], "c": leaf((), jnp.float32)}}) == (
        "['params']['c'] is not in the shared state")
    assert bench.first_difference(ref, {"params": {**ref["params"], "b": leaf((9,), jnp.float32)}}) == (
        "['params']['b'] is float32[9], the shared state's float32[8]")
    assert "bfloat16" in bench.first_difference(ref, {"params": {**ref["params"], "a": leaf((4, 8), jnp.float32)}})


@pytest.mark.parametrize("argv, message", [
    (["--variants", "none,remat:everything"], "no variant 'remat:everything'"),
    (["--variants", "none,none"], "each once"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--recipe", "flax", "--variants", "none,recompute_norm_act"], "--recipe flax does not use"),
])
def test_bad_flags_exit_before_compiling(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        bench.main([*SMALL, *argv])
    assert err.value.code == 2 and message in capsys.readouterr().err
