// llamapack expert-provider hook: implementation (see llama-expert.h for the contract).
//
// Copied into the vendored llama.cpp as src/llama-expert.cpp and compiled into the llama target.
#include "llama-expert-impl.h"
#include "llama-expert-fast.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model-loader.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <climits>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <unistd.h> // getpid (LLAMAPACK_COPY_TRACE)

static std::atomic<bool> g_lazy_load{false};

static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// per model: the routed-expert tensors in a stable order (the index the C API uses)
struct llama_expert_model_info {
    std::vector<llama_expert_tensor_info> tensors;
    std::vector<const ggml_tensor *>      weights; // same order
    int32_t n_lazy = 0;
};

struct llama_expert_hook;

static_assert(LLAMA_EXPERT_MAX_LOOKAHEAD + 1 <= GGML_MAX_SRC, "the remap op takes the ids plus one guess per layer ahead");

// a layer whose experts a lookahead guesses, and its router (logits weight, optional bias)
struct llama_expert_lookahead_target {
    int32_t       layer;
    ggml_tensor * router;
    ggml_tensor * router_b;
};

// userdata of one layer's remap op
struct llama_expert_layer_binding {
    llama_expert_hook * hook;
    int32_t layer;
    int32_t n_expert;
    // lookahead: the routers of the next served layers, nearest first (up to LLAMA_EXPERT_MAX_LOOKAHEAD)
    std::vector<llama_expert_lookahead_target> ahead;
    int32_t position = 0; // among the served layers, ascending (a replayed trace's layer index)
    llama_expert_layer_binding * next = nullptr; // the next served layer (load-ahead)
    // layer windows: whether the next served layer took a window where this one did, in the last graph built with
    // this layer's window (not where only the output rows reach the last layer); false: nothing loaded ahead for it
    bool window_next = true;
    // slot lookup (GPU pools): this layer's slot map, I32 [1, n_expert] in host memory, and the step's n_used
    ggml_tensor *        slot_map = nullptr;
    int32_t              n_used   = 0;
    std::vector<uint8_t> mapped; // per expert: given a slot in the current step
    // whole-pool graphs: I32 [1, n_expert] on the pool's device, slots counted from first_slot; the layer's
    // matmuls see only slots [first_slot, first_slot + n_slots), the range its experts occupy
    ggml_tensor *        device_map = nullptr;
    int32_t              first_slot = 0;
    int32_t              n_slots    = 0;
    bool                 identity   = false; // expert e in slot first_slot + e (a preloaded pool): no lookup needed
};

// llama_expert_bench_replay_set's trace rows for the current request (benchmarks only)
struct llama_expert_bench_replay {
    std::vector<int32_t> prompt_rows, decode_rows; // [n][n_layers][top_k]
    int32_t n_prompt = 0, n_layers = 0, top_k = 0, first_layer = 0;
    int64_t cursor = 0;      // tokens of the request computed, the current ubatch's included
    int64_t substituted = 0;

    const int32_t * row(int64_t token) const {
        const size_t width = (size_t) n_layers * top_k;
        const size_t n_p = prompt_rows.size() / width, n_d = decode_rows.size() / width;
        return token < n_prompt ? prompt_rows.data() + (size_t) (token % n_p) * width
                                : decode_rows.data() + (size_t) ((token - n_prompt) % n_d) * width;
    }
};

struct llama_expert_hook {
    const llama_model * model = nullptr;
    llama_context *     ctx   = nullptr; // the slot lookup's copy callback finds the current hook through it

    // pool
    ggml_context_ptr        pool_ctx;
    ggml_backend_buffer_ptr pool_buf;
    int32_t                 n_slots = 0;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> pool_tensor;   // original weight -> pool view
    std::unordered_map<const ggml_tensor *, llama_expert_layer_binding *> binding_of;
    std::vector<std::unique_ptr<llama_expert_layer_binding>> bindings;

    // slot lookup (llama_expert_slot_lookup_set): the served layers' slot maps, in pinned host memory
    int32_t                 lookup_max_tokens = 0;
    ggml_context_ptr        map_ctx;
    ggml_backend_buffer_ptr map_buf;
    std::unordered_map<const ggml_tensor *, llama_expert_layer_binding *> binding_of_map;

    // whole-pool graphs (llama_expert_slot_lookup_set's whole_pool): while the pool holds every expert of every
    // served layer, graphs look slots up on the pool's device in static maps (no split, no callback, no
    // synchronize per layer) and copy each layer's ids into `ring`; serve_whole_pool serves those steps after
    // the ubatch (the bookkeeping: they are all hits). See docs/hook.md.
    bool                    whole_pool_allowed = false; // the setting
    bool                    whole_pool = false;         // the maps are current and graphs built now use them
    ggml_context_ptr        whole_pool_ctx;
    ggml_backend_buffer_ptr whole_pool_buf;             // the bindings' device maps and the ring
    // each layer's slot views: leaf tensors placed in the pool buffer (a VIEW node in the graph would sit between
    // the gate and up matmuls and stop CUDA fusing them with the GLU, as vanilla does). The previous set stays
    // alive one update longer, for a graph built before it.
    ggml_context_ptr        slot_views_ctx, old_slot_views_ctx;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> slot_view; // original weight -> its layer's slot view
    ggml_tensor *           ring = nullptr;             // I32 [ring_per_layer * bindings]
    int64_t                 ring_per_layer = 0;
    std::vector<int32_t>    ring_host;
    bool                    aborted = false; // the user's abort callback stopped this ubatch's compute

    // provider
    llama_expert_provider_fn provider = nullptr;
    void *                   provider_data = nullptr;
    llama_expert_prefetch_fn prefetch = nullptr;
    void *                   prefetch_data = nullptr;
    int32_t                  prefetch_depth = 1;
    int32_t                  load_ahead_min_tokens = 0; // llama_expert_load_ahead_set (0: off)

    // layer windows (llama_expert_layer_windows_set): ubatches of at least window_min_tokens tokens read each
    // layer's experts from one of two windows of n_window pool slots (slot w * n_window + expert), loaded from
    // the RAM tier the layer before; window_view[w]: original weight -> its view of window w
    int32_t                  window_min_tokens = 0;
    int32_t                  n_window = 0;
    int32_t                  n_window_keys = 0; // the served layers' experts: the RAM tier must hold them all
    llama_expert_layer_binding * window_built_last = nullptr; // graph build: the layer before, if it took a window
    ggml_context_ptr         window_ctx;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> window_view[2];

    // wall time spent in the callbacks, measured on this side (remap ops run on one thread, one at a time)
    llama_expert_hook_stats stats = {};

    // the user's abort callback, chained behind ours
    ggml_abort_callback user_abort = nullptr;
    void *              user_abort_data = nullptr;

    std::atomic<bool> failed{false};
    std::mutex        error_mutex;
    std::string       last_error;
    std::string       fast_error;
    uint64_t          generation = 1;

    // native hot path (optional): steps needing no SSD read are served without the provider
    std::unique_ptr<llama_expert_fast_path> fast;
    std::unique_ptr<llama_expert_bench_replay> replay;

    // hybrid (optional): rows of the steps the fast path serves may run on the CPU (llama_expert_hybrid_set)
    std::unique_ptr<llama_expert_cpu_experts>           cpu;
    std::unordered_map<int32_t, llama_expert_cpu_layer> cpu_layers;
    int32_t                                             hybrid_max_tokens = 0;
    std::vector<llama_expert_cpu_row>                   cpu_rows; // the current step's, remap op -> CPU op

    std::vector<int32_t> scratch_ids;
    std::vector<int32_t> scratch_router; // the slot lookup: the router's ids as read back (before a replay)
    std::vector<int32_t> scratch_slots;
    std::vector<int32_t> scratch_predicted;

    bool ready() const { return pool_buf && provider; }

    void set_error(std::string msg) {
        LLAMA_LOG_ERROR("llamapack: %s\n", msg.c_str());
        std::lock_guard<std::mutex> lock(error_mutex);
        last_error = std::move(msg);
    }
};

// llama_context keeps these private; this struct is its friend
struct llama_expert_access {
    static const llama_model & model(const llama_context & c) { return c.model; }
    static void need_reserve(llama_context & c) { c.sched_need_reserve = true; c.gf_res_prev_active = nullptr; }
    static ggml_abort_callback abort_cb(const llama_context & c) { return c.abort_callback; }
    static void * abort_data(const llama_context & c) { return c.abort_callback_data; }
};

// --- model side -------------------------------------------------------------------------------------------

static int32_t role_from_name(const std::string & name) {
    if (name.find(".ffn_gate_up_exps.weight") != std::string::npos) return LLAMA_EXPERT_ROLE_GATE_UP;
    if (name.find(".ffn_gate_exps.weight")    != std::string::npos) return LLAMA_EXPERT_ROLE_GATE;
    if (name.find(".ffn_up_exps.weight")      != std::string::npos) return LLAMA_EXPERT_ROLE_UP;
    if (name.find(".ffn_down_exps.weight")    != std::string::npos) return LLAMA_EXPERT_ROLE_DOWN;
    return -1;
}

static int32_t layer_from_name(const std::string & name) {
    int layer = -1;
    return sscanf(name.c_str(), "blk.%d.", &layer) == 1 ? layer : -1;
}

