"""DeepGEMM as the anchor of te_jax's block-scaled FP8 GEMMs (issue 43), timed in turns in one process on one GPU.

DeepGEMM (github.com/deepseek-ai/DeepGEMM, MIT; DeepSeek's FP8 GEMM library) multiplies 1x128-block-scaled
activations by 128x128-block-scaled weights on Hopper. For each shape this times, in turns:

* ``deepgemm``: its dense ``fp8_gemm_nt`` (``D[M, N] = A[M, K] @ B[N, K]^T``) or its M-grouped contiguous
  ``m_grouped_fp8_gemm_nt_contiguous`` (``A`` rows sorted by group, each group a multiple of 128 rows, a per-row
  int32 group index, ``B[G, N, K]``), bfloat16 out;
* ``te_jax``: ``te_jax.ops.gemm.gemm_fp8_block(..., b_block_2d=True)`` (cuBLASLt) or
  ``te_jax.ops.grouped.gemm.grouped_gemm_fp8_block(..., b_block_2d=True)`` (CUTLASS, group sizes on the device),
  bfloat16 out, jitted.

Both get the SAME FP8 data and float32 scales (decode multipliers: ``x ~= q * s``): random normal operands
quantized by this script in JAX (1x128 blocks of A, 128x128 blocks of B), handed to torch through DLPack (numpy if
DLPack fails; the JSON says which). DeepGEMM takes A's scales MN-major with the row count padded to 16 bytes
(TMA-aligned); they are laid out so before timing, so its call does no transposition. Reported per shape and
variant: the median ms per call and TFLOP/s (``2 * M * N * K``, M the real rows), the te_jax/DeepGEMM speed ratio
(DeepGEMM's ms over te_jax's: above 1, te_jax is faster), DeepGEMM's published H800 figure where there is one, and
a cross-check: the relative L2 difference of the two outputs, and of each against a float64 product (host) of
the dequantized operands over the first rows (both are float32 sums of FP8 products promoted per 128-deep block, so
they differ only by summation order and bfloat16 rounding: 1e-2 is the bound).

Shapes: DeepGEMM's README (last published table, H800, commit 55ab91f): dense M in {64, 128, 4096} x six (N, K)
and contiguous grouped 4x8192 and 8x4096 rows at (N, K) = (4096, 7168), (7168, 2048); issue 43's MoE GEMMs:
Mixtral (E=8 top-2, K=4096, N=2x14336 and its down projection, balanced and skewed), DeepSeek (E=64 top-8,
H=7168, expert width 2048) and DeepSeek-V3 (E=256 top-8), 8192 or 16384 tokens.

Timing: every variant is warmed up, then ``--trials`` rounds each time ``--iters`` back-to-back calls of every
variant in a shuffled order (benchmarks/timing.py's ``time_interleaved``; a DeepGEMM call returns an object whose
``block_until_ready`` synchronises torch's stream). JAX does not preallocate (torch and JAX share the GPU).

DeepGEMM is built on the GPU machine, never in the checkout: ``--deepgemm DIR`` (tools/pack_deepgemm.py's
.cache/deepgemm) is copied to /tmp/te_jax_deepgemm, CUTLASS's ``cute``/``cutlass`` headers are linked into its
include folder (te_jax's .cache/cutlass, 4.2.0; DeepGEMM pins 4.2.1, identical in every header it includes), its
C++ host module is compiled with the machine's torch (``torch.utils.cpp_extension.load`` of csrc/python_api.cpp
with CUDA's include and cccl folders, fmt, the nvidia-* wheels' headers, cudart and nvrtc), and its kernels are
compiled by nvcc (sm_90a cubins, a few seconds each) at first use into ``DG_JIT_CACHE_DIR`` (default
/tmp/te_jax_deepgemm/jit): ``--jit-workers`` processes compile every shape's kernel in parallel before the timing.

Commands. Here (once): ``python3 tools/pack_deepgemm.py`` (DeepGEMM and fmt from the search tool's fetch mirrors;
about 1.6 MB). On the GPU machine (device tool ``run``, carry ``[".cache/cutlass", ".cache/deepgemm"]``):

  python3 tools/gpu_check.py --bench deepgemm --deadline 590 --estimate bench_deepgemm=420 \\
      --bench-args deepgemm="--deepgemm $PWD/.cache/deepgemm"

(add ``--wheel gpu_out/te_jax-*.whl`` and carry it to skip te_jax's build; ``--only REGEX`` narrows the shapes).
Directly, with an installed te_jax: ``python3 benchmarks/bench_deepgemm.py --deepgemm $PWD/.cache/deepgemm
--out r.json --md r.md``. On a CPU: ``--dry-run`` prints the shapes and DeepGEMM's operand layouts and checks
te_jax's side on tiny operands built as here against a float64 product (no torch, no DeepGEMM).
"""

from __future__ import annotations

import os

