#!/usr/bin/env bash
# Build upstream llama.cpp b11549 (the `-cmoe --moe-cache-mib` baseline, ../shared/baselines/README.md) on the
# lent GPU machine, outside the repo, from the repo root:
#   bash bench/upstream_build.sh                    # CUDA sm_90, Release, the replay patch applied
#   bash bench/upstream_build.sh > /dev/null &      # in the background, beside bench/device_cuda.sh build
# The tarball travels as .devtree/upstream/llama.cpp-b11549-trimmed.tar.gz (carry .devtree); it is never part of
# the project. Environment (all optional):
#   UPSTREAM_DIR      where to unpack and build (default /tmp/upstream: kept while the machine stays warm, so a
#                     second call only rebuilds what changed); binaries in $UPSTREAM_DIR/build/bin
#   UPSTREAM_TARBALL  default .devtree/upstream/llama.cpp-b11549-trimmed.tar.gz
#   UPSTREAM_REPLAY   1 (default): apply bench/upstream/replay.patch (routing replay, inert unless
#                     LLAMA_REPLAY_TRACE is set); 0: the tree as shipped
#   UPSTREAM_CUDA     1 (default); 0: a CPU-only build (e.g. to compile-check the patch on a machine without a GPU)
#   UPSTREAM_JOBS     parallel jobs (default 16)
#   UPSTREAM_TARGETS  default "llama-batched-bench" (the bench runs it alone)
#   UPSTREAM_LOG      the build log (default $OUT/upstream_build.log, else $UPSTREAM_DIR/build.log)
#   UPSTREAM_PREBUILT binaries built elsewhere (default .devtree/upstream-bin.tar.xz): unpacked instead of a build
#                     when they were built from this tarball and patch for the targets asked, on a CPU whose
#                     SIMD flags this one has (else a build, saying why); UPSTREAM_PREBUILT=none: always build
#   UPSTREAM_PACK     1: after the build, write the binaries to $UPSTREAM_PREBUILT (on a machine without a GPU:
#                     CUDA_DRIVER_STUB=path/libcuda.so to link against; ~40 min on 2 cores, saves ~6 device minutes)
# Options chosen for build time, none of which changes a kernel the decode or prefill path runs:
#   only the targets named (not the README's llama-server; not tests/examples);
#   -DGGML_CUDA_FA=OFF: the ~80 FlashAttention template instances compile to stubs (our own libllama is built the
#     same way, and the runs use -fa off, as llama-cpp-python does: attention takes the same non-FA kernels);
#   -DGGML_CUDA_FA_QUANTS=f16-f16: fewer of those (stub) vector-FA instances;
#   -DCMAKE_CUDA_ARCHITECTURES=90-real: SASS for sm_90 only, no PTX copy;
#   -DGGML_CUDA_COMPRESSION_MODE=none: no fatbin compression pass (bigger binary, same code);
#   -DGGML_CUDA_NCCL=OFF: one GPU; -DBUILD_SHARED_LIBS=OFF: one static binary per tool, so a single C++ runtime
#     (the device image's compiler lacks the libstdc++.so link: scripts/build_llama.py shared_cxx_runtime_args).
# Exit 0 and "upstream build ok: DIR/build/bin (N s)" on success; else non-zero with the first error lines.
set -uo pipefail
repo="$(pwd)"
root="${UPSTREAM_DIR:-/tmp/upstream}"
tarball="${UPSTREAM_TARBALL:-$repo/.devtree/upstream/llama.cpp-b11549-trimmed.tar.gz}"
patchfile="$repo/bench/upstream/replay.patch"
replay="${UPSTREAM_REPLAY:-1}"
cuda="${UPSTREAM_CUDA:-1}"
jobs="${UPSTREAM_JOBS:-16}"
targets="${UPSTREAM_TARGETS:-llama-batched-bench}"
mkdir -p "$root"
if [ -n "${UPSTREAM_LOG:-}" ]; then log="$UPSTREAM_LOG"; elif [ -n "${OUT:-}" ]; then log="$OUT/upstream_build.log"; else log="$root/build.log"; fi
src="$root/mainline-lcpp"
build="$root/build"
start=$(date +%s)
: > "$log"