bool llama_expert_force_lazy(const std::string & tensor_name) {
    return g_lazy_load.load() && role_from_name(tensor_name) >= 0 && layer_from_name(tensor_name) >= 0;
}

void llama_expert_model_init(llama_model & model, const llama_model_loader & ml) {
    auto info = std::make_shared<llama_expert_model_info>();
    for (const auto & layer : model.layers) {
        for (const ggml_tensor * t : {layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps, layer.ffn_gate_up_exps}) {
            if (t == nullptr) {
                continue;
            }
            const llama_model_loader::llama_tensor_weight * w = ml.get_weight(ggml_get_name(t));
            if (w == nullptr) {
                continue; // not backed by the file (no_alloc fit pass, or a virtual tensor)
            }
            llama_expert_tensor_info ti = {};
            snprintf(ti.name, sizeof(ti.name), "%s", ggml_get_name(t));
            ti.layer       = layer_from_name(ti.name);
            ti.role        = role_from_name(ti.name);
            ti.type        = t->type;
            ti.file_idx    = (int32_t) w->idx;
            ti.file_offset = w->offs;
            ti.nbytes      = ggml_nbytes(t);
            ti.lazy        = ml.lazy.has(t) ? 1 : 0;
            for (int d = 0; d < 4; ++d) {
                ti.ne[d] = t->ne[d];
                ti.nb[d] = t->nb[d];
            }
            if (ti.layer < 0 || ti.role < 0) {
                continue;
            }
            info->n_lazy += ti.lazy;
            info->tensors.push_back(ti);
            info->weights.push_back(t);
        }
    }
    model.expert_info = std::move(info);
}

// --- context side -----------------------------------------------------------------------------------------

static llama_expert_hook * hook_of(llama_context * ctx) {
    if (!ctx->expert_hook) {
        ctx->expert_hook = std::make_shared<llama_expert_hook>();
        ctx->expert_hook->model = &llama_expert_access::model(*ctx);
        ctx->expert_hook->ctx   = ctx;
    }
    return ctx->expert_hook.get();
}

static bool abort_trampoline(void * data) {
    auto * hook = (llama_expert_hook *) data;
    if (hook->failed.load()) {
        return true;
    }
    const bool abort = hook->user_abort ? hook->user_abort(hook->user_abort_data) : false;
    hook->aborted = hook->aborted || abort;
    return abort;
}

bool llama_expert_decode_allowed(const llama_context & lctx, bool warmup) {
    const auto & model = llama_expert_access::model(lctx);
    const bool lazy = model.expert_info && model.expert_info->n_lazy > 0;
    const llama_expert_hook * hook = lctx.expert_hook.get();
    const bool served = hook && hook->ready();
    if (lazy && !served) {
        LLAMA_LOG_ERROR("llamapack: this model was loaded with its routed experts left on disk (pack mode), "
                        "but no expert pool and provider are attached to the context; refusing to decode\n");
        return false;
    }
    if (served && warmup) {
        LLAMA_LOG_ERROR("llamapack: warmup runs every expert at once; it is refused while an expert provider is attached\n");
        return false;
    }
    return true;
}

static void serve_whole_pool(llama_expert_hook * hook, ggml_backend_sched * sched, ggml_cgraph * graph);
static void update_whole_pool(llama_expert_hook * hook, llama_context * ctx);

bool llama_expert_take_failure(llama_expert_hook * hook, ggml_backend_sched * sched, ggml_cgraph * graph) {
    if (hook == nullptr) {
        return false;
    }
    serve_whole_pool(hook, sched, graph); // the ubatch's whole-pool steps, served before the decode returns
    update_whole_pool(hook, hook->ctx);   // graphs from the next ubatch on: whole-pool when the pool holds all
    return hook->failed.exchange(false);
}

uint64_t llama_expert_hook_generation(const llama_expert_hook * hook) {
    return hook ? hook->generation : 0;
}

// --- graph side -------------------------------------------------------------------------------------------

static std::string & fast_error(llama_expert_hook * hook) {
    hook->fast_error.clear();
    return hook->fast_error;
}

// benchmarks only: the replayed trace's ids in place of the router's (llama_expert_bench_replay_set)
static bool replay_ids(llama_expert_hook * hook, const llama_expert_layer_binding * b, int32_t n_used, int32_t n_tokens) {
    auto & replay = *hook->replay;
    if (replay.top_k != n_used) {
        hook->set_error("routing replay: the trace has top-" + std::to_string(replay.top_k) + ", the model uses " +
                        std::to_string(n_used) + " experts");
        return false;
    }
    if (b->layer == replay.first_layer) {
        replay.cursor += n_tokens;
    }
    for (int32_t t = 0; t < n_tokens; ++t) {
        const int64_t token = replay.cursor - n_tokens + t;
        if (token < 0) {
            hook->set_error("routing replay: layer " + std::to_string(b->layer) + " ran before the first served layer");
            return false;
        }
        const int32_t * row = replay.row(token) + (size_t) b->position * replay.top_k;
        for (int32_t k = 0; k < n_used; ++k) {
            if (row[k] < 0 || row[k] >= b->n_expert) {
                hook->set_error("routing replay: layer " + std::to_string(b->layer) + ": expert id " +
                                std::to_string(row[k]) + " outside [0, " + std::to_string(b->n_expert) + ")");
                return false;
            }
            hook->scratch_ids[(size_t) t*n_used + k] = row[k];
        }
    }
    replay.substituted += (int64_t) n_used * n_tokens;
    return true;
}

// The step's router ids ([n_used, n_tokens] with strides nb0, nb1) into hook->scratch_ids, each checked
// against the layer's expert count. False (hook failed) on an id outside it.
static bool take_ids(llama_expert_hook * hook, const llama_expert_layer_binding * b, const char * data, size_t nb0,
                     size_t nb1, int32_t n_used, int32_t n_tokens) {
    hook->scratch_ids.resize((size_t) n_used * n_tokens);
    for (int32_t t = 0; t < n_tokens; ++t) {
        for (int32_t k = 0; k < n_used; ++k) {
            const int32_t id = *(const int32_t *) (data + t*nb1 + k*nb0);
            if (id < 0 || id >= b->n_expert) {
                hook->set_error("layer " + std::to_string(b->layer) + ": router produced expert id " + std::to_string(id) +
                                " outside [0, " + std::to_string(b->n_expert) + ")");
                hook->failed = true;
                return false;
            }
            hook->scratch_ids[(size_t) t*n_used + k] = id;
        }
    }
    return true;
}

// One step of one layer on hook->scratch_ids: the routing replay (benchmarks), then the native hot path or the
// provider; every slot id checked -> hook->scratch_slots. cpu_rows: where hybrid leaves the CPU's rows (null:
// no split). False (hook failed, error set) on any failure.
static bool serve_step(llama_expert_hook * hook, const llama_expert_layer_binding * b, int32_t n_used, int32_t n_tokens,
                       std::vector<llama_expert_cpu_row> * cpu_rows) {
    const size_t n = (size_t) n_used * n_tokens;
    hook->scratch_slots.assign(n, -1);
    if (hook->replay && !replay_ids(hook, b, n_used, n_tokens)) {
        hook->failed = true;
        return false;
    }
    const auto fast_result = hook->fast ? hook->fast->serve(b->layer, b->n_expert, hook->scratch_ids.data(), n_used,
                                                           n_tokens, hook->scratch_slots.data(), cpu_rows, fast_error(hook))
                                        : llama_expert_fast_path::DECLINED;
    if (fast_result == llama_expert_fast_path::FAILED) {
        hook->set_error(hook->fast_error);
        hook->failed = true;
        return false;
    }
    if (fast_result == llama_expert_fast_path::DECLINED) {
        const auto provider_start = std::chrono::steady_clock::now();
        const int32_t rc = hook->provider(hook->provider_data, b->layer, hook->scratch_ids.data(), n_used, n_tokens,
                                          hook->scratch_slots.data());
        hook->stats.provider_calls++;
        hook->stats.provider_s += seconds_since(provider_start);
        if (rc != 0) {
            hook->set_error("layer " + std::to_string(b->layer) + ": expert provider failed (code " + std::to_string(rc) + ")");
            hook->failed = true;
            return false;
        }
    }
    for (size_t i = 0; i < n; ++i) {
        const int32_t s = hook->scratch_slots[i];
        if (s < 0 || s >= hook->n_slots) {
            hook->set_error("layer " + std::to_string(b->layer) + ": provider returned slot id " + std::to_string(s) +
                            " for expert " + std::to_string(hook->scratch_ids[i]) + ", outside [0, " +
                            std::to_string(hook->n_slots) + ")");
            hook->failed = true;
            return false;
        }
    }
    return true;
}

