#!/usr/bin/env bash
# Builds tools/research/cutlass_block_schedules on a GPU machine, one source per schedule side by side,
# into /tmp/cutlass_block_schedules. CUTLASS's headers come from the nvidia-cutlass wheel in .cache/cutlass
# (tools/compile_cuda.sh downloads it); jax's FFI headers from the Python in $PY (default python3).
# A schedule whose source does not compile is reported and left out.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=tools/research/cutlass_block_schedules
cutlass_inc=.cache/cutlass/cutlass_library/source/include
if [ ! -f "$cutlass_inc/cutlass/cutlass.h" ]; then
  ${PY:-python3} - <<'PYEOF'
import glob, zipfile
with zipfile.ZipFile(sorted(glob.glob(".cache/cutlass/nvidia_cutlass-*.whl"))[-1]) as z:
    z.extractall(".cache/cutlass", [n for n in z.namelist() if "source/include/" in n])
PYEOF
fi
ffi_inc=$(${PY:-python3} -c "import jax.ffi; print(jax.ffi.include_dir())")
out=/tmp/cutlass_block_schedules
rm -rf "$out" && mkdir -p "$out"
flags=(-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG -Icsrc -Icsrc/cuda
       -isystem "$cutlass_inc" -isystem "$ffi_inc")
for src in "$here"/*.cu; do
  name=$(basename "$src" .cu)
  (nvcc "${flags[@]}" -c "$src" -o "$out/$name.o" 2> "$out/$name.log" ||
     { echo "build: $name does not compile:"; grep -m2 "error" "$out/$name.log"; rm -f "$out/$name.o"; }) &
done
wait
nvcc -gencode arch=compute_90a,code=sm_90a "$out"/*.o -o "$out/probe"
echo "build: $out/probe"