os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # torch and JAX share the GPU; before jax is imported

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import pathlib
import shutil
import statistics
import sys
import sysconfig
import time
import traceback
import zipfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = 128  # DeepSeek-V3's block: 1x128 of A, 128x128 of B
TMA_ALIGN_BYTES = 16  # DeepGEMM's A scales: the MN extent padded to 16 bytes
E4M3_MAX = 448.0
CHECK_BOUND = 1e-2  # relative L2 between two float32-accumulated FP8 GEMMs with bfloat16 out
REF_ROWS = 128  # rows of the float64 reference product (host)
WORK = pathlib.Path("/tmp/te_jax_deepgemm")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One GEMM: dense (``groups`` empty) ``[M, K] x [N, K]^T`` or grouped, ``groups`` the rows of each group.

    ``published`` is DeepGEMM's README figure on an H800 (TFLOP/s), where it has one.
    """

    label: str
    m: int
    n: int
    k: int
    groups: tuple[int, ...] = ()
    source: str = ""
    published: float | None = None

    @property
    def grouped(self) -> bool:
        return bool(self.groups)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


# DeepGEMM's README until 2025-04 (commit 55ab91f): (M, N, K, H800 TFLOP/s) of its normal GEMMs.
DENSE_PUBLISHED = [
    (64, 2112, 7168, 206), (64, 24576, 1536, 289), (64, 32768, 512, 219), (64, 7168, 16384, 336),
    (64, 4096, 7168, 287), (64, 7168, 2048, 295), (128, 2112, 7168, 352), (128, 24576, 1536, 535),
    (128, 32768, 512, 358), (128, 7168, 16384, 645), (128, 4096, 7168, 533), (128, 7168, 2048, 510),
    (4096, 2112, 7168, 1127), (4096, 24576, 1536, 1212), (4096, 32768, 512, 775), (4096, 7168, 16384, 1520),
    (4096, 4096, 7168, 1410), (4096, 7168, 2048, 1168),
]
# ... and of its contiguous grouped GEMMs: (groups, rows per group, N, K, H800 TFLOP/s).
GROUPED_PUBLISHED = [(4, 8192, 4096, 7168, 1346), (4, 8192, 7168, 2048, 1214), (8, 4096, 4096, 7168, 1346),
                     (8, 4096, 7168, 2048, 1214)]
# Issue 43's MoE expert GEMMs: (label, experts, top-k, tokens, K, N, skewed), as benchmarks/bench_grouped_gemm.py.
MOE = [
    ("mixtral gate+up", 8, 2, 16384, 4096, 2 * 14336, False),
    ("mixtral down", 8, 2, 16384, 14336, 4096, False),
    ("mixtral gate+up skewed", 8, 2, 16384, 4096, 2 * 14336, True),
    ("deepseek E64 gate+up", 64, 8, 8192, 7168, 2 * 2048, False),
    ("deepseek E64 down", 64, 8, 8192, 2048, 7168, False),
    ("deepseek-v3 E256 gate+up", 256, 8, 8192, 7168, 2 * 2048, False),
    ("deepseek-v3 E256 down", 256, 8, 8192, 2048, 7168, False),
]


def group_sizes(experts: int, rows: int, skewed: bool, align: int = BLOCK) -> tuple[int, ...]:
    """Balanced sizes, or one expert taking about half the rows; every size a multiple of ``align`` (DeepGEMM's
    contiguous layout needs whole blocks per group), summing to ``rows`` (a multiple of ``align``)."""
    if rows % align or (not skewed and (rows // experts) % align):
        raise ValueError(f"bench_deepgemm: {rows} rows over {experts} experts are not whole {align}-row blocks")
    if not skewed:
        return (rows // experts,) * experts
    rest = rows // 2 // (experts - 1) // align * align
    return (rows - rest * (experts - 1),) + (rest,) * (experts - 1)


def shapes() -> list[Shape]:
    """Every shape: DeepGEMM's published dense and grouped ones, then issue 43's MoE GEMMs."""
    out = [Shape(f"dense M={m} N={n} K={k}", m, n, k, source="DeepGEMM README", published=t)
           for m, n, k, t in DENSE_PUBLISHED]
    out += [Shape(f"grouped {g}x{mg} N={n} K={k}", g * mg, n, k, (mg,) * g, "DeepGEMM README", t)
            for g, mg, n, k, t in GROUPED_PUBLISHED]
    for label, experts, topk, tokens, k, n, skewed in MOE:
        sizes = group_sizes(experts, tokens * topk, skewed)
        out.append(Shape(label, sum(sizes), n, k, sizes, "issue 43"))
    return out


# ---- DeepGEMM's operand layouts (numpy: checked on a CPU) ---------------------------------------------------


def tma_aligned(n: int, element_bytes: int) -> int:
    """``n`` rounded up to a whole number of 16-byte TMA units of ``element_bytes`` elements."""
    unit = TMA_ALIGN_BYTES // element_bytes
    return -(-n // unit) * unit


def mn_major_scales(sf: np.ndarray) -> np.ndarray:
    """A's float32 scales ``[M, K/128]`` laid out as DeepGEMM's SM90 kernels read them: MN-major (M contiguous),
    each K block's column ``tma_aligned(M)`` elements apart (zero padded). Returns a strided view of that buffer."""
    m, kb = sf.shape
    pitch = tma_aligned(m, sf.dtype.itemsize)
    buf = np.zeros((kb, pitch), sf.dtype)
    buf[:, :m] = sf.T
    return buf[:, :m].T