// CPU custom op: selected expert ids -> provider -> slot ids. Runs on one thread (n_tasks = 1).
static void remap_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * b    = (llama_expert_layer_binding *) userdata;
    auto * hook = b->hook;
    const ggml_tensor * sel = dst->src[0];
    const int32_t n_used   = (int32_t) sel->ne[0];
    const int32_t n_tokens = (int32_t) sel->ne[1];
    const size_t  n        = (size_t) n_used * n_tokens;
    int32_t * out = (int32_t *) dst->data; // contiguous [n_used, n_tokens] slot ids, then (split) as many picks
    const bool split = dst->ne[2] == 2;     // hybrid: this graph computes rows on the CPU too

    // fail closed: after a failure every later layer gets slot 0 and the abort callback stops compute
    std::fill(out, out + n, 0);
    for (size_t i = 0; split && i < n; ++i) {
        out[n + i] = n_used + (int32_t) (i % n_used); // the pool's row
    }
    hook->cpu_rows.clear();
    if (hook->failed.load() || !take_ids(hook, b, (const char *) sel->data, sel->nb[0], sel->nb[1], n_used, n_tokens) ||
            !serve_step(hook, b, n_used, n_tokens, split && hook->cpu ? &hook->cpu_rows : nullptr)) {
        return;
    }
    std::copy(hook->scratch_slots.begin(), hook->scratch_slots.end(), out);
    for (const auto & row : hook->cpu_rows) {
        out[n + row.row] = row.row % n_used; // the CPU's row
    }
    // load-ahead: the next layer's experts copied in while this layer's matmuls run (prefill ubatches)
    if (hook->fast && b->next != nullptr && hook->load_ahead_min_tokens > 0 && n_tokens >= hook->load_ahead_min_tokens &&
            !hook->fast->load_ahead(b->layer, hook->scratch_ids.data(), (int32_t) n, b->next->layer, b->next->n_expert,
                                    fast_error(hook))) {
        hook->set_error(hook->fast_error);
        hook->failed = true;
        return;
    }

    // lookahead: src[1 + d] is the top-k of the router of b->ahead[d] applied to this layer's FFN input
    for (int32_t d = 0; hook->prefetch != nullptr && d < GGML_MAX_SRC - 1 && dst->src[1 + d] != nullptr; ++d) {
        const ggml_tensor * predicted = dst->src[1 + d]; // [n_used, n_tokens]
        hook->scratch_predicted.resize(n);
        for (int32_t t = 0; t < n_tokens; ++t) {
            for (int32_t k = 0; k < n_used; ++k) {
                hook->scratch_predicted[(size_t) t*n_used + k] =
                    *(const int32_t *) ((const char *) predicted->data + t*predicted->nb[1] + k*predicted->nb[0]);
            }
        }
        const auto prefetch_start = std::chrono::steady_clock::now();
        hook->prefetch(hook->prefetch_data, b->ahead[d].layer, hook->scratch_predicted.data(), n_used, n_tokens);
        hook->stats.prefetch_calls++;
        hook->stats.prefetch_s += seconds_since(prefetch_start);
    }
}

// Slot lookup: one step served where the scheduler copies the layer's slot map into its GPU split. The ids come
// from the split's get_rows that reads the map (computed in an earlier split, so complete once the backend is
// synchronized); the map's entries of the step's experts get their slots. False (hook failed) on any failure.
static bool lookup_step(llama_expert_hook * hook, llama_expert_layer_binding * b, ggml_backend_t backend,
                        const ggml_tensor * dst, ggml_cgraph * graph, int32_t * map) {
    auto fail = [&](const std::string & why) { // built only on failure: this runs per layer and token
        hook->set_error("layer " + std::to_string(b->layer) + ": slot lookup: " + why);
        hook->failed = true;
        return false;
    };
    const ggml_tensor * lookup = nullptr;
    for (int i = 0; i < ggml_graph_n_nodes(graph) && lookup == nullptr; ++i) {
        const ggml_tensor * node = ggml_graph_node(graph, i);
        lookup = node->op == GGML_OP_GET_ROWS && node->src[0] == dst ? node : nullptr;
    }
    if (lookup == nullptr || b->n_used < 1 || ggml_nelements(lookup->src[1]) % b->n_used != 0) {
        return fail("its get_rows is not in the split the map is copied into");
    }
    const ggml_tensor * sel = lookup->src[1]; // the router's ids, [n_used * n_tokens] contiguous
    if (strchr(sel->name, '#') != nullptr) { // the scheduler's name for a copy into this split: maybe not made yet
        return fail(std::string("the experts' ids come from another backend (") + sel->name + ")");
    }
    for (int i = 0; i < ggml_graph_n_nodes(graph); ++i) {
        const ggml_tensor * node = ggml_graph_node(graph, i);
        if (node == sel || node == sel->view_src) {
            return fail("the experts are selected in the same split as their lookup (no split boundary)");
        }
    }
    const int32_t n_used = b->n_used, n_tokens = (int32_t) (ggml_nelements(sel) / n_used);
    hook->scratch_router.resize((size_t) n_used * n_tokens);
    ggml_backend_tensor_get_async(backend, sel, hook->scratch_router.data(), 0, ggml_nbytes(sel));
    ggml_backend_synchronize(backend);
    if (!take_ids(hook, b, (const char *) hook->scratch_router.data(), sizeof(int32_t), n_used * sizeof(int32_t), n_used,
                  n_tokens) ||
            !serve_step(hook, b, n_used, n_tokens, nullptr)) {
        return false;
    }
    // the map is keyed on the router's ids (a replay changes which experts they stand for, not the lookup)
    b->mapped.assign(b->n_expert, 0);
    for (size_t i = 0; i < hook->scratch_router.size(); ++i) {
        const int32_t expert = hook->scratch_router[i], slot = hook->scratch_slots[i];
        if (b->mapped[expert] && map[expert] != slot) {
            return fail("expert " + std::to_string(expert) + " would need two slots in one step (" +
                        std::to_string(map[expert]) + " and " + std::to_string(slot) + ")");
        }
        map[expert] = slot;
        b->mapped[expert] = 1;
    }
    hook->stats.lookup_steps++;
    return true;
}

static const char * k_slot_ids = "llamapack_slot_ids-"; // + the layer: a remap op's output

// LLAMAPACK_COPY_TRACE=<file> (a diagnostic, bench/copy_timeline.py): the prefill's copy timeline, one line per event
// appended to the file, "pid microseconds event layer value tensor": the scheduler's copies into a split (value 1:
// a CPU split), the copies started there (early_issued: how many), and each window op's start and end (its wait
// for its window's copies lies between; window_op_end's value: ahead_loads so far). Unset: one pointer test.
static FILE * copy_trace_file() {
    static FILE * file = [] {
        const char * path = getenv("LLAMAPACK_COPY_TRACE");
        return path != nullptr && *path != '\0' ? fopen(path, "a") : nullptr;
    }();
    return file;
}

static void copy_trace(const char * event, int32_t layer, int64_t value, const char * tensor = "-") {
    if (FILE * file = copy_trace_file()) {
        const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
        fprintf(file, "%d %lld %s %d %lld %s\n", (int) getpid(), (long long) us, event, layer, (long long) value,
                *tensor != '\0' ? tensor : "-");
        fflush(file);
    }
}

// Load-ahead and layer windows: the copies an op planned for the next layer start at the first copy the scheduler
// makes into a CPU split after that op: by then the GPU split that reads this layer's slot ids has been launched
// (its matmuls run while the copies are issued and made) and its input, the slot ids, has been copied. Started in
// the op, they would keep the GPU idle while they are issued and could delay that small copy (one copy engine may
// take host-to-device copies in the order they came, whatever their stream). Nothing done: the next step starts
// them. Never makes the copy itself (false: the scheduler copies as usual). Round 18 (H100) measured starting them
// right after the slot ids' copy into the GPU split instead: no faster (bench/results/gpu_round18_README.md).
static bool start_copies_while_gpu_computes(llama_expert_hook * hook, ggml_backend_t backend, const ggml_tensor * dst) {
    const bool into_cpu = ggml_backend_dev_type(ggml_backend_get_device(backend)) == GGML_BACKEND_DEVICE_TYPE_CPU;
    copy_trace("copy_into_split", -1, into_cpu, dst->name);
    if (!hook->fast || !hook->fast->has_copies_ahead() || !into_cpu) {
        return false;
    }
    const int64_t early_before = hook->fast->stats().ahead_early;
    if (!hook->failed.load() && !hook->fast->start_copies_behind(fast_error(hook), /*early =*/ true)) {
        hook->set_error(hook->fast_error); // the decode reports it; the next step starts nothing more
        hook->failed = true;
    }
    copy_trace("early_issued", -1, hook->fast->stats().ahead_early - early_before);
    return false;
}

// The scheduler's copy callback: the copy of a slot map into its split runs the step (lookup_step) and copies the
// map asynchronously (the next write to this map comes after a later synchronize). Every other copy: not ours,
// but the first into a CPU split starts the copies load-ahead or a layer window left (start_copies_while_gpu_computes).
static bool lookup_copy(ggml_backend_t backend, const ggml_tensor * src, ggml_tensor * dst, ggml_cgraph * graph,
                        void * user_data) {
    llama_expert_hook * hook = ((llama_context *) user_data)->expert_hook.get();
    if (hook == nullptr) {
        return false;
    }
    const auto it = hook->binding_of_map.find(src);
    if (it == hook->binding_of_map.end()) {
        return start_copies_while_gpu_computes(hook, backend, dst);
    }
    llama_expert_layer_binding * b = it->second;
    auto * map = (int32_t *) src->data;
    if (hook->failed.load() || !lookup_step(hook, b, backend, dst, graph, map)) {
        std::fill(map, map + b->n_expert, 0); // fail closed: slot 0, and the decode reports the failure
    }
    ggml_backend_tensor_set_async(backend, dst, map, 0, ggml_nbytes(src));
    return true;
}

