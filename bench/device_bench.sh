#!/usr/bin/env bash
# The GPU benchmark (issue #6) and the streaming provider's CUDA bit-exactness (issue #4) on the lent GPU
# machine, through the device tool, from the repo root (prepare .devtree and .whl as bench/device_cuda.sh says;
# .devtree/vocab also needs ggml-vocab-qwen2.gguf):
#   run(command="bash bench/device_bench.sh prepare", carry=[".devtree", ".whl"])  # build, bit-exact, model, pack
#   run(command="bash bench/device_bench.sh bench", carry=[".devtree", ".whl"])    # the side-by-side runs
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh prefetch", ...)   # #9: build, bit-exact, model
#   then bench with PREFETCH=1 (adds the +prefetch runs); TEMPERATURE=1 samples instead of greedy decoding;
#   PREFETCH_DEPTHS=4,8 and READ_SPLITS=4 add +prefetch-dD and +splitN runs
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round3", ...)  # #9 third round: see below
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round4", ...)  # #9 fourth round: see below
#   bench also takes PREFETCH_IN_FLIGHT=1 (+prefetch-cN runs), RAM_FRACTIONS=0.25 (+ramR% under the limit) and
#   READ_ENGINES=1 (+native and +pyreads twins of the limited pack runs), ROUNDS=N (each run but the reference
#   N times) and SHUFFLE_SEED=S (each round in a seeded shuffled order); CONFIGS may combine options freely
#   (e.g. pack-25%+ram25%+prefetch-top2@8G: llamapack/bench/configs.py, NAME_GRAMMAR)
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round5", ...)  # #9 fifth round: see below
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round6", ...)  # #9 sixth round: see below
#   run(command="MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round7", ...)  # #9 seventh round: see below
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh replay", ...)  # #22: see below;
#   then bench with ROUTING=<trace.npz> (the llamapack runs replay it) and UPSTREAM=1 (upstream b11549 runs;
#   UPSTREAM_RUNS=name,... picks some of them)
#   bench also takes PROMPT_LENGTHS (default 512,32: the measured requests, in order), WARMUP_TOKENS (the thrown-away
#   prompt every run evaluates first, as upstream's batched-bench: default 16, 0: none) and, for CONFIGS with +warm
#   (a start from a priming session's popularity; #23), WARM_ROUTING=<trace.npz> (the priming requests' trace:
#   default the ROUTING trace's requests no measured prompt replays; the Qwen3-30B trace's two are both replayed,
#   so give bench/results/q30b_routing_model_seed1_prime.trace.npz), WARM_REQUESTS, WARM_PROMPT_TOKENS,
#   WARM_TOKENS (priming requests, prompt and decode tokens each: 2, 32, 100) and WARM_CAP_S (a priming request's
#   decode time cap; default DECODE_CAP_S). +pyhot runs a config with every step through the Python provider
#   (the native hot path off: #24's before/after in one run). Under MEMORY_LIMIT_MIB the priming process runs
#   in the same cgroup limit, the page cache dropped before it and before the measured process.
#   run(command="export OUT; MODEL_NAME=q30b-skew0 TAG=q30b bash bench/device_bench.sh plan", ...)  # #26: the
#   plan's predictions for every llamapack run of $OUT/bench-TAG/bench.json against what it measured, with the
#   plan's probes measured on this machine (REPROBE=1: again) -> plan_vs_measured.md/.json beside bench.json;
#   PLAN=1 with bench does the same right after the bench (PLAN_COSTS=<file.json>: other plan.model.Costs)
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh hybrid", ...)  # #25: the replay
#   stage's builds and model with hybrid's CUDA exactness endpoints (cuda_hybrid.md); then bench with +hybrid configs
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh lookup", ...)  # #24: the same builds
#   and model, CUDA bit-exactness with the slot lookup; then bench with +oppath twins (the CPU remap op)
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh whole-pool", ...)  # #24: whole-pool
#   graphs' CUDA bit-exactness, hybrid's endpoints, the model; then bench with +nowhole twins (round 13's README)
#   run(command="export OUT; bash bench/device_bench.sh windows-check", ...)  # layer windows' and load-ahead's
#   CUDA bit-exactness (tiny archs, no model)
#   run(command="export OUT; MODEL_NAME=q30b-skew0 CONFIGS=... UPSTREAM_RUNS=... bash bench/device_bench.sh peer", ...)
#   # the builds (prebuilt where carried), the model, then bench beside upstream's runs (gpu_round16_README.md)
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round19", ...)  # API 14's windows and
#   the warm-up prompt against upstream (see the stage; ~8 minutes with the prebuilt libs)
#   run(command="export OUT; MODEL_NAME=q30b-skew0 bash bench/device_bench.sh round15", ...)  # both builds, ours
#   packed into $OUT for a later cold machine (bench/pack_cuda_libs.sh; UPSTREAM_PACK=1: upstream's), whole-pool and load-ahead CUDA
#   bit-exactness, the model; then bench with UPSTREAM=1 and +ahead configs (gpu_round15_README.md)
# Stages reuse what earlier stages left in $WORK while the machine stays warm.
set -uo pipefail
repo="$(pwd)"
out="${OUT:-$repo/.devout}"
mkdir -p "$out"
work="${WORK:-/root/llamapack-bench}"
build="${DEVBUILD:-/tmp/llamapack-devbuild}"
mkdir -p "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$repo/.devtree/src:$repo" LLAMAPACK_VOCAB_DIR="$repo/.devtree/vocab" PYTHONUNBUFFERED=1
lp() { python3 -m llamapack "$@"; }
if [ -f "$repo/.devtree/cuda-libs.tar.xz" ]; then  # libs built elsewhere (scripts/build_cuda_libs.sh): find CUDA's own
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
        ldconfig -p 2>/dev/null | grep -q "$lib" && continue
        found=$(find /usr/local /usr/lib /opt -name "$lib" 2>/dev/null | head -1)
        [ -z "$found" ] || export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
