#!/usr/bin/env bash
# Compiles every CUDA source in csrc/cuda for sm_90a and sm_100a (objects only, nothing linked),
# so a CUDA compile error fails CI on a machine without a GPU; the CUTLASS kernels (*_sm90_*.cu)
# for sm_90a only, as CMake builds them.
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
flags=(-std=c++17 -O1 --expt-relaxed-constexpr --ftz=true -Xcompiler=-fPIC -Icsrc -isystem "$ffi_inc"
       -isystem "$inc_dir" -isystem "$nb_inc" -isystem "$py_inc" -isystem "$cutlass_inc" -Werror=all-warnings)
shopt -s nullglob
# The CUTLASS kernels first: they are the longest jobs.
sources=(csrc/cuda/*_sm90_*.cu $(ls csrc/cuda/*.cu | grep -v _sm90_) csrc/cuda/*.cc)
if [ ${#sources[@]} -eq 0 ]; then
  echo "compile_cuda: no CUDA sources"; exit 0
fi
# One nvcc per source (both architectures in one call share the host pass), two at a time (CI has 2 cores).
both="-gencode arch=compute_90a,code=sm_90a -gencode arch=compute_100a,code=sm_100a"
jobs=()
for src in "${sources[@]}"; do
  case "$src" in
    *_sm90_*) jobs+=("-gencode arch=compute_90a,code=sm_90a -c $src -o $out/$(basename "$src").o") ;;
    *.cc) jobs+=("-x cu -c $src -o $out/$(basename "$src").o") ;;
    *) jobs+=("$both -c $src -o $out/$(basename "$src").o") ;;
  esac
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} sh -c "nvcc ${flags[*]} {}" || { echo "compile_cuda: FAILED"; exit 1; }
rm -rf "$out"
echo "compile_cuda: compiled ${#sources[@]} CUDA sources for sm_90a and sm_100a"