// CPU custom op (hybrid): the rows the remap op left in RAM, computed on the CPU; then the wait for the
// copies the remap op left running (they overlap the CPU's work), and (fill_pool) the start of the copies of
// the CPU's experts into their slots, which the next step waits for. Runs right after the remap op.
static void cpu_rows_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * b    = (llama_expert_layer_binding *) userdata;
    auto * hook = b->hook;
    std::string error;
    if (!hook->failed.load() && !hook->cpu_rows.empty()) {
        const ggml_tensor * input = dst->src[1]; // [n_embd, n_tokens] F32
        const auto started = std::chrono::steady_clock::now();
        const bool ok = hook->cpu->compute(hook->cpu_layers.at(b->layer), (const char *) input->data, input->nb[1],
                                           input->ne[0], hook->cpu_rows, (float *) dst->data, error);
        hook->fast->stats_mut().cpu_s += seconds_since(started);
        if (!ok) {
            hook->set_error("layer " + std::to_string(b->layer) + ": " + error);
            hook->failed = true;
        }
    }
    if (hook->fast && !hook->fast->finish_copies(error)) {
        hook->set_error("layer " + std::to_string(b->layer) + ": " + error);
        hook->failed = true;
    }
    if (hook->fast && !hook->failed.load() && !hook->fast->start_copies_behind(error)) {
        hook->set_error(error);
        hook->failed = true;
    }
}

// hybrid: the GLU the CPU applies for this layer, -1 when it cannot be split (see llama_expert_hybrid_desc)
static int32_t split_glu(llama_expert_hook * hook, const llama_expert_layer_binding * binding, const ggml_tensor * selected,
                         const ggml_tensor * ffn_input, int ffn_op, bool weight_before_ffn,
                         std::initializer_list<ggml_tensor *> expert_extras) {
    if (!hook->cpu || selected->ne[1] > hook->hybrid_max_tokens || weight_before_ffn || ffn_input == nullptr ||
            ffn_input->type != GGML_TYPE_F32 || ffn_input->nb[0] != sizeof(float) || ffn_input->ne[1] != selected->ne[1]) {
        return -1;
    }
    for (const ggml_tensor * extra : expert_extras) {
        if (extra != nullptr) {
            return -1;
        }
    }
    auto it = hook->cpu_layers.find(binding->layer);
    if (it == hook->cpu_layers.end() || it->second.gate.type < 0 || it->second.up.type < 0 || it->second.down.type < 0) {
        return -1;
    }
    if (ffn_op == LLM_FFN_SILU) {
        return hook->model->hparams.swiglu_clamp_exp[binding->layer] > 1e-6f ? -1 : GGML_GLU_OP_SWIGLU;
    }
    return ffn_op == LLM_FFN_GELU ? GGML_GLU_OP_GEGLU : -1;
}

// slots [first_slot, first_slot + n_slots) of a pool tensor, as a leaf placed in the pool buffer by hand, not by
// ggml_backend_tensor_alloc: its init_tensor takes the view for a tensor of its own, and CUDA's zeroes the row
// padding past a quantized tensor's end, which here is the first bytes of the slot after the range (another
// layer's expert: gpt-oss-tiny differed on CUDA in round 15)
static ggml_tensor * place_pool_view(llama_expert_hook * hook, ggml_context * ctx, const ggml_tensor * pool,
                                     int32_t first_slot, int32_t n_slots) {
    ggml_tensor * view = ggml_new_tensor_3d(ctx, pool->type, pool->ne[0], pool->ne[1], n_slots);
    view->nb[1]  = pool->nb[1];
    view->nb[2]  = pool->nb[2];
    view->nb[3]  = pool->nb[2] * n_slots;
    view->buffer = hook->pool_buf.get();
    view->data   = (char *) pool->data + (size_t) first_slot * pool->nb[2];
    return view;
}

// --- layer windows -----------------------------------------------------------------------------------------

// CPU custom op (layer windows): the layer's experts are in its window (loaded ahead, else copied now), so the
// slot ids are the expert ids; then the next served layer's experts start loading into the other window (the
// copies left behind until the GPU computes this layer: start_copies_while_gpu_computes).
static void window_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto * b    = (llama_expert_layer_binding *) userdata;
    auto * hook = b->hook;
    const ggml_tensor * sel = dst->src[0];
    const int32_t n_used = (int32_t) sel->ne[0], n_tokens = (int32_t) sel->ne[1];
    const size_t  n      = (size_t) n_used * n_tokens;
    int32_t * out = (int32_t *) dst->data;
    std::fill(out, out + n, 0); // fail closed, as the remap op
    if (hook->failed.load() || !take_ids(hook, b, (const char *) sel->data, sel->nb[0], sel->nb[1], n_used, n_tokens) ||
            (hook->replay && !replay_ids(hook, b, n_used, n_tokens))) {
        hook->failed = true;
        return;
    }
    if (!hook->fast) { // the fast path was cleared after this graph was built
        hook->set_error("layer " + std::to_string(b->layer) + ": a layer window needs the native hot path");
        hook->failed = true;
        return;
    }
    const int32_t window = b->position % 2;
    copy_trace("window_op", b->layer, n_tokens);
    if (!hook->fast->window_step(b->layer, b->n_expert, window, hook->n_window, hook->scratch_ids.data(), (int32_t) n,
                                 n_tokens, fast_error(hook)) ||
            (b->next != nullptr && b->window_next &&
             !hook->fast->window_load_ahead(b->next->layer, b->next->n_expert, 1 - window, hook->n_window,
                                            fast_error(hook)))) {
        hook->set_error(hook->fast_error);
        hook->failed = true;
        return;
    }
    copy_trace("window_op_end", b->layer, hook->fast->stats().ahead_loads);
    std::copy(hook->scratch_ids.begin(), hook->scratch_ids.begin() + n, out);
}

// whether this layer's step of n_tokens goes through a window (graph build time)
static bool window_applies(const llama_expert_hook * hook, const llama_expert_layer_binding * b, int32_t glu,
                           int64_t n_tokens) {
    return hook->window_min_tokens > 0 && n_tokens >= hook->window_min_tokens && glu < 0 && hook->prefetch == nullptr &&
           hook->fast && hook->fast->tier_holds_all(hook->n_window_keys) && b->n_expert <= hook->n_window &&
           !hook->window_view[0].empty();
}

// both windows' views of every pool tensor, leaves placed in the pool buffer as make_slot_views places its own
static void make_window_views(llama_expert_hook * hook) {
    ggml_init_params params = {
        /*.mem_size   =*/ (2 * hook->pool_tensor.size() + 1) * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr views(ggml_init(params));
    for (int32_t w = 0; w < 2; ++w) {
        hook->window_view[w].clear();
        for (const auto & [weight, pool] : hook->pool_tensor) {
            const llama_expert_layer_binding * b = hook->binding_of.at(weight);
            ggml_tensor * view = place_pool_view(hook, views.get(), pool, w * hook->n_window, b->n_expert);
            ggml_format_name(view, "%s-window-%d", pool->name, w);
            hook->window_view[w][weight] = view;
        }
    }
    hook->window_ctx = std::move(views);
}

// --- whole-pool graphs --------------------------------------------------------------------------------------

static const char * k_whole_pool_ids = "llamapack_whole_pool_ids-"; // + the layer: a layer's ids, copied into the ring

// The ubatch's whole-pool steps (the ring copies in the graph just computed), served in graph order through
// the step every other path takes (replay, native hot path, slot checks): the policy and the counters see what
// they would have seen. Each must be all hits (the pool held every expert when the graph was built, and only
// steps change it); one that is not fails the decode and ends whole-pool graphs.
static void serve_whole_pool(llama_expert_hook * hook, ggml_backend_sched * sched, ggml_cgraph * graph) {
    const bool aborted = hook->aborted;
    hook->aborted = false;
    if (!hook->whole_pool || graph == nullptr || hook->failed.load() || aborted) {
        return; // an aborted ubatch's results are dropped, and so are its steps (some layers never ran)
    }
    const size_t prefix = strlen(k_whole_pool_ids);
    std::vector<std::pair<llama_expert_layer_binding *, const ggml_tensor *>> steps;
    size_t end = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); ++i) {
        const ggml_tensor * node = ggml_graph_node(graph, i);
        if (strncmp(node->name, k_whole_pool_ids, prefix) != 0) {
            continue;
        }
        const int32_t layer = atoi(node->name + prefix);
        for (auto & b : hook->bindings) {
            if (b->layer == layer) {
                steps.emplace_back(b.get(), node);
                end = std::max(end, (size_t) (node->view_offs / sizeof(int32_t) + ggml_nelements(node)));
            }
        }
    }
    if (steps.empty()) {
        return;
    }
    ggml_backend_sched_synchronize(sched);
    hook->ring_host.resize(end);
    ggml_backend_tensor_get(hook->ring, hook->ring_host.data(), 0, end * sizeof(int32_t));
    for (const auto & [b, node] : steps) {
        const int32_t n_used = b->n_used, n_tokens = (int32_t) (ggml_nelements(node) / n_used);
        const int32_t * ids = hook->ring_host.data() + node->view_offs / sizeof(int32_t);
        const int64_t misses = hook->fast->stats().cache_misses, calls = hook->stats.provider_calls;
        if (!take_ids(hook, b, (const char *) ids, sizeof(int32_t), n_used * sizeof(int32_t), n_used, n_tokens) ||
                !serve_step(hook, b, n_used, n_tokens, nullptr)) {
            break;
        }
        if (hook->fast->stats().cache_misses != misses || hook->stats.provider_calls != calls) {
            hook->set_error("layer " + std::to_string(b->layer) + ": a whole-pool step was not all hits (the pool held "
                            "every expert when its graph was built); the decode is failed");
            hook->failed = true;
            break;
        }
        hook->stats.whole_pool_steps++;
    }
    if (hook->failed.load()) {
        hook->whole_pool = false; // graphs from now on: the lookup or the op
        hook->generation++;
    }
}