fi
model="$work/${MODEL_NAME:-q30b-skew1}.gguf"

# the model (router skew $1) and its pack, written in the background; wait_for_model waits and shows the log
start_model() {
    if [ -f "$model" ] && grep -qs "synth+pack rc 0" "$out/synth.log"; then synth=; return; fi  # an earlier stage's
    (lp synth qwen3moe-30b-a3b -o "$model" --router-skew "$1" > "$out/synth.log" 2>&1 \
        && lp pack "$model" -q >> "$out/synth.log" 2>&1; echo "synth+pack rc $?" >> "$out/synth.log") &
    synth=$!
}
wait_for_model() { [ -z "$synth" ] || wait "$synth"; tail -3 "$out/synth.log"; }
build_cuda() {  # a failed build ends the stage (nothing after it could run)
    LLAMAPACK_CMAKE_ARGS="-DGGML_CUDA_FA=OFF" bash bench/device_cuda.sh build || { grep -m5 error "$out/build.log"; exit 1; }
    tail -3 "$out/machine.txt"
}
# CUDA bit-exactness of the streaming provider, GGUF-direct and pack, n_ubatch 1 and 512: bitexact OUT.json [ARGS]
bitexact() {
    local json="$1"; shift
    python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/$json" --provider streaming --sources gguf pack --ubatch 1 512 "$@" 2>&1 | tail -2
}

# the plan's predictions for each llamapack run of DIR/bench.json against its measurements, the plan's probes
# measured here (cached per machine; REPROBE=1 measures again) -> DIR/plan_vs_measured.md and .json
plan_vs_measured() {
    [ -f "$1/bench.json" ] || { echo "plan: no $1/bench.json (run bench with the same TAG first)"; return 1; }
    python3 bench/plan_vs_measured.py "$1/bench.json" --model "$model" --out "$1" ${REPROBE:+--reprobe} \
        ${PLAN_COSTS:+--costs $PLAN_COSTS} 2>&1
}

case "${1:-prepare}" in
prepare)
    { df -h "$work" /tmp; free -g; nproc; } > "$out/disk.txt" 2>&1
    start_model "${SKEW:-1.0}"
    build_cuda
    bitexact cuda_bitexact_streaming.json
    bitexact cuda_bitexact_ramtier.json --archs qwen3moe-tiny gpt-oss-tiny --ram-cache-mib 24
    wait_for_model
    ls -la "$work"; df -h "$work"
    ;;