def row_groups(sizes) -> np.ndarray:
    """DeepGEMM's contiguous ``grouped_layout``: int32, one group index per row (``sum(sizes)`` rows)."""
    sizes = np.asarray(sizes, np.int64)
    return np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)


def layout_lines(shape: Shape) -> list[str]:
    """What the run builds for ``shape``, for --dry-run."""
    m, n, k, kb = shape.m, shape.n, shape.k, shape.k // BLOCK
    nb = -(-n // BLOCK)
    g = len(shape.groups)
    a = f"A fp8 [{m}, {k}], A scales f32 [{m}, {kb}] strides (1, {tma_aligned(m, 4)})"
    if not shape.grouped:
        return [f"{a}; B fp8 [{n}, {k}], B scales f32 [{nb}, {kb}] row-major; D bf16 [{m}, {n}]",
                f"te_jax gemm_fp8_block(A, A_s [{m}, {kb}], B, B_s [{nb}, {kb}], b_block_2d=True)"]
    return [f"{a}; B fp8 [{g}, {n}, {k}], B scales f32 [{g}, {nb}, {kb}]; grouped_layout int32 [{m}] "
            f"(group sizes {min(shape.groups)}..{max(shape.groups)}, multiples of {BLOCK}); D bf16 [{m}, {n}]",
            f"te_jax grouped_gemm_fp8_block(A, A_s, B, B_s, group_sizes int32 [{g}], b_block_2d=True, align=128)"]


# ---- operands (JAX: the same code on a CPU and a GPU) --------------------------------------------------------


def quantize_rows(x):
    """1x128-block E4M3 quantization of ``x [M, K]`` (K whole blocks): codes and float32 decode scales."""
    import jax.numpy as jnp

    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    s = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), 1e-4) / E4M3_MAX
    return (xb / s[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k), s


def quantize_tiles(w):
    """128x128-block E4M3 quantization of ``w [N, K]`` (K whole blocks; a partial last row block is zero padded
    for its amax): codes ``[N, K]`` and float32 decode scales ``[ceil(N/128), K/128]``."""
    import jax.numpy as jnp

    n, k = w.shape
    nb = -(-n // BLOCK)
    wp = jnp.pad(w.astype(jnp.float32), ((0, nb * BLOCK - n), (0, 0))).reshape(nb, BLOCK, k // BLOCK, BLOCK)
    s = jnp.maximum(jnp.max(jnp.abs(wp), axis=(1, 3)), 1e-4) / E4M3_MAX
    q = (wp / s[:, None, :, None]).astype(jnp.float8_e4m3fn).reshape(nb * BLOCK, k)[:n]
    return q, s


def make_operands(shape: Shape, key) -> dict:
    """Random normal A and B of ``shape``, quantized: ``a``, ``a_s``, ``b``, ``b_s`` (B ``[G, N, K]`` grouped, one
    group at a time so that no float32 copy of all of B exists) and ``sizes`` (int32, grouped only)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(key)
    make_a = jax.jit(lambda key: quantize_rows(jax.random.normal(key, (shape.m, shape.k), jnp.float32)))
    make_b = jax.jit(lambda key: quantize_tiles(0.05 * jax.random.normal(key, (shape.n, shape.k), jnp.float32)))
    a, a_s = make_a(ka)
    ops = {"a": a, "a_s": a_s}
    if shape.grouped:
        keys = jax.random.split(kb, len(shape.groups))
        ops["b"], ops["b_s"] = jax.jit(lambda keys: jax.lax.map(make_b, keys))(keys)
        ops["sizes"] = jnp.asarray(shape.groups, jnp.int32)
    else:
        ops["b"], ops["b_s"] = make_b(kb)
    return jax.block_until_ready(ops)


def te_jax_fn(shape: Shape, autotune: bool):
    """te_jax's block-scaled GEMM of ``shape``, jitted, called as ``fn(a, a_s, b, b_s[, sizes])``."""
    import jax
    import jax.numpy as jnp
    from te_jax.ops import gemm as gemm_ops
    from te_jax.ops.grouped import gemm as grouped_ops

    if shape.grouped:
        return jax.jit(lambda a, a_s, b, b_s, sizes: grouped_ops.grouped_gemm_fp8_block(
            a, a_s, b, b_s, sizes, b_block_2d=True, align=BLOCK, out_dtype=jnp.bfloat16))
    return jax.jit(lambda a, a_s, b, b_s: gemm_ops.gemm_fp8_block(
        a, a_s, b, b_s, b_block_2d=True, out_dtype=jnp.bfloat16, autotune=autotune))


def te_jax_args(shape: Shape, ops: dict) -> tuple:
    return tuple(ops[x] for x in ("a", "a_s", "b", "b_s")) + ((ops["sizes"],) if shape.grouped else ())


def reference_rows(ops: dict, start: int, rows: int, group: int = 0) -> np.ndarray:
    """float64 product of the dequantized operands: A's rows ``[start, start + rows)`` times B's matrix ``group``
    (the only one when dense)."""
    a = np.asarray(ops["a"][start:start + rows]).astype(np.float64)
    a_s = np.asarray(ops["a_s"][start:start + rows]).astype(np.float64)
    b = np.asarray(ops["b"][group] if ops["b"].ndim == 3 else ops["b"]).astype(np.float64)
    b_s = np.asarray(ops["b_s"][group] if ops["b_s"].ndim == 3 else ops["b_s"]).astype(np.float64)
    da = a * np.repeat(a_s, BLOCK, axis=1)
    db = b * np.repeat(np.repeat(b_s, BLOCK, axis=0), BLOCK, axis=1)[:b.shape[0]]
    return da @ db.T


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def rel_l2_torch(torch, x, ref, chunk_rows: int = 4096) -> float:
    """``rel_l2`` of two CUDA tensors ``[M, N]``, summed in float64 over row chunks (no full float64 copy)."""
    num = den = 0.0
    for i in range(0, ref.shape[0], chunk_rows):
        xs, rs = x[i:i + chunk_rows].double(), ref[i:i + chunk_rows].double()
        num += float(torch.sum((xs - rs) ** 2))
        den += float(torch.sum(rs ** 2))
    return (num / max(den, 1e-60)) ** 0.5


def dry_run(args) -> int:
    """Prints the shapes and layouts; checks te_jax's side on tiny operands (CPU) against float64."""
    import jax
    from timing import selected

    for s in selected(shapes(), args.only, label=lambda shape: shape.label):
        pub = f", H800 {s.published:.0f} TFLOP/s" if s.published else ""
        print(f"{s.label}: M={s.m} N={s.n} K={s.k} groups={len(s.groups) or '-'} "
              f"{s.flops / 1e12:.2f} TFLOP ({s.source}{pub})")
        for line in layout_lines(s):
            print("    " + line)
    tiny = [Shape("tiny dense", 64, 192, 256), Shape("tiny grouped", 512, 256, 384, (128, 0, 384))]
    failures = 0
    for i, s in enumerate(tiny):
        ops = make_operands(s, jax.random.key(i))
        out = np.asarray(te_jax_fn(s, autotune=False)(*te_jax_args(s, ops))).astype(np.float64)
        spans = [(0, s.m, 0)] if not s.grouped else [
            (int(start), size, g) for g, (start, size) in enumerate(zip(np.cumsum((0,) + s.groups), s.groups)) if size]
        errs = [rel_l2(out[start:start + size], reference_rows(ops, start, size, g)) for start, size, g in spans]
        ok = max(errs) < CHECK_BOUND
        failures += not ok
        sfa = mn_major_scales(np.asarray(ops["a_s"]))
        print(f"{s.label}: te_jax vs float64 rel L2 per group {', '.join(f'{e:.2e}' for e in errs)} "
              f"({'ok' if ok else 'FAIL'}); DeepGEMM's A scales strides {sfa.strides} bytes, grouped_layout "
              f"{row_groups(s.groups or (s.m,)).shape}")
        for line in layout_lines(s):
            print("    " + line)
    print(f"dry run: {failures} failure(s)")
    return 1 if failures else 0


# ---- DeepGEMM on the GPU machine -----------------------------------------------------------------------------


def cuda_home() -> pathlib.Path:
    """The CUDA toolkit DeepGEMM compiles with: the first of $CUDA_HOME, $CUDA_PATH, the folder above ``nvcc``'s
    bin/ (links resolved) and /usr/local/cuda that has bin/nvcc and include/cuda_runtime.h (``nvcc`` on the PATH may
    be a wrapper script elsewhere)."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  pathlib.Path(nvcc).resolve().parent.parent if nvcc else None, "/usr/local/cuda"]
    for home in (pathlib.Path(c) for c in candidates if c):
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return home
    raise SystemExit(f"bench_deepgemm: no CUDA toolkit (bin/nvcc and include/) in {candidates}; DeepGEMM compiles "
                     "its kernels with nvcc: set CUDA_HOME")


def nvidia_wheel_dirs(sub: str) -> list[pathlib.Path]:
    """``sub`` folders of the nvidia-* CUDA wheels (cu13/, cublas/, cuda_nvrtc/, ...) in this Python."""
    site = pathlib.Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    return sorted(p for p in site.glob(f"*/{sub}") if p.is_dir())


def cutlass_include(args) -> pathlib.Path:
    """A CUTLASS include folder with cute/ and cutlass/: --cutlass-include, te_jax's .cache/cutlass (unpacked, or
    unzipped from its nvidia-cutlass wheel into /tmp)."""
    candidates = [pathlib.Path(args.cutlass_include)] if args.cutlass_include else [
        pathlib.Path(args.deepgemm) / "third-party" / "cutlass" / "include",
        ROOT / ".cache" / "cutlass" / "cutlass_library" / "source" / "include"]
    for inc in candidates:
        if (inc / "cute").is_dir() and (inc / "cutlass").is_dir():
            return inc
    wheels = sorted((ROOT / ".cache" / "cutlass").glob("nvidia_cutlass-*.whl"))
    if args.cutlass_include or not wheels:
        raise SystemExit(f"bench_deepgemm: no CUTLASS headers (cute/, cutlass/) in {candidates}; carry .cache/cutlass "
                         "or pass --cutlass-include")
    dest = WORK / "cutlass"
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("cutlass_library/source/include/")])
    return dest / "cutlass_library" / "source" / "include"


def find_library(name: str, home: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(folder, linker flag) of lib``name``: the CUDA toolkit's, else an nvidia-* wheel's (versioned only)."""
    dirs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib", *nvidia_wheel_dirs("lib")]
    for d in dirs:
        if (d / f"lib{name}.so").exists():
            return d, f"-l{name}"
        found = sorted(d.glob(f"lib{name}.so.*"))
        if found:
            return d, f"-l:{found[0].name}"
    raise SystemExit(f"bench_deepgemm: lib{name}.so not found in {[str(d) for d in dirs]}")


def prepare_source(args) -> pathlib.Path:
    """Copies --deepgemm to /tmp/te_jax_deepgemm/src (once per pack) and links CUTLASS's cute/ and cutlass/ into
    its include folder (as DeepGEMM's develop.sh links its submodule's)."""
    src = pathlib.Path(args.deepgemm).resolve()
    if not (src / "csrc" / "python_api.cpp").exists() or not (src / "deep_gemm" / "__init__.py").exists():
        raise SystemExit(f"bench_deepgemm: {src} is not DeepGEMM's source (tools/pack_deepgemm.py makes one)")
    if not (src / "third-party" / "fmt" / "include" / "fmt" / "format.h").exists():
        raise SystemExit(f"bench_deepgemm: {src}/third-party/fmt/include is missing (tools/pack_deepgemm.py adds it)")
    dst = WORK / "src"
    stamp = (src / "te_jax_pack.json").read_text() if (src / "te_jax_pack.json").exists() else str(src)
    if not (dst / "te_jax_pack.stamp").exists() or (dst / "te_jax_pack.stamp").read_text() != stamp:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "*.so", "__pycache__"))
        (dst / "te_jax_pack.stamp").write_text(stamp)
    inc = cutlass_include(args)
    for name in ("cute", "cutlass"):
        link = dst / "deep_gemm" / "include" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(inc / name, target_is_directory=True)
    return dst