// the bindings' slot views (first_slot, n_slots) of every pool tensor, as leaves placed in the pool buffer
static void make_slot_views(llama_expert_hook * hook) {
    ggml_init_params params = {
        /*.mem_size   =*/ (hook->pool_tensor.size() + 1) * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr views(ggml_init(params));
    std::unordered_map<const ggml_tensor *, ggml_tensor *> slot_view;
    for (const auto & [weight, pool] : hook->pool_tensor) {
        const llama_expert_layer_binding * b = hook->binding_of.at(weight);
        ggml_tensor * view = place_pool_view(hook, views.get(), pool, b->first_slot, b->n_slots);
        ggml_format_name(view, "%s-slots-%d+%d", pool->name, b->first_slot, b->n_slots);
        slot_view[weight] = view;
    }
    hook->old_slot_views_ctx = std::move(hook->slot_views_ctx);
    hook->slot_views_ctx     = std::move(views);
    hook->slot_view          = std::move(slot_view);
}

// After a ubatch: when whole-pool graphs are allowed and now possible (the native hot path on, no hybrid, no
// lookahead, the pool holding every expert of every served layer), write each layer's device map from the
// pool's policy and have graphs rebuilt. The maps stay right while the pool holds every expert: nothing is then
// loaded or evicted.
static void update_whole_pool(llama_expert_hook * hook, llama_context * ctx) {
    if (hook->whole_pool || !hook->whole_pool_allowed || !hook->fast || hook->cpu || hook->prefetch != nullptr ||
            hook->failed.load() || hook->bindings.empty() || ctx == nullptr) {
        return;
    }
    for (const auto & b : hook->bindings) {
        if (!hook->fast->holds_layer(b->layer, b->n_expert)) {
            return;
        }
    }
    const int64_t per_layer = (int64_t) hook->model->hparams.n_expert_used_max() * llama_n_ubatch(ctx);
    if (!hook->whole_pool_buf || hook->ring_per_layer < per_layer) {
        ggml_init_params params = {
            /*.mem_size   =*/ (hook->bindings.size() + 1) * ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        ggml_context_ptr whole_ctx(ggml_init(params));
        for (auto & b : hook->bindings) {
            b->device_map = ggml_new_tensor_2d(whole_ctx.get(), GGML_TYPE_I32, 1, b->n_expert);
            ggml_format_name(b->device_map, "llamapack_device_map-%d", b->layer);
        }
        ggml_tensor * ring = ggml_new_tensor_1d(whole_ctx.get(), GGML_TYPE_I32, per_layer * (int64_t) hook->bindings.size());
        ggml_set_name(ring, "llamapack_whole_pool_ring");
        ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(
                whole_ctx.get(), ggml_backend_buffer_get_type(hook->pool_buf.get())));
        if (!buf) {
            LLAMA_LOG_WARN("llamapack: no room for whole-pool graphs' maps on the pool's device; keeping the slot lookup\n");
            hook->whole_pool_allowed = false;
            return;
        }
        hook->whole_pool_ctx = std::move(whole_ctx);
        hook->whole_pool_buf = std::move(buf);
        hook->ring           = ring;
        hook->ring_per_layer = per_layer;
    }
    // each layer's matmuls get a view of the slots its experts occupy: the CUDA MMQ kernels' grid (and the CPU's
    // loop) grow with the expert count the weights declare, so a view of a layer's own range keeps prefill at
    // vanilla's cost when the pool was filled layer by layer (pool preload), and is never wider than the pool
    std::vector<int32_t> slots;
    int32_t widest = 0;
    for (const auto & b : hook->bindings) {
        slots.resize(b->n_expert);
        for (int32_t expert = 0; expert < b->n_expert; ++expert) {
            slots[expert] = hook->fast->pool_slot(b->layer, expert);
            if (slots[expert] < 0 || slots[expert] >= hook->n_slots) {
                return; // not whole after all: stay as we are
            }
        }
        const auto [lo, hi] = std::minmax_element(slots.begin(), slots.end());
        b->first_slot = *lo;
        b->n_slots    = *hi - *lo + 1;
        widest = std::max(widest, b->n_slots);
        b->identity = true;
        for (int32_t expert = 0; expert < b->n_expert; ++expert) {
            slots[expert] -= b->first_slot;
            b->identity = b->identity && slots[expert] == expert;
        }
        ggml_backend_tensor_set(b->device_map, slots.data(), 0, slots.size() * sizeof(int32_t));
    }
    make_slot_views(hook);
    hook->stats.whole_pool_span = widest;
    hook->whole_pool = true;
    hook->generation++; // graphs are rebuilt with the static maps
}

// slot lookup: the backend of the pool's GPU when this step can be remapped by a lookup (see
// llama_expert_slot_lookup_set), else null (the remap op serves it)
static ggml_backend_t lookup_backend(const llama_expert_hook * hook, const llama_expert_layer_binding * b,
                                     ggml_backend_sched * sched, int64_t n_tokens) {
    if (sched == nullptr || b->slot_map == nullptr || hook->prefetch != nullptr || n_tokens > hook->lookup_max_tokens ||
            (hook->replay && n_tokens > 1)) {
        return nullptr;
    }
    ggml_backend_dev_t pool_dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(hook->pool_buf.get()));
    // the router's ids must come from an earlier split on the pool's GPU: a router elsewhere (a layer left on the
    // CPU, another GPU) makes them an input of the lookup's own split, copied in after the map perhaps
    const ggml_tensor * router = hook->model->layers[b->layer].ffn_gate_inp;
    if (router == nullptr || router->buffer == nullptr ||
            ggml_backend_buft_get_device(ggml_backend_buffer_get_type(router->buffer)) != pool_dev) {
        return nullptr;
    }
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(backend) == pool_dev) {
            // a GPU that reads the map's host memory in place would skip the copy, and with it the step
            const bool copied = !ggml_backend_supports_buft(backend, ggml_backend_buffer_get_type(hook->map_buf.get()));
            return copied ? backend : nullptr;
        }
    }
    return nullptr;
}