prefetch)  # issue #9: build, CUDA bit-exact with router lookahead, and the model (SKEW, default 0) with its pack
    start_model "${SKEW:-0}"
    build_cuda
    [ -n "${SKIP_BITEXACT:-}" ] || bitexact cuda_bitexact_prefetch.json --prefetch
    wait_for_model
    ;;
recheck)  # build, then CUDA bit-exactness of the streaming provider with and without lookahead, and the
         # provider's per-layer cost on this machine's CPU (bench/provider_overhead.py)
    build_cuda
    bitexact cuda_bitexact_streaming.json
    bitexact cuda_bitexact_prefetch.json --prefetch
    LLAMA_CPP_LIB_PATH="$build/patched" python3 bench/provider_overhead.py --prefetch -n 600 \
        --out "$out/provider_overhead.json" 2>&1 | tail -2
    ;;
round3)  # #9, third round: build, CUDA bit-exact at lookahead depth DEPTH (default 4), the numpy-import-order
        # crash, then (once the model and pack are written) the disk by read size and reads in flight
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_prefetch_depth.json --prefetch-depth "${DEPTH:-4}"
    bash bench/numpy_import_order.sh "$build" "$work" > "$out/numpy_import_order.txt" 2>&1
    tail -12 "$out/numpy_import_order.txt"
    wait_for_model
    python3 bench/disk_queue_depth.py "${model%.gguf}.expert-pack" --out "$out/disk_queue_depth.json" 2>&1
    ;;
round4)  # #9, fourth round: build, CUDA bit-exact with pack reads on the native read pool, without and with
        # lookahead (one lookahead piece in flight), then the model and its pack
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_native_reads.json
    bitexact cuda_bitexact_native_prefetch.json --prefetch --prefetch-in-flight 1
    wait_for_model
    ;;
round5)  # #9, fifth round: build, CUDA bit-exact with a RAM tier and lookahead at once, then the model and pack
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_ramtier_prefetch.json --ram-cache-mib 24 --prefetch
    wait_for_model
    ;;
round6)  # #9, sixth round: build, CUDA bit-exact of the tier's lookahead buffer swap (a small tier, so lookahead
        # reads often become RAM blocks), one lookahead layer and two with one piece in flight, then model and pack
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_ramtier_swap.json --ram-cache-mib 24 --prefetch
    bitexact cuda_bitexact_ramtier_swap_depth2.json --ram-cache-mib 24 --prefetch --prefetch-depth 2 --prefetch-in-flight 1
    wait_for_model
    ;;
round7)  # #9, seventh round: build, CUDA bit-exact with the RAM tier preloaded at start-up (13 MiB: part of the
        # experts of qwen3moe and mixtral, so their decode streams through the tier; all of the others'), model
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_ramtier_preload.json --ram-cache-mib 13 --ram-preload
    wait_for_model
    ;;
replay)  # #22: build (patched + vanilla CUDA, then upstream llama.cpp b11549 from .devtree/upstream, unless
        # SKIP_UPSTREAM=1), the Qwen3-30B-A3B-shaped model and the granite-shaped one (F16 experts, the real trace's
        # shape) with packs
    start_model "${SKEW:-0}"
    (lp synth granite-1b-a400m-shape -o "$work/granite.gguf" > "$out/granite.log" 2>&1 \
        && lp pack "$work/granite.gguf" -q >> "$out/granite.log" 2>&1; echo "granite rc $?" >> "$out/granite.log") &
    [ -n "${SKIP_UPSTREAM:-}" ] || (UPSTREAM_JOBS=${UPSTREAM_JOBS:-8} bash bench/upstream_build.sh \
        > "$out/upstream_build.out" 2>&1; echo "upstream rc $?" >> "$out/upstream_build.out") &
    build_cuda
    [ -n "${SKIP_BITEXACT:-}" ] || bitexact cuda_bitexact_policy.json --archs qwen3moe-tiny deepseek2-tiny mixtral-tiny
    # #24: the native hot path's RAM-tier copies (cuMemcpyHtoDAsync on the provider's stream)
    [ -n "${SKIP_BITEXACT:-}" ] || bitexact cuda_bitexact_hotpath_ramtier.json --archs qwen3moe-tiny gpt-oss-tiny mixtral-tiny --ram-cache-mib 24
    wait; tail -2 "$out/granite.log"; tail -3 "$out/synth.log"; [ -n "${SKIP_UPSTREAM:-}" ] || tail -3 "$out/upstream_build.out"
    ;;
