"""A block-scaled FP8 grouped GEMM written in Pallas Mosaic GPU, timed against te_jax's CUTLASS kernel.

The question: does a kernel from a second kernel compiler (jax's own Mosaic GPU, already a dependency)
run the DeepSeek-V3 recipe's MoE forward GEMM faster than te_jax's CUTLASS pointer-array kernel?

``y[rows, N] (bf16) = x[rows, K] (E4M3, 1x128 scales) @ W[g]^T (E4M3 [N, K], 128x128 scales)`` with the rows
sorted by group and every group's span a multiple of 128 rows (the MoE layer's aligned layout). The kernel is
persistent (one CTA per SM walking the output tiles), with a memory warpgroup feeding a TMA pipeline of 128-deep
K steps and two compute warpgroups, each owning 64 rows of the 128 x ``tile_n`` tile. Every K step runs its
WGMMA into a fresh float32 accumulator and folds it into the running total with the step's row scales (x) and
column scales (W) in float32: the promotion every block-scaled kernel does. Each 128-row tile's group is looked
up in a table computed from ``group_sizes`` on the device, so nothing goes to the host.

Run on a Hopper GPU with te_jax installed (for the CUTLASS kernel and cuBLASLt's dense block GEMM):

    python3 tools/research/mgpu_block_grouped_probe.py [--shapes mixtral,deepseek] [--tile-n 128]

It prints, per shape, each variant's median time and TFLOP/s (timed in turns, ``benchmarks/timing.py``), and the
Mosaic kernel's largest difference from te_jax's output and from a float32 reference (the first 128 rows), relative
to the output's largest magnitude.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import te_jax  # noqa: F401  (registers the FFI targets)
from te_jax.ops import gemm as gemm_ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_grouped_gemm import grouped_fp8_block as cutlass_block_grouped  # noqa: E402
from timing import time_interleaved  # noqa: E402

BLOCK = 128  # the recipe's scale block along K (and along N for the weight)
WG_ROWS = 64  # rows per compute warpgroup; two of them make the 128-row tile

# (label, experts, rows, K, N): the forward GEMMs of bench_grouped_gemm.py, balanced routing.
SHAPES = {
    "mixtral": [("mixtral gate+up", 8, 32768, 4096, 28672), ("mixtral down", 8, 32768, 14336, 4096)],
    "deepseek": [("deepseek gate+up", 64, 65536, 7168, 4096), ("deepseek down", 64, 65536, 2048, 7168)],
}


def tile_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each 128-row tile of the aligned layout (spans padded to 128 rows), clamped to the last."""
    spans = (group_sizes + BLOCK - 1) // BLOCK
    ends = jnp.cumsum(spans)
    tiles = jnp.arange(rows // BLOCK, dtype=jnp.int32)
    return jnp.minimum(jnp.searchsorted(ends, tiles, side="right"), group_sizes.shape[0] - 1).astype(jnp.int32)


def block_grouped_gemm(x, x_scale_t, w, w_scale_cols, groups_of_tiles, *, tile_n: int, stages: int,
                       grid_tile_width: int, num_sms: int, scalar_weight_scale: bool, overlap: bool = False):
    """``y [M, N]`` (bf16) from ``x`` [M, K] e4m3 with its scales ``x_scale_t`` [K/128, M/64, 64] f32 (K-block
    major), ``w`` [G, N, K] e4m3 with ``w_scale_cols`` [G, K/128, N] f32 (each 128x128 block's scale repeated over
    its columns), and ``groups_of_tiles`` [M/128] int32.

    ``scalar_weight_scale`` (``tile_n`` 128: one weight block per tile and K step) folds the weight's scale into the
    row scales and promotes with one multiply-add per element; otherwise each column takes its own scale (two
    multiplies and an add per element). ``overlap`` (with ``scalar_weight_scale``) promotes each K step's partial
    product during the next step's WGMMA instead of after its own, at the cost of a third accumulator's registers.
    """
    if scalar_weight_scale and tile_n != BLOCK:
        raise ValueError(f"scalar_weight_scale needs tile_n {BLOCK}, got {tile_n}")
    if overlap and not scalar_weight_scale:
        raise ValueError("overlap needs scalar_weight_scale")
    m, k = x.shape
    _, n, _ = w.shape
    tile_m = 2 * WG_ROWS
    if m % tile_m or n % tile_n or k % BLOCK:
        raise ValueError(f"M={m}, N={n}, K={k} must be multiples of {tile_m}, {tile_n}, {BLOCK}")
    m_tiles, n_tiles, k_steps = m // tile_m, n // tile_n, k // BLOCK
    swizzle = plgpu.find_swizzle(BLOCK * 8)
    operand_transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    epi_n = 64
    out_swizzle = plgpu.find_swizzle(epi_n * 16)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 2)), plgpu.SwizzleTransform(out_swizzle))

    def body(x_gmem, xs_gmem, w_gmem, ws_gmem, groups_gmem, out_gmem):
        def make_pipeline(step, context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=stages, compute_context=context,
                in_specs=[
                    plgpu.BlockSpec((tile_m, BLOCK), lambda kk: (0, kk), transforms=operand_transforms),
                    plgpu.BlockSpec((tile_n, BLOCK), lambda kk: (0, kk), transforms=operand_transforms),
                    plgpu.BlockSpec((1, 2, WG_ROWS), lambda kk: (kk, 0, 0)),
                    plgpu.BlockSpec((1, tile_n), lambda kk: (kk, 0)),
                ])

        unused = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
        allocs = make_pipeline(unused, unused).get_allocations(
            x_gmem.at[pl.ds(0, tile_m)], w_gmem.at[0, pl.ds(0, tile_n)],
            xs_gmem.at[:, pl.ds(0, 2)], ws_gmem.at[0, :, pl.ds(0, tile_n)])

        @functools.partial(pl.run_scoped, allocs=allocs,
                           out_smem=plgpu.SMEM((2, 2, WG_ROWS, epi_n), jnp.bfloat16, transforms=out_transforms),
                           collective_axes="wg")
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
            def _tiles(info: plgpu.NDLoopInfo):
                mi, ni = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1, grid_tile_width)
                g = groups_gmem[mi]
                rows = pl.ds(mi * tile_m, tile_m)
                cols = pl.ds(ni * tile_n, tile_n)
                wg_rows = pl.ds(wg * WG_ROWS, WG_ROWS)

                def step(_, x_smem, w_smem, xs_smem, ws_smem, total):
                    def partial_product(acc):
                        plgpu.wgmma(acc, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
                        return acc[...]

                    part = pl.run_scoped(partial_product, plgpu.ACC((WG_ROWS, tile_n), jnp.float32))
                    row_scale = plgpu.load(xs_smem.at[0, wg], layout=plgpu.Layout.WGMMA.reduce(1))
                    if scalar_weight_scale:
                        row_scale = row_scale * ws_smem[0, 0]
                        return total + part * lax.broadcast_in_dim(row_scale, part.shape, [0])
                    col_scale = plgpu.load(ws_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
                    scaled = part * lax.broadcast_in_dim(row_scale, part.shape, [0])
                    return total + scaled * lax.broadcast_in_dim(col_scale, part.shape, [1])

                def overlapped_step(_, x_smem, w_smem, xs_smem, ws_smem, carry):
                    total, previous, previous_scale = carry

                    def partial_product(acc):
                        plgpu.wgmma(acc, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
                        # The previous step's promotion, issued while this step's WGMMA runs.
                        folded = total + previous * lax.broadcast_in_dim(previous_scale, previous.shape, [0])
                        return acc[...], folded

                    part, total = pl.run_scoped(partial_product, plgpu.ACC((WG_ROWS, tile_n), jnp.float32))
                    row_scale = plgpu.load(xs_smem.at[0, wg], layout=plgpu.Layout.WGMMA.reduce(1))
                    return total, part, row_scale * ws_smem[0, 0]

                def context(run):
                    zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, tile_n), jnp.float32), plgpu.Layout.WGMMA)
                    if overlap:
                        no_scale = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32),
                                                     plgpu.Layout.WGMMA.reduce(1))
                        total, last, last_scale = run((zeros, zeros, no_scale))
                        y = (total + last * lax.broadcast_in_dim(last_scale, last.shape, [0])).astype(jnp.bfloat16)
                    else:
                        y = run(zeros).astype(jnp.bfloat16)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for j in range(tile_n // epi_n):
                        slot = j % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = y[:, j * epi_n:(j + 1) * epi_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot],
                            out_gmem.at[rows, cols].at[wg_rows, pl.ds(j * epi_n, epi_n)])

                make_pipeline(overlapped_step if overlap else step, context)(
                    x_gmem.at[rows], w_gmem.at[g, cols], xs_gmem.at[:, pl.ds(mi * 2, 2)], ws_gmem.at[g, :, cols],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), grid=(num_sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(x, x_scale_t, w, w_scale_cols, groups_of_tiles)


def probe(shape, args, num_sms: int) -> None:
    label, experts, rows, k, n = shape
    sizes = jnp.full((experts,), rows // experts, jnp.int32)
    flops = 2.0 * rows * n * k
    sets = []
    for i in range(2):
        kx, kw, ks, kt = jax.random.split(jax.random.key(1000 * i + k + n), 4)
        x = jax.random.normal(kx, (rows, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        w = (jax.random.normal(kw, (experts, n, k), jnp.bfloat16) * 4).astype(jnp.float8_e4m3fn)
        x_s = jax.random.uniform(ks, (rows, k // BLOCK), jnp.float32, 0.5, 2.0)
        w_s = jax.random.uniform(kt, (experts, n // BLOCK, k // BLOCK), jnp.float32, 0.01, 0.02)
        x_scale_t = x_s.T.reshape(k // BLOCK, rows // WG_ROWS, WG_ROWS)
        w_scale_cols = jnp.repeat(jnp.swapaxes(w_s, 1, 2), BLOCK, axis=2)
        sets.append(dict(x=x, x_s=x_s, w=w, w_s=w_s, x_scale_t=x_scale_t, w_scale_cols=w_scale_cols, sizes=sizes))
    calls = {
        "te_jax CUTLASS block grouped": (jax.jit(cutlass_block_grouped),
                                         [(d["x"], d["x_s"], d["w"], d["w_s"], d["sizes"]) for d in sets]),
        "cuBLASLt block dense, same total": (
            jax.jit(lambda a, a_s, b, b_s: gemm_ops.gemm_fp8_block(a, a_s, b, b_s, b_block_2d=True,
                                                                   out_dtype=jnp.bfloat16)),
            [(d["x"], d["x_s"], d["w"][0], d["w_s"][0]) for d in sets]),
    }
    d = sets[0]  # te_jax's output, and a float32 reference for the first tile of rows (group 0)
    x_rows = d["x"][:BLOCK].astype(jnp.float32) * jnp.repeat(d["x_s"][:BLOCK], BLOCK, axis=1)
    w0 = d["w"][0].astype(jnp.float32) * jnp.repeat(jnp.repeat(d["w_s"][0], BLOCK, axis=0), BLOCK, axis=1)
    ref = jnp.dot(x_rows, w0.T, precision=lax.Precision.HIGHEST)
    theirs = cutlass_block_grouped(d["x"], d["x_s"], d["w"], d["w_s"], d["sizes"]).astype(jnp.float32)
    promotions = {"column": (False, False), "scalar": (True, False), "scalar overlapped": (True, True)}
    configs = [(t, s, g, p) for t in args.tile_n for s in args.stages for g in args.grid_tile_width
               for p in args.promotion if t == BLOCK or not promotions[p][0]]
    for tile_n, stages, width, promotion in configs:
        name = f"Mosaic GPU block grouped (128x{tile_n}, {stages} stages, snake width {width}, {promotion})"
        scalar, overlap = promotions[promotion]
        fn = jax.jit(lambda x, xs, w, ws, sz, tile_n=tile_n, stages=stages, width=width, scalar=scalar,
                     overlap=overlap: block_grouped_gemm(x, xs, w, ws, tile_groups(sz, x.shape[0]), tile_n=tile_n,
                                                         stages=stages, grid_tile_width=width, num_sms=num_sms,
                                                         scalar_weight_scale=scalar, overlap=overlap))
        try:
            ours = fn(d["x"], d["x_scale_t"], d["w"], d["w_scale_cols"], d["sizes"]).astype(jnp.float32)
        except Exception as e:  # a configuration Mosaic rejects (shared memory, registers): report, go on
            print(f"{label}: {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        diff = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
        exact = float(jnp.max(jnp.abs(ours[:BLOCK] - ref)) / jnp.max(jnp.abs(ref)))
        print(f"{label}: {name}: max |diff| / max |y|: {diff:.2e} against te_jax's kernel, {exact:.2e} against "
              f"float32 on the first {BLOCK} rows", flush=True)
        calls[name] = (fn, [(d["x"], d["x_scale_t"], d["w"], d["w_scale_cols"], d["sizes"]) for d in sets])
    per_call = time_interleaved(calls, args.warmup, args.iters, args.trials)
    for name, times in per_call.items():
        ms = 1e3 * statistics.median(times)
        print(f"{label}: {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="mixtral,deepseek")
    p.add_argument("--tile-n", type=int, nargs="+", default=[128])
    p.add_argument("--stages", type=int, nargs="+", default=[4])
    p.add_argument("--grid-tile-width", type=int, nargs="+", default=[8])
    p.add_argument("--promotion", nargs="+", default=["column", "scalar", "scalar overlapped"],
                   choices=["column", "scalar", "scalar overlapped"],
                   help="column: a scale per output column; scalar: the weight's scale folded into the row scales; "
                        "scalar overlapped: the same, each step's promotion during the next step's WGMMA")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)
    num_sms = jax.devices()[0].core_count
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {num_sms} SMs", flush=True)
    for group in args.shapes.split(","):
        for shape in SHAPES[group]:
            probe(shape, args, num_sms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