llama_expert_remap llama_expert_remap_build(
        llama_expert_hook * hook, ggml_context * ctx, ggml_backend_sched * sched, ggml_tensor * selected_experts,
        ggml_tensor * ffn_input, std::initializer_list<ggml_tensor *> expert_weights, int ffn_op, bool weight_before_ffn,
        std::initializer_list<ggml_tensor *> expert_extras) {
    llama_expert_remap remap;
    if (hook == nullptr || !hook->ready()) {
        return remap;
    }
    llama_expert_layer_binding * binding = nullptr;
    for (ggml_tensor * w : expert_weights) {
        auto it = w ? hook->binding_of.find(w) : hook->binding_of.end();
        if (it != hook->binding_of.end()) {
            binding = it->second;
            break;
        }
    }
    if (binding == nullptr) {
        return remap; // this layer's experts are resident: vanilla path
    }
    ggml_tensor * args[GGML_MAX_SRC] = { selected_experts };
    int n_args = 1;
    if (hook->prefetch != nullptr && ffn_input != nullptr && ffn_input->ne[1] == selected_experts->ne[1]) {
        // lookahead: the next served layers' routers applied to this layer's FFN input (predictions only)
        for (const auto & target : binding->ahead) {
            if (n_args > hook->prefetch_depth || target.router->ne[0] != ffn_input->ne[0]) {
                break;
            }
            ggml_tensor * logits = ggml_mul_mat(ctx, target.router, ffn_input); // [n_expert, n_tokens]
            if (target.router_b != nullptr) {
                logits = ggml_add(ctx, logits, target.router_b);
            }
            args[n_args] = ggml_argsort_top_k(ctx, logits, (int) selected_experts->ne[0]); // [n_used, n_tokens]
            ggml_format_name(args[n_args], "llamapack_lookahead-%d-from-%d", target.layer, binding->layer);
            n_args++;
        }
    }
    const int32_t glu = split_glu(hook, binding, selected_experts, ffn_input, ffn_op, weight_before_ffn, expert_extras);
    const int64_t n_used = selected_experts->ne[0], n_tokens = selected_experts->ne[1];
    remap.hook = hook;
    const bool whole  = hook->whole_pool && glu < 0 && hook->prefetch == nullptr &&
                        n_used * n_tokens <= hook->ring_per_layer;
    const bool window = !whole && window_applies(hook, binding, glu, n_tokens);
    if (binding->position == 0) {
        hook->window_built_last = nullptr; // a new graph
    }
    if (hook->window_built_last != nullptr && hook->window_built_last->next == binding) {
        hook->window_built_last->window_next = window; // e.g. false for the last layer of a prompt: its output rows only
    }
    hook->window_built_last = window ? binding : nullptr;
    if (whole) {
        // whole pool: slots = device map[router id] on the pool's device; the ids also go to this layer's part of
        // the ring, for the bookkeeping after the ubatch (serve_whole_pool)
        ggml_tensor * ids  = ggml_is_contiguous(selected_experts) ? selected_experts : ggml_cont(ctx, selected_experts);
        const size_t  at   = (size_t) binding->position * hook->ring_per_layer * sizeof(int32_t);
        ggml_tensor * kept = ggml_cpy(ctx, ggml_reshape_1d(ctx, ids, n_used * n_tokens),
                                      ggml_view_1d(ctx, hook->ring, n_used * n_tokens, at));
        ggml_format_name(kept, "%s%d", k_whole_pool_ids, binding->layer);
        // the ids are the slots in the layer's view when its map is the identity (a preloaded pool)
        ggml_tensor * slots = binding->identity ? kept : ggml_get_rows(ctx, binding->device_map, kept);
        binding->n_used  = (int32_t) n_used;
        remap.ids        = ggml_reshape_2d(ctx, slots, n_used, n_tokens); // [n_used, n_tokens]
        // named apart from `kept`: serve_whole_pool finds the ring copies by their name's prefix
        ggml_format_name(remap.ids, "llamapack_whole_pool_slots-%d", binding->layer);
        remap.whole_pool = true;
        return remap;
    }
    if (window) {
        // layer windows: slot ids = expert ids in this layer's window; the op loads the next layer's window
        remap.ids = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, 1, 1, args, 1, window_op, 1, binding);
        ggml_format_name(remap.ids, "%s%d-window", k_slot_ids, binding->layer);
        remap.window = 1 + binding->position % 2;
        if (sched != nullptr) {
            ggml_backend_sched_set_copy_callback(sched, lookup_copy, hook->ctx); // start_copies_while_gpu_computes
        }
        return remap;
    }
    if (ggml_backend_t backend = glu < 0 ? lookup_backend(hook, binding, sched, n_tokens) : nullptr) {
        // slot ids = map[router id], on the GPU; the scheduler's copy of the map into this split runs the step
        ggml_tensor * ids = ggml_is_contiguous(selected_experts) ? selected_experts : ggml_cont(ctx, selected_experts);
        ggml_tensor * slots = ggml_get_rows(ctx, binding->slot_map, ggml_reshape_1d(ctx, ids, n_used * n_tokens));
        if (ggml_backend_supports_op(backend, slots)) {
            ggml_format_name(slots, "llamapack_slot_lookup-%d", binding->layer);
            ggml_backend_sched_set_tensor_backend(sched, slots, backend);
            ggml_backend_sched_set_copy_callback(sched, lookup_copy, hook->ctx);
            binding->n_used = (int32_t) n_used;
            remap.ids = ggml_reshape_2d(ctx, slots, n_used, n_tokens); // [n_used, n_tokens]
            return remap;
        }
    }
    remap.ids  = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, glu >= 0 ? 2 : 1, 1, args, n_args, remap_op, 1, binding);
    ggml_format_name(remap.ids, "%s%d", k_slot_ids, binding->layer);
    if (sched != nullptr && hook->load_ahead_min_tokens > 0) {
        ggml_backend_sched_set_copy_callback(sched, lookup_copy, hook->ctx); // start_copies_while_gpu_computes
    }
    if (glu >= 0) {
        hook->cpu_layers.at(binding->layer).glu = glu;
        ggml_tensor * both = remap.ids;
        remap.ids  = ggml_view_2d(ctx, both, n_used, n_tokens, both->nb[1], 0);
        remap.pick = ggml_view_2d(ctx, both, n_used, n_tokens, both->nb[1], both->nb[2]);
        ggml_tensor * srcs[2] = { both, ffn_input };
        remap.cpu_rows = ggml_custom_4d(ctx, GGML_TYPE_F32, ffn_input->ne[0], n_used, n_tokens, 1, srcs, 2, cpu_rows_op, 1, binding);
        ggml_format_name(remap.cpu_rows, "llamapack_cpu_rows-%d", binding->layer);
    }
    return remap;
}

ggml_tensor * llama_expert_remap_merge(const llama_expert_remap * remap, ggml_context * ctx, ggml_tensor * experts) {
    if (remap == nullptr || remap->cpu_rows == nullptr) {
        return experts;
    }
    // the CPU's rows first, so that the graph computes them (right after the remap op, in its CPU split)
    // before the pool's matmuls: [n_embd, 2 n_used, n_tokens], then row pick[k, t] of each token's slice
    ggml_tensor * both = ggml_concat(ctx, remap->cpu_rows, experts, 1);
    return ggml_get_rows(ctx, both, remap->pick);
}

void llama_expert_remap_apply(const llama_expert_remap * remap, ggml_tensor * mul_mat_id) {
    if (remap == nullptr || remap->ids == nullptr) {
        return;
    }
    GGML_ASSERT(mul_mat_id->op == GGML_OP_MUL_MAT_ID);
    auto it = remap->hook->pool_tensor.find(mul_mat_id->src[0]);
    GGML_ASSERT(it != remap->hook->pool_tensor.end() && "every role of a served layer must have a pool tensor");
    // whole-pool graphs: the layer's own range of slots (make_slot_views)
    mul_mat_id->src[0] = remap->whole_pool ? remap->hook->slot_view.at(mul_mat_id->src[0])
                       : remap->window > 0 ? remap->hook->window_view[remap->window - 1].at(mul_mat_id->src[0])
                       : it->second;
    mul_mat_id->src[2] = remap->ids;
}

// --- C API ------------------------------------------------------------------------------------------------

int32_t llama_expert_api_version(void) {
    return LLAMA_EXPERT_API_VERSION;
}

void llama_expert_set_lazy_load(bool enable) {
    g_lazy_load = enable;
}

int32_t llama_model_expert_tensor_count(const llama_model * model) {
    return model->expert_info ? (int32_t) model->expert_info->tensors.size() : 0;
}

int32_t llama_model_expert_tensor_get(const llama_model * model, int32_t i, llama_expert_tensor_info * out) {
    if (i < 0 || i >= llama_model_expert_tensor_count(model)) {
        return -1;
    }
    *out = model->expert_info->tensors[i];
    return 0;
}

static ggml_backend_dev_t gpu_device(int32_t index) {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU && index-- == 0) {
            return dev;
        }
    }
    return nullptr;
}

void * llama_expert_pool_base(const llama_context * ctx) {
    const llama_expert_hook * hook = ctx->expert_hook.get();
    return hook && hook->pool_buf ? ggml_backend_buffer_get_base(hook->pool_buf.get()) : nullptr;
}

static int32_t attach_error(llama_expert_hook * hook, const std::string & msg) {
    hook->set_error("pool attach: " + msg);
    return -1;
}