hybrid)  # #25: build (patched + vanilla CUDA, and upstream b11549 unless SKIP_UPSTREAM=1), hybrid's exactness
        # endpoints against vanilla all-GPU and --cpu-moe (bench/cuda_hybrid.py), the Qwen3-30B-shaped model and pack
    start_model "${SKEW:-0}"
    [ -n "${SKIP_UPSTREAM:-}" ] || (UPSTREAM_JOBS=${UPSTREAM_JOBS:-8} bash bench/upstream_build.sh \
        > "$out/upstream_build.out" 2>&1; echo "upstream rc $?" >> "$out/upstream_build.out") &
    build_cuda
    python3 bench/cuda_hybrid.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_hybrid.json" ${HYBRID_THREADS:+--threads $HYBRID_THREADS} 2>&1 | tail -3
    wait; tail -3 "$out/synth.log"; [ -n "${SKIP_UPSTREAM:-}" ] || tail -3 "$out/upstream_build.out"
    ;;
lookup)  # #24: build (patched + vanilla CUDA, and upstream b11549 unless SKIP_UPSTREAM=1), CUDA bit-exactness with
        # the slot lookup (n_ubatch 1, 7 and 512; without and with a RAM tier), hybrid's endpoints, the Qwen3-30B model
    start_model "${SKEW:-0}"
    [ -n "${SKIP_UPSTREAM:-}" ] || (UPSTREAM_JOBS=${UPSTREAM_JOBS:-8} bash bench/upstream_build.sh \
        > "$out/upstream_build.out" 2>&1; echo "upstream rc $?" >> "$out/upstream_build.out") &
    build_cuda
    bitexact cuda_bitexact_lookup.json --ubatch 1 7 512 --archs qwen3moe-tiny deepseek2-tiny mixtral-tiny gpt-oss-tiny
    bitexact cuda_bitexact_lookup_ramtier.json --ubatch 1 7 512 --archs qwen3moe-tiny gpt-oss-tiny --ram-cache-mib 24
    python3 bench/cuda_hybrid.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_hybrid_lookup.json" 2>&1 | tail -3
    wait; tail -3 "$out/synth.log"; [ -n "${SKIP_UPSTREAM:-}" ] || tail -3 "$out/upstream_build.out"
    ;;
lookup-check)  # the lookup stage's builds (ours only) and CUDA bit-exactness, no model, no upstream, no hybrid
    build_cuda
    bitexact cuda_bitexact_lookup.json --ubatch 1 7 512 --archs qwen3moe-tiny deepseek2-tiny mixtral-tiny gpt-oss-tiny
    bitexact cuda_bitexact_lookup_ramtier.json --ubatch 1 7 512 --archs qwen3moe-tiny gpt-oss-tiny --ram-cache-mib 24
    # multi-token ubatches on a pool of every layer's experts: MMQ sees the slot count, not the expert count
    bitexact cuda_bitexact_big_pool.json --ubatch 16 32 512 --archs qwen3moe-tiny deepseek2-tiny mixtral-tiny gpt-oss-tiny \
        --pool-layers 99
    ;;
whole-pool)  # #24: our builds, CUDA bit-exactness with whole-pool graphs (a pool of every layer's experts, filled at
            # start: n_ubatch 1, 7, 512) and with a pool of two layers' (never whole: the lookup and the op),
            # hybrid's endpoints, then the Qwen3-30B model; the bench with +nowhole twins is the next call
    start_model "${SKEW:-0}"
    build_cuda
    bitexact cuda_bitexact_whole_pool.json --ubatch 1 7 512 --archs qwen3moe-tiny deepseek2-tiny mixtral-tiny gpt-oss-tiny \
        --pool-layers 99 --whole-pool
    bitexact cuda_bitexact_two_layer_pool.json --ubatch 1 --archs qwen3moe-tiny gpt-oss-tiny --pool-layers 2
    [ "${HYBRID:-1}" = 0 ] || python3 bench/cuda_hybrid.py --vanilla-lib "$build/vanilla" \
        --patched-lib "$build/patched" --out "$out/cuda_hybrid.json" 2>&1 | tail -3   # HYBRID=0: skipped
    wait_for_model
    ;;
