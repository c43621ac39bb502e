#!/usr/bin/env bash
# Build the patched and vanilla CUDA libs (sm_90) on a machine without a GPU, for the device machine to unpack
# instead of building (bench/device_cuda.sh build finds .devtree/cuda-libs.tar.xz): saves the ~6 minutes of
# device time the build takes there. Needs nvcc 13 (the device's major version), cuBLAS headers and libs in the
# toolkit (e.g. from the nvidia-cublas wheel) and a libcuda.so to link against (the toolkit's stubs, or
# CUDA_DRIVER_STUB: a stub library with soname libcuda.so.1; the device's driver is loaded at run time).
# From the repo root, after .devtree/src is emitted (bench/device_cuda.sh): bash scripts/build_cuda_libs.sh
set -euo pipefail
repo="$(pwd)"
build="${CUDA_BUILD_DIR:-/tmp/llamapack-cudabuild}"
python="${PYTHON:-$repo/.venv/bin/python}"
driver=${CUDA_DRIVER_STUB:+-DCUDA_cuda_driver_LIBRARY=$CUDA_DRIVER_STUB}
start=$(date +%s)
rm -rf "$build/build-patched"
LLAMAPACK_CUDA=1 LLAMAPACK_CUDA_ARCHS=90 LLAMAPACK_JOBS="${LLAMAPACK_JOBS:-$(nproc)}" \
    LLAMAPACK_CMAKE_ARGS="-DGGML_CUDA_FA=OFF $driver" \
    "$python" scripts/build_llama.py --sdist-dir .devtree/src --work-dir "$build" --no-install
rm -rf "$build/patched" "$build/vanilla" && mkdir -p "$build/patched" "$build/vanilla"
cp -a "$build"/build-patched/bin/lib*.so* "$build/patched/"
apply() {  # the hook's patch on the emitted tree (build_llama.git_apply); --reverse takes it off
    "$python" -c "import sys; sys.path.insert(0, 'scripts'); import build_llama as b; from pathlib import Path; \
sys.exit(0 if b.git_apply(Path('.devtree/src/vendor/llama.cpp'), Path('patches/0001-expert-provider-hook.patch'), *sys.argv[1:]) else 1)" "$@"
}
apply --reverse
trap 'apply' EXIT  # the tree stays patched
# the patch also touches ggml-backend (the scheduler's copy callback): libggml* are rebuilt too (~all of CUDA's)
cmake --build "$build/build-patched" --target llama -j "${LLAMAPACK_JOBS:-$(nproc)}" > "$build/vanilla.log" 2>&1
cp -a "$build"/build-patched/bin/lib*.so* "$build/vanilla/"
bash bench/pack_cuda_libs.sh "$build" .devtree/cuda-libs.tar.xz  # and .devtree/cuda-libs.cpuflags
echo "built in $(( $(date +%s) - start )) s: .devtree/cuda-libs.tar.xz ($(du -h .devtree/cuda-libs.tar.xz | cut -f1))"