int32_t llama_expert_pool_attach(llama_context * ctx, const llama_expert_pool_desc * desc) {
    llama_expert_hook * hook = hook_of(ctx);
    const llama_model & model = llama_expert_access::model(*ctx);
    const auto & info = model.expert_info;
    const int32_t n_tensors = llama_model_expert_tensor_count(&model);

    if (n_tensors == 0) {
        return attach_error(hook, "the model has no routed-expert tensors");
    }
    if (desc->n_slots < 1 || desc->tensor_offsets == nullptr || desc->tensor_strides == nullptr) {
        return attach_error(hook, "need tensor offsets and strides, and at least one slot");
    }
    if ((desc->device < 0) != (desc->base != nullptr)) {
        return attach_error(hook, "a host pool (device -1) needs a base pointer; a device pool is allocated here (base NULL)");
    }
    if (desc->base != nullptr && (uintptr_t) desc->base % 64 != 0) {
        return attach_error(hook, "pool base must be 64-byte aligned");
    }
    for (int32_t i = 0; i < n_tensors; ++i) {
        const auto & ti = info->tensors[i];
        const uint64_t off    = desc->tensor_offsets[i];
        const uint64_t stride = desc->tensor_strides[i];
        if (off % 64 != 0 || stride % ggml_type_size((ggml_type) ti.type) != 0) {
            return attach_error(hook, std::string(ti.name) + ": offset must be 64-byte aligned and the stride a multiple of the type size");
        }
        if (ti.nb[2] > stride) {
            return attach_error(hook, std::string(ti.name) + ": one expert (" + std::to_string(ti.nb[2]) +
                                " bytes) does not fit in a slot of " + std::to_string(stride) + " bytes");
        }
        if (off + stride * (uint64_t) desc->n_slots > desc->size) {
            return attach_error(hook, std::string(ti.name) + ": its slots run past the end of the pool");
        }
    }
    for (const auto & layer : model.layers) {
        int n_served = 0, n_present = 0;
        for (const ggml_tensor * t : {layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps, layer.ffn_gate_up_exps}) {
            n_present += t != nullptr;
        }
        for (const ggml_tensor * w : info->weights) {
            for (const ggml_tensor * t : {layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps, layer.ffn_gate_up_exps}) {
                n_served += t != nullptr && t == w;
            }
        }
        if (n_served != 0 && n_served != n_present) {
            return attach_error(hook, "a layer has expert roles the pool does not cover");
        }
    }

    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) n_tensors * ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr pool_ctx(ggml_init(params));
    ggml_backend_buffer_ptr pool_buf;
    if (desc->device < 0) {
        pool_buf.reset(ggml_backend_cpu_buffer_from_ptr(desc->base, desc->size));
    } else {
        ggml_backend_dev_t dev = gpu_device(desc->device);
        if (dev == nullptr) {
            return attach_error(hook, "no GPU device " + std::to_string(desc->device));
        }
        pool_buf.reset(ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), desc->size));
        if (pool_buf) {
            ggml_backend_buffer_clear(pool_buf.get(), 0); // kernels may read past row ends: tails must be zero
        }
    }
    if (!pool_ctx || !pool_buf) {
        return attach_error(hook, "could not create the pool buffer (" + std::to_string(desc->size) + " bytes)");
    }
    ggml_backend_buffer_set_usage(pool_buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    char * base = (char *) ggml_backend_buffer_get_base(pool_buf.get());

    std::unordered_map<const ggml_tensor *, ggml_tensor *> pool_tensor;
    std::unordered_map<const ggml_tensor *, llama_expert_layer_binding *> binding_of;
    std::vector<std::unique_ptr<llama_expert_layer_binding>> bindings;
    std::unordered_map<int32_t, llama_expert_layer_binding *> binding_by_layer;
    for (int32_t i = 0; i < n_tensors; ++i) {
        const auto & ti = info->tensors[i];
        ggml_tensor * t = ggml_new_tensor_3d(pool_ctx.get(), (ggml_type) ti.type, ti.ne[0], ti.ne[1], desc->n_slots);
        t->nb[1] = ti.nb[1];
        t->nb[2] = desc->tensor_strides[i];
        t->nb[3] = desc->tensor_strides[i] * desc->n_slots;
        ggml_format_name(t, "llamapack_pool.%s", ti.name);
        // the backend may pad past the last slot (CUDA pads quantized rows to 512 elements)
        if (desc->tensor_offsets[i] + ggml_backend_buffer_get_alloc_size(pool_buf.get(), t) > desc->size) {
            return attach_error(hook, std::string(ti.name) + ": the backend needs " +
                                std::to_string(ggml_backend_buffer_get_alloc_size(pool_buf.get(), t)) +
                                " bytes from offset " + std::to_string(desc->tensor_offsets[i]) +
                                ", past the end of the pool (" + std::to_string(desc->size) + " bytes)");
        }
        if (ggml_backend_tensor_alloc(pool_buf.get(), t, base + desc->tensor_offsets[i]) != GGML_STATUS_SUCCESS) {
            return attach_error(hook, std::string(ti.name) + ": could not place the pool view");
        }
        pool_tensor[info->weights[i]] = t;

        auto & b = binding_by_layer[ti.layer];
        if (b == nullptr) {
            bindings.push_back(std::make_unique<llama_expert_layer_binding>(
                    llama_expert_layer_binding{hook, ti.layer, (int32_t) ti.ne[2]}));
            b = bindings.back().get();
        }
        binding_of[info->weights[i]] = b;
    }

    {
        std::vector<int32_t> served;
        for (auto & [layer, b] : binding_by_layer) {
            served.push_back(layer);
        }
        std::sort(served.begin(), served.end());
        for (size_t i = 0; i < served.size(); ++i) {
            binding_by_layer[served[i]]->position = (int32_t) i;
            binding_by_layer[served[i]]->next = i + 1 < served.size() ? binding_by_layer[served[i + 1]] : nullptr;
        }
    }

    // each served layer's lookahead targets: the following layers, while they are served and have a router
    for (auto & [layer, b] : binding_by_layer) {
        for (int32_t next = layer + 1; next - layer <= LLAMA_EXPERT_MAX_LOOKAHEAD &&
                next < (int32_t) model.layers.size() && binding_by_layer.count(next) != 0 &&
                model.layers[next].ffn_gate_inp != nullptr; ++next) {
            b->ahead.push_back({next, model.layers[next].ffn_gate_inp, model.layers[next].ffn_gate_inp_b});
        }
    }

    // slot lookup: one map per served layer in pinned host memory of the pool's GPU (plain host memory if none)
    ggml_context_ptr        map_ctx;
    ggml_backend_buffer_ptr map_buf;
    std::unordered_map<const ggml_tensor *, llama_expert_layer_binding *> binding_of_map;
    if (desc->device >= 0) {
        ggml_init_params map_params = {
            /*.mem_size   =*/ bindings.size() * ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        map_ctx.reset(ggml_init(map_params));
        for (auto & b : bindings) {
            b->slot_map = ggml_new_tensor_2d(map_ctx.get(), GGML_TYPE_I32, 1, b->n_expert);
            ggml_format_name(b->slot_map, "llamapack_slot_map-%d", b->layer);
            binding_of_map[b->slot_map] = b.get();
        }
        ggml_backend_buffer_type_t host = ggml_backend_dev_host_buffer_type(gpu_device(desc->device));
        map_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(map_ctx.get(), host ? host : ggml_backend_cpu_buffer_type()));
        if (!map_buf) {
            return attach_error(hook, "could not allocate the slot maps");
        }
        ggml_backend_buffer_clear(map_buf.get(), 0);
        // as a weight: the scheduler copies it into the split that reads it (where lookup_copy runs the step)
        ggml_backend_buffer_set_usage(map_buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }

    hook->map_ctx     = std::move(map_ctx);
    hook->map_buf     = std::move(map_buf);
    hook->binding_of_map = std::move(binding_of_map);
    hook->pool_ctx    = std::move(pool_ctx);
    hook->pool_buf    = std::move(pool_buf);
    hook->n_slots     = desc->n_slots;
    hook->pool_tensor = std::move(pool_tensor);
    hook->binding_of  = std::move(binding_of);
    hook->bindings    = std::move(bindings);
    hook->fast.reset(); // it points into the old pool
    hook->whole_pool = false; // the maps and the ring belong to the old bindings
    hook->whole_pool_buf.reset();
    hook->whole_pool_ctx.reset();
    hook->slot_view.clear(); // the views point into the old pool
    hook->slot_views_ctx.reset();
    hook->old_slot_views_ctx.reset();
    hook->ring = nullptr;
    hook->ring_per_layer = 0;
    hook->replay.reset();
    hook->generation++;
    hook->failed = false;
    llama_expert_access::need_reserve(*ctx);
    return 0;
}

int32_t llama_expert_provider_set(llama_context * ctx, llama_expert_provider_fn fn, void * user_data) {
    llama_expert_hook * hook = hook_of(ctx);
    if (hook->provider == nullptr) {
        // chain the user's abort callback behind ours, so a provider failure stops compute at once
        hook->user_abort      = llama_expert_access::abort_cb(*ctx);
        hook->user_abort_data = llama_expert_access::abort_data(*ctx);
        ctx->set_abort_callback(abort_trampoline, hook);
    }
    hook->provider      = fn;
    hook->provider_data = user_data;
    hook->generation++;
    hook->failed = false;
    llama_expert_access::need_reserve(*ctx);
    return 0;
}

int32_t llama_expert_prefetch_set(llama_context * ctx, llama_expert_prefetch_fn fn, void * user_data, int32_t depth) {
    llama_expert_hook * hook = hook_of(ctx);
    if (depth < 1 || depth > LLAMA_EXPERT_MAX_LOOKAHEAD) {
        hook->set_error("lookahead depth " + std::to_string(depth) + " outside [1, " +
                        std::to_string(LLAMA_EXPERT_MAX_LOOKAHEAD) + "]");
        return -1;
    }
    hook->prefetch       = fn;
    hook->prefetch_data  = user_data;
    hook->prefetch_depth = depth;
    hook->generation++; // the graph gains or loses the lookahead ops
    hook->whole_pool = false;
    llama_expert_access::need_reserve(*ctx);
    return 0;
}

void llama_expert_detach(llama_context * ctx) {
    if (!ctx->expert_hook) {
        return;
    }
    auto & hook = ctx->expert_hook;
    if (hook->provider != nullptr) {
        ctx->set_abort_callback(hook->user_abort, hook->user_abort_data);
    }
    // the graph must drop every reference to the pool before the pool goes
    llama_expert_access::need_reserve(*ctx);
    auto fresh = std::make_shared<llama_expert_hook>();
    fresh->model      = hook->model;
    fresh->ctx        = ctx;
    fresh->generation = hook->generation + 1;
    fresh->lookup_max_tokens  = hook->lookup_max_tokens; // settings of the context, not of the pool
    fresh->whole_pool_allowed = hook->whole_pool_allowed;
    hook = std::move(fresh);
}

int32_t llama_expert_slot_lookup_set(llama_context * ctx, int32_t max_tokens, bool whole_pool) {
    llama_expert_hook * hook = hook_of(ctx);
    if (max_tokens < 0) {
        hook->set_error("slot lookup: max_tokens " + std::to_string(max_tokens) + " is negative");
        return -1;
    }
    hook->lookup_max_tokens  = max_tokens;
    hook->whole_pool_allowed = whole_pool;
    hook->whole_pool         = false;
    hook->generation++; // graphs built from now on choose between the lookup and the op
    llama_expert_access::need_reserve(*ctx);
    update_whole_pool(hook, ctx); // on at once if the pool already holds every expert, else after a ubatch fills it
    return 0;
}

int32_t llama_expert_fast_path_set(llama_context * ctx, const llama_expert_fast_path_desc * desc) {
    llama_expert_hook * hook = hook_of(ctx);
    if (hook->whole_pool) {
        hook->whole_pool = false; // the maps come from the fast path's policy: written again after a ubatch
        hook->generation++;
        llama_expert_access::need_reserve(*ctx);
    }
    if (desc == nullptr) {
        hook->fast.reset();
        return 0;
    }
    std::string error;
    auto fast = llama_expert_fast_path::create(*desc, hook->pool_buf ? (char *) ggml_backend_buffer_get_base(hook->pool_buf.get())
                                                                     : nullptr, error);
    if (!fast) {
        hook->set_error(error);
        return -1;
    }
    hook->fast = std::move(fast);
    return 0;
}

int32_t llama_expert_fast_path_set_block(llama_context * ctx, int32_t block, void * addr) {
    llama_expert_hook * hook = hook_of(ctx);
    if (!hook->fast || !hook->fast->set_block(block, addr)) {
        hook->set_error("fast path: no RAM block " + std::to_string(block) + " to move");
        return -1;
    }
    return 0;
}

int32_t llama_expert_load_ahead_set(llama_context * ctx, int32_t min_tokens) {
    llama_expert_hook * hook = ctx ? ctx->expert_hook.get() : nullptr;
    if (hook == nullptr) {
        return -1;
    }
    hook->load_ahead_min_tokens = std::max(min_tokens, 0);
    hook->generation++; // graphs are rebuilt: the remap ops ask for the scheduler's copy callback
    return 0;
}

int32_t llama_expert_layer_windows_set(llama_context * ctx, int32_t min_tokens) {
    llama_expert_hook * hook = ctx ? ctx->expert_hook.get() : nullptr;
    if (hook == nullptr || !hook->pool_buf) {
        return -1;
    }
    int32_t n_window = 0, n_keys = 0;
    for (const auto & b : hook->bindings) {
        n_window = std::max(n_window, b->n_expert);
        n_keys  += b->n_expert;
    }
    if (min_tokens > 0 && hook->n_slots < 2 * n_window) {
        hook->set_error("layer windows need " + std::to_string(2 * n_window) + " slots (two layers' experts); the pool has " +
                        std::to_string(hook->n_slots));
        return -1;
    }
    hook->window_min_tokens = std::max(min_tokens, 0);
    hook->n_window = n_window;
    hook->n_window_keys = n_keys;
    if (hook->window_min_tokens > 0 && hook->window_view[0].empty()) {
        make_window_views(hook);
    }
    hook->generation++; // graphs are rebuilt with or without windows
    return 0;
}

int32_t llama_expert_fast_path_stats_get(const llama_context * ctx, llama_expert_fast_path_stats * out) {
    const llama_expert_hook * hook = ctx->expert_hook.get();
    *out = hook && hook->fast ? hook->fast->stats() : llama_expert_fast_path_stats{};
    return 0;
}

int32_t llama_expert_hybrid_set(llama_context * ctx, const llama_expert_hybrid_desc * desc) {
    llama_expert_hook * hook = hook_of(ctx);
    hook->generation++; // the graph gains or loses the CPU ops
    hook->whole_pool = false;
    llama_expert_access::need_reserve(*ctx);
    if (desc == nullptr) {
        hook->cpu.reset();
        hook->cpu_layers.clear();
        if (hook->fast) {
            hook->fast->set_upload_share(-1.0, false);
        }
        return 0;
    }
    if (!hook->fast || !hook->fast->has_tier() || hook->model == nullptr) {
        hook->set_error("hybrid: needs the native hot path with a RAM tier");
        return -1;
    }
    if (!(desc->upload_share >= 0.0 && desc->upload_share <= 1.0) || desc->max_tokens < 1 || desc->n_threads < 1 ||
            desc->tensor_block_offsets == nullptr) {
        hook->set_error("hybrid: upload_share must be in [0, 1], max_tokens and n_threads at least 1, with block offsets");
        return -1;
    }
    const auto & info = *hook->model->expert_info;
    std::unordered_map<int32_t, llama_expert_cpu_layer> layers;
    std::vector<int32_t> merged; // layers with a fused gate_up matrix: not split
    for (size_t i = 0; i < info.tensors.size(); ++i) {
        const auto & t = info.tensors[i];
        if (hook->binding_of.count(info.weights[i]) == 0) {
            continue; // not served by the pool
        }
        llama_expert_cpu_role role;
        role.type = t.type;
        role.ne0 = t.ne[0];
        role.ne1 = t.ne[1];
        role.block_offset = desc->tensor_block_offsets[i];
        auto & layer = layers[t.layer];
        switch (t.role) {
            case LLAMA_EXPERT_ROLE_GATE: layer.gate = role; break;
            case LLAMA_EXPERT_ROLE_UP:   layer.up   = role; break;
            case LLAMA_EXPERT_ROLE_DOWN: layer.down = role; break;
            default:                     merged.push_back(t.layer); break;
        }
    }
    for (int32_t layer : merged) {
        layers.erase(layer);
    }
    std::string error;
    auto cpu = llama_expert_cpu_experts::create(desc->n_threads, error);
    if (!cpu) {
        hook->set_error(error);
        return -1;
    }
    hook->cpu = std::move(cpu);
    hook->cpu_layers = std::move(layers);
    hook->hybrid_max_tokens = desc->max_tokens;
    hook->fast->set_upload_share(desc->upload_share, desc->fill_pool != 0);
    return 0;
}

double llama_expert_hybrid_probe(llama_context * ctx, int32_t layer, int32_t block, int32_t n_reps) {
    llama_expert_hook * hook = hook_of(ctx);
    auto it = hook->cpu ? hook->cpu_layers.find(layer) : hook->cpu_layers.end();
    const char * addr = hook->fast ? hook->fast->block_address(block) : nullptr;
    if (it == hook->cpu_layers.end() || addr == nullptr || n_reps < 1) {
        hook->set_error("hybrid probe: hybrid is off, layer " + std::to_string(layer) + " is not split, or block " +
                        std::to_string(block) + " is not in the tier");
        return -1.0;
    }
    llama_expert_cpu_layer shape = it->second;
    if (shape.glu < 0) {
        shape.glu = GGML_GLU_OP_SWIGLU; // timing only: before the first graph is built
    }
    const int64_t n_embd = shape.up.ne0;
    std::vector<float> input(n_embd, 0.0f), out(n_embd);
    std::vector<llama_expert_cpu_row> rows;
    std::string error;
    double total = 0.0;
    for (int32_t rep = 0; rep <= n_reps; ++rep) {
        rows.assign(1, { 0, 0, addr });
        const auto started = std::chrono::steady_clock::now();
        if (!hook->cpu->compute(shape, (const char *) input.data(), n_embd * sizeof(float), n_embd, rows, out.data(), error)) {
            hook->set_error("hybrid probe: " + error);
            return -1.0;
        }
        total += rep > 0 ? seconds_since(started) : 0.0; // the first run warms the threads
    }
    return total / n_reps;
}

int32_t llama_expert_bench_replay_set(llama_context * ctx, const int32_t * prompt_rows, int32_t n_prompt_rows,
        const int32_t * decode_rows, int32_t n_decode_rows, int32_t n_prompt, int32_t n_layers, int32_t top_k) {
    llama_expert_hook * hook = hook_of(ctx);
    hook->generation++; // the slot lookup serves only single-token ubatches while a replay is set
    if (prompt_rows == nullptr) {
        hook->replay.reset();
        return 0;
    }
    if (hook->bindings.empty() || n_layers != (int32_t) hook->bindings.size() || top_k < 1 || n_prompt < 0 ||
            n_prompt_rows < 1 || n_decode_rows < 1 || decode_rows == nullptr) {
        hook->set_error("routing replay: needs a pool, rows of every served layer (" + std::to_string(hook->bindings.size()) +
                        ", got " + std::to_string(n_layers) + ") and at least one prompt and one decode row");
        return -1;
    }
    const int64_t replaced = hook->replay ? hook->replay->substituted : 0;
    auto replay = std::make_unique<llama_expert_bench_replay>();
    const size_t width = (size_t) n_layers * top_k;
    replay->prompt_rows.assign(prompt_rows, prompt_rows + width * n_prompt_rows);
    replay->decode_rows.assign(decode_rows, decode_rows + width * n_decode_rows);
    replay->n_prompt = n_prompt;
    replay->n_layers = n_layers;
    replay->top_k    = top_k;
    replay->first_layer = INT32_MAX;
    for (const auto & b : hook->bindings) {
        replay->first_layer = std::min(replay->first_layer, b->layer);
    }
    replay->substituted = replaced;
    hook->replay = std::move(replay);
    return 0;
}

int64_t llama_expert_bench_replay_substituted(const llama_context * ctx) {
    const llama_expert_hook * hook = ctx->expert_hook.get();
    return hook && hook->replay ? hook->replay->substituted : 0;
}

const char * llama_expert_last_error(const llama_context * ctx) {
    const llama_expert_hook * hook = ctx->expert_hook.get();
    return hook ? hook->last_error.c_str() : "";
}

int32_t llama_expert_hook_stats_get(const llama_context * ctx, llama_expert_hook_stats * out) {
    const llama_expert_hook * hook = ctx->expert_hook.get();
    *out = hook ? hook->stats : llama_expert_hook_stats{};
    return 0;
}
