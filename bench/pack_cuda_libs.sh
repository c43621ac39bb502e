#!/usr/bin/env bash
# Pack a build's patched/ and vanilla/ CUDA libs for bench/device_cuda.sh to unpack instead of building:
#   bash bench/pack_cuda_libs.sh BUILD_DIR ARCHIVE     # e.g. /tmp/llamapack-devbuild .devtree/cuda-libs.tar.xz
# writes ARCHIVE and, beside it, ARCHIVE's name with .tar.xz replaced by .cpuflags (this CPU's SIMD flags: ggml's
# CPU backend is built with -march=native, so the machine that unpacks it checks it has them). SPLIT_MIB=N also
# cuts ARCHIVE into ARCHIVE.part00, .part01, ... of N MiB each (the device tool returns files of 16 MiB at most;
# `cat ARCHIVE.part* > ARCHIVE` joins them).
set -euo pipefail
build="$1"; archive="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dedupe() {  # identical files of a folder (cp -L copies of one lib under several names) become hard links of one
    local seen=() f g
    for f in "$1"/lib*; do
        [ -L "$f" ] && continue
        for g in "${seen[@]}"; do cmp -s "$f" "$g" && { ln -f "$g" "$f"; continue 2; }; done
        seen+=("$f")
    done
}
dedupe "$build/patched"; dedupe "$build/vanilla"
# the two libggml-cuda (54 MB each, nearly the same) first and next to each other: xz -9's 64 MiB window keeps
# one (~28 MB in all; a device call carries at most 64 MiB); one tar call, so other names of a file are links
cuda=$(basename "$(readlink -f "$build/patched/libggml-cuda.so")")
others=$(cd "$build" && find patched vanilla -mindepth 1 ! -type d ! -path "patched/$cuda" ! -path "vanilla/$cuda" \
    | LC_ALL=C sort)
# shellcheck disable=SC2086  # others: one path a word (lib names have no spaces)
tar cf "$build/libs.tar" -C "$build" "patched/$cuda" "vanilla/$cuda" $others
xz -9 -T1 -c "$build/libs.tar" > "$archive.part"  # renamed when whole: a device call may carry it
source "$here/cpuflags.sh" && cpu_flags > "${archive%.tar.xz}.cpuflags"
mv "$archive.part" "$archive"
[ -z "${SPLIT_MIB:-}" ] || split -b "${SPLIT_MIB}m" -d "$archive" "$archive.part"