fail() {  # the reason, then the first compiler errors of the log
    echo "upstream build FAILED: $1 (log: $log)" >&2
    grep -m 15 -n -E "error|Error|FAILED" "$log" >&2 || tail -20 "$log" >&2
    exit 1
}

[ -f "$tarball" ] || fail "no tarball at $tarball (copy ../shared/baselines/llama.cpp-b11549-trimmed.tar.gz there, carry .devtree)"
# unpack again only when the tarball, the patch or the replay choice changed (a warm machine keeps the build)
stamp="$(cksum < "$tarball") replay=$replay $( [ "$replay" = 1 ] && cksum < "$patchfile")"
prebuilt="${UPSTREAM_PREBUILT:-$repo/.devtree/upstream-bin.tar.xz}"
source "$repo/bench/cpuflags.sh"
if [ "$cuda" = 1 ] && [ -z "${UPSTREAM_PACK:-}" ] && [ -f "$prebuilt" ]; then
    # the archive holds the binaries, STAMP (tree, patch, targets) and CPUFLAGS (the build machine's)
    rm -rf "$root/prebuilt" && mkdir -p "$root/prebuilt" && tar xJf "$prebuilt" -C "$root/prebuilt" >> "$log" 2>&1
    missing=$(missing_cpu_flags "$root/prebuilt/CPUFLAGS")
    if [ "$(cat "$root/prebuilt/STAMP" 2>/dev/null)" != "$stamp targets=$targets" ]; then
        echo "prebuilt $prebuilt: built from another tree, patch or targets; building" | tee -a "$log"
    elif [ -n "$missing" ]; then
        echo "prebuilt $prebuilt: built for CPU flags this machine lacks ($missing); building" | tee -a "$log"
    else
        mkdir -p "$build/bin" && for t in $targets; do cp "$root/prebuilt/$t" "$build/bin/$t"; done
        echo "upstream build ok: $build/bin (prebuilt $prebuilt, $(( $(date +%s) - start )) s; $targets)" | tee -a "$log"
        exit 0
    fi
fi
if [ ! -f "$root/stamp" ] || [ "$(cat "$root/stamp")" != "$stamp" ]; then
    rm -rf "$src" "$root/stamp"
    tar xzf "$tarball" -C "$root" >> "$log" 2>&1 || fail "cannot unpack $tarball"
    if [ "$replay" = 1 ]; then
        if command -v patch > /dev/null; then
            (cd "$src" && patch -p1 -s -f -i "$patchfile") >> "$log" 2>&1 || fail "replay.patch does not apply"
        else
            (cd "$src" && GIT_CEILING_DIRECTORIES="$root" git apply "$patchfile") >> "$log" 2>&1 \
                || fail "replay.patch does not apply"
        fi
    fi
    echo "$stamp" > "$root/stamp"
fi

generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_NUMBER=11549 -DLLAMA_BUILD_COMMIT=xllamacpp-2026.10.11549)
if [ "$cuda" = 1 ]; then
    [ -z "${CUDA_DRIVER_STUB:-}" ] || args+=(-DCUDA_cuda_driver_LIBRARY="$CUDA_DRIVER_STUB")
    args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_FA_QUANTS=f16-f16
           -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_CUDA_NCCL=OFF)
fi
echo "cmake -S $src -B $build ${generator[*]} ${args[*]}" >> "$log"
cmake -S "$src" -B "$build" "${generator[@]}" "${args[@]}" >> "$log" 2>&1 || fail "cmake configure"
# shellcheck disable=SC2086  # targets is a list
cmake --build "$build" -j "$jobs" --target $targets >> "$log" 2>&1 || fail "build of $targets"
for t in $targets; do
    [ -x "$build/bin/$t" ] || fail "no $build/bin/$t after the build"
done
if [ -n "${UPSTREAM_PACK:-}" ]; then  # written as .part, renamed when whole: a device call may carry it
    echo "$stamp targets=$targets" > "$build/bin/STAMP" && cpu_flags > "$build/bin/CPUFLAGS"
    # shellcheck disable=SC2086
    tar cf - -C "$build/bin" STAMP CPUFLAGS $targets | xz -9 -T1 > "$prebuilt.part" && mv "$prebuilt.part" "$prebuilt" \
        || fail "cannot write $prebuilt"
fi
echo "upstream build ok: $build/bin ($(( $(date +%s) - start )) s; $targets)" | tee -a "$log"