whole-pool-check)  # the whole-pool stage's CUDA bit-exactness alone (no model), each case logged as it ends
    build_cuda
    python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_bitexact_whole_pool.json" --provider streaming --sources gguf pack --ubatch 1 7 512 \
        --archs qwen3moe-tiny gpt-oss-tiny deepseek2-tiny mixtral-tiny --pool-layers 99 --whole-pool \
        > "$out/cuda_bitexact_whole_pool.log" 2>&1
    tail -3 "$out/cuda_bitexact_whole_pool.log"
    ;;
windows-check)  # layer windows' and load-ahead's CUDA bit-exactness (a RAM tier that holds every expert, filled at
               # start; a pool of 3 layers' experts; n_ubatch 7 and 512); each case logged as it ends. MODEL=1: the
               # model written meanwhile (a later stage in the same call finds it); ARCHS: the tiny archs to check;
               # SKIP_LOAD_AHEAD=1: the windows' check only; BX_ROUNDS=2: each request twice (the second prompt's
               # windows copy the experts the pool holds from their slots)
    [ -z "${MODEL:-}" ] || start_model "${SKEW:-0}"
    build_cuda
    python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_bitexact_windows.json" --provider streaming --sources pack --ubatch 7 512 \
        --archs ${ARCHS:-qwen3moe-tiny mixtral-tiny gpt-oss-tiny deepseek2-tiny} --ram-cache-mib 256 --ram-preload \
        --layer-windows 2 --pool-layers 3 ${BX_ROUNDS:+--rounds $BX_ROUNDS} > "$out/cuda_bitexact_windows.log" 2>&1
    tail -2 "$out/cuda_bitexact_windows.log"
    [ -n "${SKIP_LOAD_AHEAD:-}" ] || python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_bitexact_load_ahead.json" --provider streaming --sources pack --ubatch 7 512 \
        --archs ${ARCHS:-qwen3moe-tiny mixtral-tiny gpt-oss-tiny deepseek2-tiny} --ram-cache-mib 256 --load-ahead 2 \
        > "$out/cuda_bitexact_load_ahead.log" 2>&1
    [ -n "${SKIP_LOAD_AHEAD:-}" ] || tail -2 "$out/cuda_bitexact_load_ahead.log"
    [ -z "${MODEL:-}" ] || wait_for_model
    ;;