def load_deepgemm(args, prepare: bool = True):
    """Builds (first time) and imports DeepGEMM from /tmp; returns the ``deep_gemm`` module. ``prepare``: copy the
    source there first (the compile workers load what the parent prepared)."""
    WORK.mkdir(parents=True, exist_ok=True)
    src = prepare_source(args) if prepare else WORK / "src"
    home = cuda_home()
    os.environ["CUDA_HOME"] = str(home)  # torch's cpp_extension and DeepGEMM's JIT read it
    # The host module has no CUDA sources, but cpp_extension derives nvcc arch flags all the same (from the GPU).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(WORK / "jit"))
    python_bin = pathlib.Path(sys.executable).parent
    if shutil.which("ninja") is None and (python_bin / "ninja").exists():  # cpp_extension runs ninja by name
        os.environ["PATH"] = f"{python_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    from torch.utils import cpp_extension

    includes = [home / "include", home / "include" / "cccl", src / "deep_gemm" / "include",
                src / "third-party" / "fmt" / "include",
                *nvidia_wheel_dirs("include")]  # the wheels' headers after the toolkit's (cublasLt.h, nvrtc.h)
    ldflags = []
    for lib in ("cudart", "nvrtc"):
        folder, flag = find_library(lib, home)
        ldflags += [f"-L{folder}", flag, f"-Wl,-rpath,{folder}"]
    build = WORK / "ext"
    build.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    module = cpp_extension.load(
        name="deep_gemm_C", sources=[str(src / "csrc" / "python_api.cpp")],
        extra_include_paths=[str(p) for p in includes if p.exists()],
        extra_cflags=["-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations"],
        extra_ldflags=ldflags, build_directory=str(build), with_cuda=True, verbose=False)
    if prepare:
        print(f"DeepGEMM host module ready ({time.perf_counter() - start:.0f} s; {build})", flush=True)
    sys.modules["deep_gemm._C"] = module  # deep_gemm/__init__.py imports its host module as deep_gemm._C
    sys.path.insert(0, str(src))
    import deep_gemm

    return deep_gemm


