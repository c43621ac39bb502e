#!/usr/bin/env bash
# Does a CUDA libllama crash loading a model when numpy was imported before llama_cpp? (issue #9's open
# crash.) Usage: bash bench/numpy_import_order.sh BUILD_DIR WORK_DIR, on the GPU machine, with PYTHONPATH
# set as device_bench.sh sets it. Loads a small synthetic model with every layer on the GPU, for each
# libllama (vanilla, patched, and patched in pack mode) and each import order; on a crash, a native backtrace from cuda-gdb.
set -uo pipefail
build="$1"; work="$2"
model="$work/qwen3moe-tiny.gguf"
[ -f "$model" ] || python3 -m llamapack synth qwen3moe-tiny -o "$model" > /dev/null 2>&1
[ -f "${model%.gguf}.expert-pack" ] || python3 -m llamapack pack "$model" -q > /dev/null 2>&1
pack_load="from llamapack.llama import Llama; m = Llama('$model', pack=True, n_gpu_layers=99, n_ctx=256, verbose=False); m.eval([1, 2, 3]); print('pack mode: loaded and decoded, n_vocab', m.n_vocab()); m.close()"
load="m = llama_cpp.Llama('$model', n_gpu_layers=99, n_ctx=256, verbose=False); m.eval([1, 2, 3]); print('loaded and decoded, n_vocab', m.n_vocab())"
for lib in vanilla patched pack; do
    for first in numpy llama_cpp; do
        body="$load"
        [ "$lib" = pack ] && body="$pack_load"
        if [ "$first" = numpy ]; then code="import numpy, llama_cpp; $body"; else code="import llama_cpp, numpy; $body"; fi
        [ "$lib" = pack ] && lib_dir=patched || lib_dir=$lib
        echo "== $lib libllama, $first imported first"
        LLAMA_CPP_LIB_PATH="$build/$lib_dir" timeout 120 python3 -X faulthandler -c "$code" 2>&1 | tail -25
        rc=${PIPESTATUS[0]}
        echo "exit code $rc"
        if [ "$rc" -ne 0 ] && command -v cuda-gdb > /dev/null; then
            echo "-- native backtrace (cuda-gdb)"
            LLAMA_CPP_LIB_PATH="$build/$lib_dir" timeout 180 cuda-gdb -q -batch -ex run -ex bt -ex "info threads" \
                --args python3 -c "$code" 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited" | tail -60
        fi
    done
done