round15)  # #24 and load-ahead: our builds (or the prebuilt .devtree/cuda-libs.tar.xz) and upstream b11549's side by
         # side, whole-pool graphs' CUDA bit-exactness (leaf views), load-ahead's (a RAM tier, n_ubatch 7 and 512),
         # the Qwen3-30B model; BENCH=1: then the bench (its variables as for bench) in the same call. Builds made
         # here are packed into $OUT for a later, cold machine (cuda-libs.tar.xz.partNN, cuda-libs.cpuflags;
         # UPSTREAM_PACK=1: upstream-bin.tar.xz). SKIP_LOAD_AHEAD=1 leaves the load-ahead check out. Logs, .md
         # tables and the checks' JSON in $OUT/round15-logs.tar.gz (the device returns 8 files at most)
    start_model "${SKEW:-0}"
    prebuilt_libs=; [ -f "$repo/.devtree/cuda-libs.tar.xz" ] && prebuilt_libs=1
    pack_upstream=(); [ -z "${UPSTREAM_PACK:-}" ] || pack_upstream=(UPSTREAM_PACK=1 UPSTREAM_PREBUILT="$out/upstream-bin.tar.xz")
    if [ -z "${SKIP_UPSTREAM:-}" ]; then  # SKIP_UPSTREAM=1: no upstream build (and a bench without UPSTREAM)
        (env UPSTREAM_JOBS="${UPSTREAM_JOBS:-$([ -n "$prebuilt_libs" ] && echo 16 || echo 8)}" "${pack_upstream[@]}" \
            bash bench/upstream_build.sh > "$out/upstream_build.out" 2>&1; echo "upstream rc $?" >> "$out/upstream_build.out") &
    fi
    build_cuda
    if [ -z "$prebuilt_libs" ]; then
        (SPLIT_MIB=15 bash bench/pack_cuda_libs.sh "$build" "$out/cuda-libs.tar.xz" && rm "$out/cuda-libs.tar.xz") \
            > "$out/pack_cuda_libs.log" 2>&1 &
    fi
    python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --out "$out/cuda_bitexact_whole_pool.json" --provider streaming --sources gguf pack --ubatch 1 7 512 \
        --archs qwen3moe-tiny gpt-oss-tiny deepseek2-tiny mixtral-tiny --pool-layers 99 --whole-pool \
        > "$out/cuda_bitexact_whole_pool.log" 2>&1
    tail -2 "$out/cuda_bitexact_whole_pool.log"
    [ -n "${SKIP_LOAD_AHEAD:-}" ] || python3 bench/cuda_bitexact.py --vanilla-lib "$build/vanilla" \
        --patched-lib "$build/patched" --out "$out/cuda_bitexact_load_ahead.json" --provider streaming --sources pack \
        --ubatch 7 512 --archs qwen3moe-tiny mixtral-tiny --ram-cache-mib 24 --load-ahead 2 \
        > "$out/cuda_bitexact_load_ahead.log" 2>&1
    [ -n "${SKIP_LOAD_AHEAD:-}" ] || tail -2 "$out/cuda_bitexact_load_ahead.log"
    wait_for_model; wait; [ -n "${SKIP_UPSTREAM:-}" ] || tail -2 "$out/upstream_build.out"
    [ -z "${BENCH:-}" ] || bash "$repo/bench/device_bench.sh" bench 2>&1 | tail -12
    wait; [ -f "$out/pack_cuda_libs.log" ] && tail -2 "$out/pack_cuda_libs.log"
    (cd "$out" && tar czf round15-logs.tar.gz --remove-files -- *.log *.out *.txt *.md *.json 2>/dev/null); ls -la "$out"
    ;;
peer)  # a same-run comparison with upstream b11549: our libs and upstream's binary (prebuilt where carried, else
      # built), the model, then the bench with UPSTREAM=1 (its other variables as for bench)
    start_model "${SKEW:-0}"
    bash bench/upstream_build.sh > "$out/upstream_build.out" 2>&1 &
    build_cuda
    wait_for_model; wait; tail -1 "$out/upstream_build.out"
    UPSTREAM=1 bash "$repo/bench/device_bench.sh" bench 2>&1 | tail -30
    ;;
round19)  # API 14's layer windows and the bench's warm-up prompt (written 2026-12-08, not yet run on CUDA): the
         # windows' CUDA bit-exactness with the early start capped (LLAMAPACK_WINDOW_EARLY=3: each step copies the
         # rest it uses) and each request twice (a later prompt's windows copy from the pool), the model meanwhile;
         # then the bench beside upstream's cache at 25% (a 16-token warm-up prompt, then 512, 512 and 32 tokens),
         # and the windows again with LLAMAPACK_WINDOW_EARLY=32 and 0; first bench/h2d_pieces.py (is a window's
         # 46.6 GB/s the cost of one copy per role and expert?). Nested stages write under WORK_OUT
         # (default /tmp/round19-out); the JSON files come back as $OUT/round19-*.json (8 files at most)
    final="$out"; export OUT="${WORK_OUT:-/tmp/round19-out}"; mkdir -p "$OUT"
    python3 bench/h2d_pieces.py > "$final/round19-h2d-pieces.json" 2>&1; tail -12 "$final/round19-h2d-pieces.json"
    trace="$repo/bench/results/q30b_routing_model_seed0.trace.npz"
    LLAMAPACK_WINDOW_EARLY=3 BX_ROUNDS=2 MODEL=1 SKIP_LOAD_AHEAD=1 \
        ARCHS="${ARCHS:-qwen3moe-tiny mixtral-tiny gpt-oss-tiny}" bash "$repo/bench/device_bench.sh" windows-check 2>&1 | tail -3
    cp "$OUT/cuda_bitexact_windows.json" "$final/round19-bitexact-windows.json"
    common=(TEMPERATURE=1 DECODE_CAP_S=1 ROUTING="$trace" PROMPT_LENGTHS=512,512,32)
    env "${common[@]}" TAG=peer UPSTREAM_RUNS="${UPSTREAM_RUNS:-upstream-vram,upstream-cache-25%}" \
        CONFIGS="${CONFIGS:-vanilla-vram,pack-25%+ram+preload,pack-25%+ram+preload+ahead,pack-25%+ram+preload+windows}" \
        bash "$repo/bench/device_bench.sh" peer 2>&1 | tail -16
    cp "$OUT/bench-peer/bench.json" "$final/round19-peer.json"
    for early in 32 0; do
        env "${common[@]}" LLAMAPACK_WINDOW_EARLY=$early TAG=early$early CONFIGS='pack-25%+ram+preload+windows' \
            bash "$repo/bench/device_bench.sh" bench 2>&1 | tail -3
        cp "$OUT/bench-early$early/bench.json" "$final/round19-early$early.json"
    done
    ;;