def deepgemm_buffers(torch, shape: Shape, a_s):
    """A's scales ``a_s [M, K/128]`` re-laid as DeepGEMM reads them (``mn_major_scales``, on the GPU) and the
    bfloat16 output ``[M, N]``."""
    m, kb = a_s.shape
    pitch = tma_aligned(m, 4)
    sfa = torch.zeros((kb, pitch), dtype=torch.float32, device=a_s.device)
    sfa[:, :m] = a_s.T
    sfa = sfa[:, :m].T  # [M, K/128], strides (1, pitch)
    d = torch.empty((m, shape.n), dtype=torch.bfloat16, device=a_s.device)
    return sfa, d


def deepgemm_call(dg, shape: Shape, a, sfa, b, b_s, d, groups=None):
    """A no-argument function running DeepGEMM's GEMM of ``shape`` into ``d``."""
    if shape.grouped:
        return lambda: dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, b_s), d, groups, recipe=(1, BLOCK, BLOCK))
    return lambda: dg.fp8_gemm_nt((a, sfa), (b, b_s), d, recipe=(1, BLOCK, BLOCK))


def _compile_worker(job: tuple) -> tuple[str, float, str]:
    """In a spawned process: one DeepGEMM call of a shape on uninitialised operands, so that its kernel is compiled
    into DG_JIT_CACHE_DIR (its template depends on M, N, K, the groups and the layouts, not on the data)."""
    args_dict, shape = job
    start = time.perf_counter()
    try:
        import torch

        dg = load_deepgemm(argparse.Namespace(**args_dict), prepare=False)
        dev = torch.device("cuda")
        g = len(shape.groups)
        kb, nb = shape.k // BLOCK, -(-shape.n // BLOCK)
        a = torch.empty((shape.m, shape.k), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        a_s = torch.ones((shape.m, kb), dtype=torch.float32, device=dev)
        bshape = (g, shape.n, shape.k) if g else (shape.n, shape.k)
        b = torch.zeros(bshape, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        b_s = torch.ones((g, nb, kb) if g else (nb, kb), dtype=torch.float32, device=dev)
        groups = torch.from_numpy(row_groups(shape.groups)).to(dev) if g else None
        sfa, d = deepgemm_buffers(torch, shape, a_s)
        deepgemm_call(dg, shape, a, sfa, b, b_s, d, groups)()
        torch.cuda.synchronize()
        return shape.label, time.perf_counter() - start, ""
    except (Exception, SystemExit) as err:  # noqa: BLE001  (reported by the parent, which fails that shape)
        return shape.label, time.perf_counter() - start, f"{type(err).__name__}: {str(err)[:400]}"


def precompile(args, items: list[Shape]) -> dict[str, str]:
    """Compiles every shape's DeepGEMM kernel in ``--jit-workers`` processes; returns the errors by shape (a worker
    that dies fails its shape instead of hanging the run)."""
    if args.jit_workers < 1:
        return {}
    start = time.perf_counter()
    errors = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(args.jit_workers, len(items)), mp_context=ctx) as pool:
        futures = {pool.submit(_compile_worker, (vars(args), s)): s.label for s in items}
        for future in concurrent.futures.as_completed(futures):
            try:
                label, seconds, err = future.result()
            except Exception as exc:  # noqa: BLE001  (a worker that died)
                label, seconds, err = futures[future], 0.0, f"{type(exc).__name__}: {exc}"
            print(f"  DeepGEMM kernel {label}: {seconds:.0f} s{' ' + err if err else ''}", flush=True)
            if err:
                errors[label] = err
    print(f"DeepGEMM kernels compiled ({time.perf_counter() - start:.0f} s, {args.jit_workers} workers)", flush=True)
    return errors


class TorchDone:
    """A DeepGEMM call's result: ``block_until_ready`` (which timing.py's ``time_interleaved`` calls on whatever a
    variant returns) waits for torch's CUDA work."""

    def __init__(self, torch, out):
        self.torch, self.out = torch, out

    def block_until_ready(self):
        self.torch.cuda.synchronize()
        return self


def to_torch(torch, x, paths: set):
    """A jax array as a torch CUDA tensor: DLPack, else through numpy. FP8 and bfloat16 travel as integers of
    their width and are viewed back (neither numpy nor every DLPack version has them). Returns the tensor and the
    jax array it was made from (keep it alive while the tensor is used)."""
    import jax
    import jax.numpy as jnp

    as_int = {jnp.dtype(jnp.float8_e4m3fn): (jnp.uint8, torch.float8_e4m3fn),
              jnp.dtype(jnp.bfloat16): (jnp.int16, torch.bfloat16)}.get(jnp.dtype(x.dtype))
    src = jax.lax.bitcast_convert_type(x, as_int[0]) if as_int else x
    try:
        t = torch.from_dlpack(src)
        paths.add("dlpack")
    except Exception:  # noqa: BLE001  (the numpy path is the fallback)
        t = torch.from_numpy(np.asarray(src)).to("cuda")
        paths.add("numpy")
    return (t.view(as_int[1]) if as_int else t), src


def bench_shape(shape: Shape, dg, torch, args, seed: int) -> dict:
    """Times DeepGEMM and te_jax on ``shape`` in turns and cross-checks them (module docstring)."""
    import jax
    from timing import time_interleaved

    result = {"shape": shape.label, "m": shape.m, "n": shape.n, "k": shape.k, "groups": len(shape.groups),
              "group_sizes": list(shape.groups), "source": shape.source, "published_h800_tflops": shape.published,
              "variants": {}}
    weight_bytes = shape.n * shape.k * max(len(shape.groups), 1)
    n_sets = 1 if weight_bytes > args.big_weight_gib * 2**30 else args.sets
    paths: set = set()
    te_fn = te_jax_fn(shape, args.autotune == "on")
    te_sets, dg_sets, keep = [], [], []
    for i in range(n_sets):
        ops = make_operands(shape, jax.random.key(seed * 16 + i))
        te_sets.append(te_jax_args(shape, ops))
        conv = {name: to_torch(torch, ops[name], paths) for name in ("a", "a_s", "b", "b_s")}
        keep.append((ops, conv))  # the jax buffers DLPack views alias stay alive
        a, a_s, b, b_s = (conv[name][0] for name in ("a", "a_s", "b", "b_s"))
        groups = torch.from_numpy(row_groups(shape.groups)).to(a.device) if shape.grouped else None
        sfa, d = deepgemm_buffers(torch, shape, a_s)
        dg_sets.append((deepgemm_call(dg, shape, a, sfa, b, b_s.contiguous(), d, groups), d))

    # Cross-check on set 0: the two outputs, and each against float64 over the first rows of group 0.
    rows = min(REF_ROWS, shape.groups[0] if shape.grouped else shape.m)
    ref = reference_rows(keep[0][0], 0, rows)
    outs, calls = {}, {}

    def deepgemm_first():
        call, d = dg_sets[0]
        call()
        torch.cuda.synchronize()
        return d

    def te_jax_first():
        return to_torch(torch, te_fn(*te_sets[0]), paths)[0]

    for name, first, timed in (
            ("deepgemm", deepgemm_first, (lambda call, d: TorchDone(torch, call()), dg_sets)),
            ("te_jax", te_jax_first, (te_fn, te_sets))):
        try:
            outs[name] = first()
            calls[name] = timed
        except Exception as err:  # noqa: BLE001  (report the variant, time the other)
            traceback.print_exc(limit=3)
            result["variants"][name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
    check = {"ref_rows": rows}
    for name, out in outs.items():
        check[f"{name}_vs_f64_rel_l2"] = rel_l2(out[:rows].float().cpu().numpy().astype(np.float64), ref)
    if len(outs) == 2:
        check["te_jax_vs_deepgemm_rel_l2"] = rel_l2_torch(torch, outs["te_jax"], outs["deepgemm"])
    check["ok"] = len(outs) == 2 and all(v < CHECK_BOUND for key, v in check.items() if key.endswith("rel_l2"))
    result["check"] = check
    result["transfer"] = sorted(paths)
    del outs

    per_call = time_interleaved(calls, args.warmup, args.iters, args.trials)
    for name, times in per_call.items():
        ms = 1e3 * statistics.median(times)
        result["variants"][name] = {"ms": ms, "tflops": shape.flops / (ms * 1e-3) / 1e12}
    v = result["variants"]
    if "ms" in v.get("deepgemm", {}) and "ms" in v.get("te_jax", {}):
        result["te_jax_speed_vs_deepgemm"] = v["deepgemm"]["ms"] / v["te_jax"]["ms"]
    return result


def markdown(results: list[dict], header: str) -> str:
    lines = [header, "", "| shape | M | N | K | groups | DeepGEMM ms (TFLOP/s) | te_jax ms (TFLOP/s) | "
             "te_jax / DeepGEMM speed | DeepGEMM on H800 (README) | te_jax vs DeepGEMM rel L2 | vs f64: te_jax, "
             "DeepGEMM |", "|---" * 11 + "|"]
    for r in results:
        head = f"| {r['shape']} | {r['m']} | {r['n']} | {r['k']} | {r['groups'] or '-'} | "
        if "error" in r:
            lines.append(head + f"error: {r['error'][:160]} | | | | | |")
            continue
        v, c = r["variants"], r["check"]
        cell = lambda x: (f"{v[x]['ms']:.3f} ({v[x]['tflops']:.0f})" if "ms" in v.get(x, {})  # noqa: E731
                          else f"error: {v.get(x, {}).get('error', '-')[:80]}")
        num = lambda key: f"{c[key]:.1e}" if key in c else "-"  # noqa: E731
        pub = f"{r['published_h800_tflops']:.0f}" if r["published_h800_tflops"] else "-"
        speed = f"{r['te_jax_speed_vs_deepgemm']:.2f}x" if "te_jax_speed_vs_deepgemm" in r else "-"
        lines.append(head + f"{cell('deepgemm')} | {cell('te_jax')} | {speed} | {pub} | "
                     f"{num('te_jax_vs_deepgemm_rel_l2')}{'' if c['ok'] else ' FAIL'} | "
                     f"{num('te_jax_vs_f64_rel_l2')}, {num('deepgemm_vs_f64_rel_l2')} |")
    return "\n".join(lines) + "\n"


def check_sync_hook(jax) -> None:
    """Stops unless ``jax.block_until_ready`` calls a non-JAX leaf's ``block_until_ready`` (how the DeepGEMM
    calls are waited for inside timing.py's ``time_interleaved``)."""
    seen = []

    class Probe:
        def block_until_ready(self):
            seen.append(True)
            return self

    jax.block_until_ready(Probe())
    if not seen:
        raise SystemExit(f"bench_deepgemm: jax {jax.__version__}'s block_until_ready no longer waits on other "
                         "objects; the DeepGEMM timings would not wait for the GPU")


def run(args) -> int:
    if not args.deepgemm:
        raise SystemExit("bench_deepgemm: give --deepgemm DIR (DeepGEMM's source: python3 tools/pack_deepgemm.py "
                         "writes .cache/deepgemm), or --dry-run on a machine without a GPU")
    try:
        import torch
    except ImportError:
        raise SystemExit("bench_deepgemm: torch is needed for DeepGEMM (the GPU machine's python3 has it)") from None
    import jax

    if not torch.cuda.is_available() or jax.devices()[0].platform != "gpu":
        raise SystemExit(f"bench_deepgemm: needs a GPU seen by torch and JAX (torch cuda: "
                         f"{torch.cuda.is_available()}, jax: {jax.devices()[0].platform}); --dry-run runs on a CPU")
    if torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit(f"bench_deepgemm: DeepGEMM's FP32-scale kernels are SM90's; this is "
                         f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    check_sync_hook(jax)
    from timing import selected

    items = selected(shapes(), args.only, label=lambda shape: shape.label)
    dg = load_deepgemm(args)
    align = dg.get_mk_alignment_for_contiguous_layout()
    bad = [s.label for s in items if any(g % align for g in s.groups)]
    if bad:
        raise SystemExit(f"bench_deepgemm: DeepGEMM's contiguous layout needs groups of multiples of {align} rows: "
                         f"{bad}")
    pack = pathlib.Path(args.deepgemm) / "te_jax_pack.json"
    info = json.loads(pack.read_text()) if pack.exists() else {}
    header = (f"DeepGEMM {info.get('deepgemm_commit', '?')[:12]} against te_jax on {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}, jax {jax.__version__}, CUDA_HOME {os.environ['CUDA_HOME']}; "
              f"te_jax dense autotune {args.autotune}; {args.trials} trials x {args.iters} calls, median")
    print(header, flush=True)
    compile_errors = precompile(args, items)
    results = []
    md = markdown(results, header)
    for i, s in enumerate(items):
        print(f"{s.label}: M={s.m} N={s.n} K={s.k} groups={len(s.groups) or '-'}", flush=True)
        try:
            if s.label in compile_errors:
                raise RuntimeError(f"DeepGEMM kernel compilation failed: {compile_errors[s.label]}")
            results.append(bench_shape(s, dg, torch, args, seed=i))
        except Exception as err:  # noqa: BLE001  (benchmark: report the shape and go on)
            traceback.print_exc(limit=3)
            results.append({"shape": s.label, "m": s.m, "n": s.n, "k": s.k, "groups": len(s.groups),
                            "error": f"{type(err).__name__}: {str(err)[:400]}"})
        torch.cuda.empty_cache()
        md = markdown(results, header)
        print(markdown(results[-1:], "").strip().splitlines()[-1], flush=True)
        # written after every shape, so a run stopped at its deadline still leaves what it measured
        from timing import write_results

        write_results(args.out, args.md, {"header": header, "deepgemm": info, "results": results}, md)
    print(md)
    failed = [r["shape"] for r in results if "error" in r or not r["check"]["ok"]]
    if failed:
        print(f"bench_deepgemm: failed or out of bounds: {failed}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from timing import add_repeat_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepgemm", help="DeepGEMM's source folder (tools/pack_deepgemm.py's .cache/deepgemm), absolute")
    p.add_argument("--cutlass-include", help="a CUTLASS include folder (default: te_jax's .cache/cutlass)")
    p.add_argument("--jit-workers", type=int, default=8,
                   help="processes compiling DeepGEMM's kernels before the timing (0: compile at first call)")
    p.add_argument("--only", default="", help="regex over the shape labels")
    p.add_argument("--autotune", choices=("on", "off"), default="on",
                   help="te_jax's dense block GEMM with autotune=True (as bench_gemm.py) or False")
    p.add_argument("--sets", type=int, default=2, help="operand sets alternated between calls")
    p.add_argument("--big-weight-gib", type=float, default=2.0,
                   help="one operand set for shapes whose FP8 weights exceed this many GiB")
    add_repeat_args(p, warmup=3, iters=10, trials=7)
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes and layouts; check te_jax's side on tiny operands (runs on a CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
