#!/usr/bin/env bash
# On the lent GPU machine (no network), from the repo root, through the device tool:
#   run(command="bash bench/device_cuda.sh", carry=[".devtree", ".whl"])
# Prepared here first:
#   python scripts/build_llama.py --work-dir /tmp/emit --emit-tree .devtree/src   # trimmed patched tree, ~22 MB
#   mkdir -p .devtree/vocab && cp ~/.cache/llamapack/vocab/ggml-vocab-{gpt-2,llama-spm}.gguf .devtree/vocab/
#   pip download cffi, pycparser, gguf wheels for cp312 into .whl (see the device README)
# With .devtree/cuda-libs.tar.xz (scripts/build_cuda_libs.sh, built without a GPU) the build stage unpacks it
# instead (seconds, not ~6 minutes of device time). Otherwise:
# Builds the patched libs with CUDA for sm_90 through scripts/build_llama.py, then the vanilla libllama from
# the same build tree with the patch reversed (it touches ggml-backend too: libggml* are rebuilt), then compares logits.
# Stage 2 (`bash bench/device_cuda.sh compare`) reuses the build while the machine is still warm.
set -euo pipefail
repo="$(pwd)"
out="${OUT:-$repo/.devout}"
mkdir -p "$out"
stage="${1:-all}"
build="${DEVBUILD:-/tmp/llamapack-devbuild}"  # outside the repo: kept while the machine stays warm

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$repo/.devtree/src:$repo"
export LLAMAPACK_VOCAB_DIR="$repo/.devtree/vocab"
source "$repo/bench/cpuflags.sh"

machine_info() {
    { nvidia-smi -L; nproc; python3 --version; python3 -c 'import cupy; print("cupy", cupy.__version__)'; } > "$out/machine.txt" 2>&1
}
prebuilt="$repo/.devtree/cuda-libs.tar.xz"  # patched/ and vanilla/ built elsewhere (scripts/build_cuda_libs.sh)
if { [ "$stage" = all ] || [ "$stage" = build ]; } && [ -f "$prebuilt" ]; then
    machine_info
    flags="$repo/.devtree/cuda-libs.cpuflags"  # the build machine's (-march=native): refuse rather than SIGILL
    missing=$(missing_cpu_flags "$flags")
    [ -z "$missing" ] || { echo "prebuilt libs need CPU flags this machine lacks: $missing(build here:" \
        "carry .devtree/src, leave out .devtree/cuda-libs.tar.xz)" | tee -a "$out/machine.txt"; exit 1; }
    mkdir -p "$build" && tar xJf "$prebuilt" -C "$build" && ls "$build/patched" "$build/vanilla" >> "$out/machine.txt"
    echo "build seconds: 0 (prebuilt libs unpacked)" >> "$out/machine.txt"
elif [ "$stage" = all ] || [ "$stage" = build ]; then
    machine_info
    start=$(date +%s)
    rm -rf "$build/build-patched"  # a warm machine's tree ends on the vanilla build: never reuse it as patched
    LLAMAPACK_CUDA="${LLAMAPACK_CUDA:-1}" LLAMAPACK_CUDA_ARCHS=90 LLAMAPACK_JOBS="${LLAMAPACK_JOBS:-16}" \
        python3 scripts/build_llama.py --sdist-dir .devtree/src --work-dir "$build" --no-install > "$out/build.log" 2>&1
    mkdir -p "$build/patched" "$build/vanilla"
    cp -L "$build"/build-patched/bin/lib*.so* "$build/patched/"
    reverse_patch() {  # git or patch, whichever the machine has (build_llama.git_apply)
        python3 -c "import sys; sys.path.insert(0, 'scripts'); import build_llama as b; from pathlib import Path; \
sys.exit(0 if b.git_apply(Path('.devtree/src/vendor/llama.cpp'), Path('patches/0001-expert-provider-hook.patch'), *sys.argv[1:]) else 1)" "$@"
    }
    reverse_patch --reverse
    cmake --build "$build/build-patched" --target llama -j "${LLAMAPACK_JOBS:-16}" >> "$out/build.log" 2>&1
    cp -L "$build"/build-patched/bin/lib*.so* "$build/vanilla/"
    reverse_patch  # and forward again: the tree stays patched
    echo "build seconds: $(( $(date +%s) - start ))" >> "$out/machine.txt"
fi
if [ "$stage" = all ] || [ "$stage" = compare ]; then
    python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_bitexact.json" --device "${POOL_DEVICE:-0}" ${ARCHS:+--archs $ARCHS} \
        ${UBATCH:+--ubatch $UBATCH} ${NPROMPT:+--n-prompt $NPROMPT} \
        ${PROVIDER:+--provider $PROVIDER} 2>&1 | tail -40
fi