replay-granite)  # the replay stage for the granite-shaped model only (no Qwen3-30B model, no upstream build)
    (lp synth granite-1b-a400m-shape -o "$work/granite.gguf" > "$out/granite.log" 2>&1 \
        && lp pack "$work/granite.gguf" -q >> "$out/granite.log" 2>&1; echo "granite rc $?" >> "$out/granite.log") &
    build_cuda
    wait; tail -2 "$out/granite.log"
    ;;
bench)  # TAG: results in $OUT/bench-TAG/ (bench.md, .json, .png; written after each run, so a cut call keeps them)
    results="$out/bench${TAG:+-$TAG}"
    lp bench "$model" -o "$results" --vanilla-lib "$build/vanilla" --patched-lib "$build/patched" \
        --memory-limit-mib "${MEMORY_LIMIT_MIB:-8192}" --prompt-lengths "${PROMPT_LENGTHS:-512,32}" -n 200 \
        --decode-cap-s "${DECODE_CAP_S:-20}" --temperature "${TEMPERATURE:-0}" ${RAM_TIER:+--ram-tier} \
        ${PREFETCH:+--prefetch} ${PREFETCH_TOP:+--prefetch-top $PREFETCH_TOP} \
        ${PREFETCH_DEPTHS:+--prefetch-depth $PREFETCH_DEPTHS} ${READ_SPLITS:+--read-splits $READ_SPLITS} \
        ${PREFETCH_IN_FLIGHT:+--prefetch-in-flight $PREFETCH_IN_FLIGHT} ${RAM_FRACTIONS:+--ram-fractions $RAM_FRACTIONS} \
        ${READ_ENGINES:+--read-engines} ${ROUNDS:+--rounds $ROUNDS} ${SHUFFLE_SEED:+--shuffle-seed $SHUFFLE_SEED} \
        ${ROUTING:+--routing $ROUTING} ${UPSTREAM:+--upstream-bin ${UPSTREAM_BIN:-/tmp/upstream/build/bin}} ${UPSTREAM_RUNS:+--upstream-runs $UPSTREAM_RUNS} \
        ${WARM_ROUTING:+--warm-routing $WARM_ROUTING} ${WARM_REQUESTS:+--warm-requests $WARM_REQUESTS} \
        ${WARM_PROMPT_TOKENS:+--warm-prompt-tokens $WARM_PROMPT_TOKENS} ${WARM_TOKENS:+--warm-tokens $WARM_TOKENS} \
        ${WARM_CAP_S:+--warm-cap-s $WARM_CAP_S} ${WARMUP_TOKENS:+--warmup-tokens $WARMUP_TOKENS} \
        ${CONFIGS:+--configs $CONFIGS} 2>&1
    [ -z "${PLAN:-}" ] || plan_vs_measured "$results"
    ;;
plan)  # #26: predicted vs measured for $OUT/bench-TAG (a bench of this call or an earlier one on this machine)
    plan_vs_measured "$out/bench${TAG:+-$TAG}"
    ;;
esac
