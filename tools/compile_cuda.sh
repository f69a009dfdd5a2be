#!/usr/bin/env bash
# Compile-checks the CUDA sources in csrc/cuda on a machine without a GPU, so that a CUDA compile
# error fails CI: every source to an object with sm_90a PTX and nothing optimized (host code at -O0,
# device code through the front end and cicc at -O0, no ptxas: ptxas was more than half of a
# source's time and reports no C++ errors), and one CUTLASS kernel source per kernel template
# (CUTLASS_CHECKED) to sm_90a PTX (cicc optimizing: at -O0 it takes three times as long). The
# CMake build on the GPU machine compiles everything, optimized, for sm_90a and sm_100a (the
# sources take the same paths on both: their only architecture tests are for sm_80 and sm_89).
# cuBLASLt headers come from the nvidia-cublas wheel, CUTLASS's from the nvidia-cutlass wheel
# (each downloaded once into .cache/, only its headers unpacked).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}

# fetch_headers DIR REQUIREMENT PART: downloads the wheel into DIR and unpacks its members whose path contains PART.
fetch_headers() {
  mkdir -p "$1"
  $PY -m pip download -q --disable-pip-version-check --no-deps -d "$1" "$2"
  $PY - "$1" "$3" <<'PYEOF'
import glob, sys, zipfile
folder, part = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(sorted(glob.glob(f"{folder}/*.whl"))[-1]) as z:
    z.extractall(folder, [n for n in z.namelist() if part in n])
PYEOF
}

inc_dir=.cache/cublas/nvidia/cu13/include
[ -f "$inc_dir/cublasLt.h" ] || fetch_headers .cache/cublas "nvidia-cublas>=13" /include/
[ -f "$inc_dir/cublasLt.h" ] || { echo "compile_cuda: could not get cublasLt.h"; exit 1; }

# The version pinned in pyproject.toml's build requirements.
cutlass_version=$(sed -n 's/.*"nvidia-cutlass==\([0-9.]*\)".*/\1/p' pyproject.toml)
cutlass_inc=.cache/cutlass/cutlass_library/source/include
[ -f "$cutlass_inc/cutlass/cutlass.h" ] || fetch_headers .cache/cutlass "nvidia-cutlass==$cutlass_version" \
  cutlass_library/source/include/
[ -f "$cutlass_inc/cutlass/cutlass.h" ] || { echo "compile_cuda: could not get the CUTLASS headers"; exit 1; }

ffi_inc=$($PY -c "import jax.ffi; print(jax.ffi.include_dir())")
nb_inc=$($PY -m nanobind --include_dir)
py_inc=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
out=$(mktemp -d)
flags=(-std=c++17 -O0 --expt-relaxed-constexpr --ftz=true -Xcompiler=-fPIC -Icsrc -isystem "$ffi_inc"
       -isystem "$inc_dir" -isystem "$nb_inc" -isystem "$py_inc" -isystem "$cutlass_inc" -Werror=all-warnings)
# One source per CUTLASS kernel template (each takes about 70 s of one core): the per-tensor one with
# split accumulation (the FP8 promotion mainloop, E5M2 x E4M3, float32 out), the block one with
# the contraction grouped (K-block-major scales) and the bfloat16 wgrad (M- and N-major operands,
# the only layout no FP8 kernel has). The other grouped_gemm_sm90_*.cu instantiate the same three
# templates with other types, schedules or layouts; the GPU build compiles them.
CUTLASS_CHECKED=(grouped_gemm_sm90_e5m2_e4m3_f32_exact.cu grouped_gemm_sm90_block_wgrad_e4m3_e4m3_f32.cu
                 grouped_gemm_sm90_bf16_wgrad.cu)
shopt -s nullglob
for name in "${CUTLASS_CHECKED[@]}"; do
  [ -f "csrc/cuda/$name" ] || { echo "compile_cuda: CUTLASS_CHECKED names csrc/cuda/$name, which is gone"; exit 1; }
done
sources=($(ls csrc/cuda/*.cu | grep -v _sm90_) csrc/cuda/*.cc)
if [ ${#sources[@]} -eq 0 ]; then
  echo "compile_cuda: no CUDA sources"; exit 0
fi
ptx90="-gencode arch=compute_90a,code=compute_90a"
jobs=()
# The CUTLASS kernels first: they are the longest jobs.
for name in "${CUTLASS_CHECKED[@]}"; do
  jobs+=("$ptx90 -c csrc/cuda/$name -o $out/$name.o")
done
for src in "${sources[@]}"; do
  case "$src" in
    *.cc) jobs+=("-x cu -c $src -o $out/$(basename "$src").o") ;;
    *) jobs+=("$ptx90 -Xcicc -O0 -c $src -o $out/$(basename "$src").o") ;;
  esac
done
# One nvcc per source, two at a time (CI has 2 cores).
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "nvcc ${flags[*]} {}" || { echo "compile_cuda: FAILED"; exit 1; }
rm -rf "$out"
echo "compile_cuda: compiled ${#sources[@]} CUDA sources and ${#CUTLASS_CHECKED[@]} CUTLASS kernel sources to sm_90a PTX"
