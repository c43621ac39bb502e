// llamapack expert-provider hook: public C API.
//
// Copied into the vendored llama.cpp as include/llama-expert.h and included at the end of llama.h by
// patches/0001-expert-provider-hook.patch. The implementation is native/llama-expert.cpp.
//
// Model side: a model loaded while llama_expert_set_lazy_load(true) is in force keeps its routed-expert
// weights (ffn_{gate,up,down,gate_up}_exps.weight) lazy: mapped over the file, never read or allocated.
// Context side: attach a slot pool and register a provider. In every MoE layer, after the router picked
// the top-k experts, a CPU op hands the expert ids to the provider, which makes those experts resident in
// pool slots and writes one slot id per (token, expert). The expert matmuls then run on the pool with the
// slot ids; biases, scales and LoRA keep the original ids.
#ifndef LLAMA_EXPERT_H
#define LLAMA_EXPERT_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef LLAMA_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        ifdef LLAMA_BUILD
#            define LLAMA_EXPERT_API __declspec(dllexport)
#        else
#            define LLAMA_EXPERT_API __declspec(dllimport)
#        endif
#    else
#        define LLAMA_EXPERT_API __attribute__ ((visibility ("default")))
#    endif
#else
#    define LLAMA_EXPERT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct llama_context;

#define LLAMA_EXPERT_API_VERSION 14

// the most layers ahead a router lookahead guesses (llama_expert_prefetch_set's depth)
#define LLAMA_EXPERT_MAX_LOOKAHEAD 8

enum llama_expert_role {
    LLAMA_EXPERT_ROLE_GATE    = 0,
    LLAMA_EXPERT_ROLE_UP      = 1,
    LLAMA_EXPERT_ROLE_DOWN    = 2,
    LLAMA_EXPERT_ROLE_GATE_UP = 3,
};

// One routed-expert weight tensor of the loaded model (all experts of one role in one layer).
struct llama_expert_tensor_info {
    char     name[64];    // e.g. "blk.3.ffn_up_exps.weight"
    int32_t  layer;       // model layer index (the N of blk.N)
    int32_t  role;        // enum llama_expert_role
    int32_t  type;        // enum ggml_type
    int32_t  file_idx;    // split index of the file holding the bytes
    int64_t  ne[4];       // ne[2] = number of experts
    uint64_t nb[4];       // nb[2] = bytes of one expert
    uint64_t file_offset; // absolute offset of the tensor data in its file
    uint64_t nbytes;      // whole tensor
    int32_t  lazy;        // 1 when the bytes were left on disk (never read by llama.cpp)
};

LLAMA_EXPERT_API int32_t llama_expert_api_version(void);

// Models loaded while this is true keep their routed-expert weights lazy. Process-wide; set it right
// before llama_model_load_from_file and reset it right after.
LLAMA_EXPERT_API void llama_expert_set_lazy_load(bool enable);

LLAMA_EXPERT_API int32_t llama_model_expert_tensor_count(const struct llama_model * model);
// Returns 0 on success, -1 when i is out of range.
LLAMA_EXPERT_API int32_t llama_model_expert_tensor_get(
        const struct llama_model * model, int32_t i, struct llama_expert_tensor_info * out);

// Make the experts of `layer` resident and write one slot id per id: expert_ids and slot_ids are
// [n_tokens][n_expert_used], row-major. Return 0 on success; anything else fails the decode.
typedef int32_t (*llama_expert_provider_fn)(
        void * user_data, int32_t layer, const int32_t * expert_ids,
        int32_t n_expert_used, int32_t n_tokens, int32_t * slot_ids);

// Router lookahead (optional): a guess at the experts of a later served layer, made by applying that
// layer's router (logits, plus its bias when it has one) to this layer's FFN input, top n_expert_used.
// Called right after this layer's provider call succeeded, once per guessed layer (the next `depth`
// served layers, nearest first), with expert_ids [n_tokens][n_expert_used] of `layer` (the guessed one).
// Advisory: compute always uses the router's real choice; nothing is returned.
typedef void (*llama_expert_prefetch_fn)(
        void * user_data, int32_t layer, const int32_t * expert_ids, int32_t n_expert_used, int32_t n_tokens);

// A slot pool of n_slots slots in [base, base + size). Slot s of the tensor with index i (as in
// llama_model_expert_tensor_get) starts at base + tensor_offsets[i] + s*tensor_strides[i]. Kernels index
// experts in whole blocks (nb02 / type size), so each stride must be a multiple of its type size.
//
// device = -1: a host pool the caller owns (base != NULL), computed by the CPU backend.
// device >= 0: base must be NULL; libllama allocates `size` bytes on that GPU through ggml (zero-filled)
// and the caller gets the address from llama_expert_pool_base() to fill slots (e.g. CuPy UnownedMemory).
struct llama_expert_pool_desc {
    void *           base;
    size_t           size;
    int32_t          n_slots;
    int32_t          device;          // -1: host memory; >= 0: index among the GPU devices
    const uint64_t * tensor_offsets;  // llama_model_expert_tensor_count(model) entries
    const uint64_t * tensor_strides;  // same
};

// Returns 0 on success; on error returns -1 and llama_expert_last_error() says why.
LLAMA_EXPERT_API int32_t llama_expert_pool_attach(struct llama_context * ctx, const struct llama_expert_pool_desc * desc);
// The pool's base address (host or device pointer), NULL when none is attached.
LLAMA_EXPERT_API void *  llama_expert_pool_base(const struct llama_context * ctx);
LLAMA_EXPERT_API int32_t llama_expert_provider_set(struct llama_context * ctx, llama_expert_provider_fn fn, void * user_data);
// fn NULL turns lookahead off. Graphs built while it is on hold `depth` (1..LLAMA_EXPERT_MAX_LOOKAHEAD)
// more small matmuls and top-ks per layer: guesses for the next `depth` consecutive served layers.
LLAMA_EXPERT_API int32_t llama_expert_prefetch_set(
        struct llama_context * ctx, llama_expert_prefetch_fn fn, void * user_data, int32_t depth);
// Drops pool and provider. With lazy experts the context then refuses to decode.
LLAMA_EXPERT_API void    llama_expert_detach(struct llama_context * ctx);
// Slot lookup (API version 8): for a GPU pool, a served layer of a ubatch of at most max_tokens tokens (0, the
// default: never) is remapped without the CPU remap op. The graph looks the router's ids up in a per-layer
// slot map (an I32 [1, n_expert] host tensor, get_rows on the pool's GPU); the scheduler copies that map into
// the GPU's split right before the experts' matmuls, and that copy is where libllama reads the ids back, runs
// the step (routing replay, native hot path or provider, as the op does), writes the map's entries of the
// step's experts and copies the map asynchronously. One split boundary per layer instead of the op's two,
// and no CPU graph. Layers the op must serve keep it: router lookahead on, a hybrid split, a host pool, a GPU
// that reads host memory in place (integrated), or, while a routing replay is set, ubatches of more than one
// token. A step that would give one expert two slots fails the decode. Graphs built from now on use it.
// whole_pool (API 9): with the native hot path, no hybrid and no lookahead, once the pool holds every expert of
// every served layer (checked now and after each ubatch), graphs are rebuilt to look slots up on the pool's device in
// static maps written from the pool's policy: no split, no callback, no synchronize per layer, on a GPU or a host
// pool, for ubatches of any size. Each layer's ids are also copied into a ring on that device, and the steps
// are served from it in graph order after the ubatch (same bookkeeping, decisions and counters); one that is
// not all hits fails the decode and ends whole-pool graphs. Under a routing replay the kernels read the
// router's own experts (all resident), the bookkeeping the replayed ones.
LLAMA_EXPERT_API int32_t llama_expert_slot_lookup_set(struct llama_context * ctx, int32_t max_tokens, bool whole_pool);
// Wall time inside the provider and prefetch callbacks as seen from libllama (since the pool was last
// attached): the gap to the callbacks' own timing is the cost of entering them (for Python: the GIL).
struct llama_expert_hook_stats {
    int64_t provider_calls;
    int64_t prefetch_calls;
    double  provider_s;
    double  prefetch_s;
    int64_t lookup_steps;   // steps served through the slot lookup (llama_expert_slot_lookup_set)
    int64_t whole_pool_steps; // steps served after their ubatch from whole-pool graphs (whole_pool)
    int64_t whole_pool_span;  // the widest range of slots a layer's whole-pool matmuls saw when last turned on
};
LLAMA_EXPERT_API int32_t llama_expert_hook_stats_get(const struct llama_context * ctx, struct llama_expert_hook_stats * out);
// The last error of this context's hook (attach, provider failure, bad slot id), or "" when none.
LLAMA_EXPERT_API const char * llama_expert_last_error(const struct llama_context * ctx);

// ---- Cache policy (native/llama-expert-policy.cpp) ------------------------------------------------------
// The slot pool's default policy (NextUse, a port of llamapack/policy_next_use.py taking the same decisions)
// behind a C API, so that Python and the hook's native hot path share one instance. Keys are (layer, expert)
// pairs passed as int32 [n][2] arrays. Not thread-safe: one caller at a time.
struct llama_expert_policy;

// NULL when n_slots < 1, half_life <= 0, rate_half_life <= 0 or horizon < 1
LLAMA_EXPERT_API struct llama_expert_policy * llama_expert_policy_new(
        int32_t n_slots, double half_life, int32_t horizon, double rate_half_life);
LLAMA_EXPERT_API void    llama_expert_policy_free(struct llama_expert_policy * policy);
// One step. Outputs, each with room for n_keys entries: per distinct key in first-seen order its key
// (out_keys [n][2]), slot and hit (1/0); the evicted keys and their slots. Returns the number of distinct
// keys and sets *n_evicted, or -1 (nothing changed) when they outnumber the slots.
LLAMA_EXPERT_API int32_t llama_expert_policy_acquire(struct llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, int32_t n_tokens, int32_t * out_keys, int32_t * out_slots, uint8_t * out_hits,
        int32_t * evicted_keys, int32_t * evicted_slots, int32_t * n_evicted);
// 1 when the key was resident (now freed), 0 otherwise
LLAMA_EXPERT_API int32_t llama_expert_policy_abandon(struct llama_expert_policy * policy, int32_t layer, int32_t expert);
// the key's slot, -1 when not resident
LLAMA_EXPERT_API int32_t llama_expert_policy_slot_of(const struct llama_expert_policy * policy, int32_t layer, int32_t expert);
LLAMA_EXPERT_API int32_t llama_expert_policy_size(const struct llama_expert_policy * policy);
// resident keys of one layer
LLAMA_EXPERT_API int32_t llama_expert_policy_layer_size(const struct llama_expert_policy * policy, int32_t layer);
// writes up to cap resident keys ([n][2]) and slots; returns how many are resident
LLAMA_EXPERT_API int32_t llama_expert_policy_resident(const struct llama_expert_policy * policy, int32_t * keys,
        int32_t * slots, int32_t cap);
LLAMA_EXPERT_API double  llama_expert_policy_frequency(const struct llama_expert_policy * policy, int32_t layer, int32_t expert);
LLAMA_EXPERT_API double  llama_expert_policy_next_use(struct llama_expert_policy * policy, int32_t layer, int32_t expert);
// writes up to cap rates (age 1 first); returns horizon + 1
LLAMA_EXPERT_API int32_t llama_expert_policy_reuse_rates(const struct llama_expert_policy * policy, double * out, int32_t cap);
// popularity: the layers with visits > 0 in first-seen order (up to cap); returns how many there are
LLAMA_EXPERT_API int32_t llama_expert_policy_popular_layers(const struct llama_expert_policy * policy, int32_t * layers, int32_t cap);
// one layer's shares (count / visits) per expert id, up to cap; returns the number of expert ids, -1 if unseen
LLAMA_EXPERT_API int32_t llama_expert_policy_popularity(const struct llama_expert_policy * policy, int32_t layer,
        double * shares, int32_t cap);
// seed: n_layers layers, layer i with n_shares[i] shares, all shares concatenated in `shares`
LLAMA_EXPERT_API void    llama_expert_policy_seed(struct llama_expert_policy * policy, const int32_t * layers,
        const int32_t * n_shares, const double * shares, int32_t n_layers);
// preload: writes the loads' keys ([n][2]) and slots (room for n_keys); returns how many
LLAMA_EXPERT_API int32_t llama_expert_policy_preload(struct llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, int32_t * load_keys, int32_t * load_slots);
// load_ahead (API 11; the reference's NextUsePolicy.load_ahead): slots for the keys not resident, never evicting
// the resident keys of `pinned` ([n_pinned][2]) or `keys`; writes the loads (room for n_keys) and the victims (room
// for n_keys); returns how many loads, -2 on a negative id (nothing changed)
LLAMA_EXPERT_API int32_t llama_expert_policy_load_ahead(struct llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, const int32_t * pinned, int32_t n_pinned, int32_t * load_keys, int32_t * load_slots,
        int32_t * evicted_keys, int32_t * evicted_slots, int32_t * n_evicted);

// ---- Native hot path ------------------------------------------------------------------------------------
// With a fast path set, the remap op asks the pool's policy (the same instance the provider acquires from)
// before calling the provider: a step whose experts are all resident is answered here (the policy's
// acquire, then slot ids); with a RAM tier, a step whose every pool miss is in a RAM block is served here
// too: the pool policy's plan (victims included), the tier policy's acquire of the misses (skipped when the
// tier holds every key: it never evicts), one copy per role from the RAM block to the slot, then a
// synchronize. Any other step (a read from the SSD, a step larger than the pool) goes to the provider as
// before, with nothing changed. A failed copy abandons the step's loads (their slots hold no expert) and
// fails the decode.
// h2d: NULL for a host pool (memcpy); else cuMemcpyHtoDAsync_v2's signature, with sync cuStreamSynchronize's.
// d2d (API 14): cuMemcpyDtoDAsync_v2's signature, for a layer window's experts already in the pool; NULL: a
// device pool copies them from RAM too (a host pool uses memcpy either way).
typedef int32_t (*llama_expert_h2d_fn)(uint64_t dst, const void * src, size_t nbytes, void * stream);
typedef int32_t (*llama_expert_d2d_fn)(uint64_t dst, uint64_t src, size_t nbytes, void * stream);
typedef int32_t (*llama_expert_sync_fn)(void * stream);

// one role of a layer's experts: the slot's bytes start at pool base + pool_offset + slot * slot_stride, the
// block's at block address + block_offset
struct llama_expert_copy_span {
    int32_t  layer;
    uint64_t pool_offset;
    uint64_t slot_stride;
    uint64_t block_offset;
    uint64_t nbytes;
};

struct llama_expert_fast_path_desc {
    struct llama_expert_policy * pool;            // the slot pool's policy
    struct llama_expert_policy * tier;            // the RAM tier's, NULL: no tier (only all-hit steps here)
    int32_t                      tier_holds_every_key;
    int32_t                      n_blocks;
    void * const *               block_addrs;     // n_blocks host addresses (the tier's RAM blocks)
    int32_t                      n_spans;
    const struct llama_expert_copy_span * spans;  // every role of every served layer
    int32_t                      first_layer;     // a step of this layer counts its tokens
    llama_expert_h2d_fn          h2d;
    llama_expert_sync_fn         sync;
    void *                       stream;
    llama_expert_d2d_fn          d2d;             // (API 14) may be NULL
};

struct llama_expert_fast_path_stats {
    int64_t  steps;       // steps served without the provider
    int64_t  tokens;
    int64_t  cache_hits;
    int64_t  cache_misses;
    int64_t  cache_evictions;
    int64_t  ram_hits;
    uint64_t h2d_bytes;   // 0 for a host pool
    double   seconds;     // wall time serving them (copies included)
    double   copy_s;      // issuing the copies and waiting for them
    int64_t  cpu_experts; // hybrid: (step, expert) pairs computed on the CPU from RAM blocks (counted in ram_hits)
    double   cpu_s;       // hybrid: wall time computing them
    int64_t  ahead_loads;  // load-ahead (API 11): experts copied in before their step (counted as that step's misses)
    int64_t  ahead_unused; // of those, the ones their step did not ask for
    int64_t  ahead_early;  // (API 13) of those, the ones whose copies the scheduler's copy callback started, while
                           // the GPU computed the layer before (the others: started by their own step)
    double   ahead_early_s; // issuing those copies (inside copy_s)
    int64_t  window_skipped; // (API 14) layer windows: experts planned into a window and never copied (their step
                             // did not use them, or no window step came), with ahead_unused the waste avoided
    uint64_t d2d_bytes;      // (API 14) layer windows: bytes copied into a window from the expert's pool slot
    int64_t  window_from_pool; // (API 14) layer windows: experts copied into a window from their pool slot
};

// desc NULL: off. The policies and blocks must outlive the fast path (set NULL before freeing them).
LLAMA_EXPERT_API int32_t llama_expert_fast_path_set(struct llama_context * ctx, const struct llama_expert_fast_path_desc * desc);
// a RAM block's memory was replaced (after an abandoned read): copies come from addr from now on
LLAMA_EXPERT_API int32_t llama_expert_fast_path_set_block(struct llama_context * ctx, int32_t block, void * addr);
LLAMA_EXPERT_API int32_t llama_expert_fast_path_stats_get(const struct llama_context * ctx, struct llama_expert_fast_path_stats * out);

// Load-ahead (API 11): after the remap op served a step of at least min_tokens tokens (a prefill ubatch; 0: off),
// the next served layer's experts that are in neither the pool nor the step get slots from the pool's policy
// (llama_expert_policy_load_ahead: the step's experts are kept) and their copies from the RAM tier start on the
// provider's stream while this layer's matmuls run; the next step waits for them. Only with the native hot
// path and a RAM tier that holds every expert (no SSD read, no block rewritten). The pool's policy then sees
// one more call per layer (no visit: nothing learned); the kernels' inputs are unchanged (same experts, same
// bytes), so results stay bit-identical. -1: no hook.
LLAMA_EXPERT_API int32_t llama_expert_load_ahead_set(struct llama_context * ctx, int32_t min_tokens);

// Layer windows (API 12): a ubatch of at least min_tokens tokens (0: off) reads each served layer's experts from
// one of two windows of pool slots: window w is slots [w * n, w * n + n_expert), n the widest layer's n_expert,
// expert e in slot w * n + e, so the matmuls see a tensor of the model's own shape. Layer i's step (the i-th
// served layer) uses window i % 2 and starts copying every expert of the next served layer from the RAM tier
// into the other window, after the scheduler's copy of this layer's ids, while this layer computes; the next
// step waits for them. The first window step after any other takes the windows' slots from the pool's policy
// (their experts are forgotten); window steps do not change the policy otherwise, and count each expert as a
// miss served from RAM (ahead_loads / ahead_unused: loaded ahead / not asked for). Only with the native hot
// path and a RAM tier that holds every expert, no lookahead, no hybrid split of the layer; otherwise the
// ubatch takes the other paths. Same experts, same bytes: results stay bit-identical. -1 (error set): no pool,
// or fewer than 2 n slots.
LLAMA_EXPERT_API int32_t llama_expert_layer_windows_set(struct llama_context * ctx, int32_t min_tokens);

// ---- Hybrid execution (native/llama-expert-hybrid.cpp) ----------------------------------------------------
// With the native hot path set with a RAM tier, a step it serves may leave some of its pool misses in their
// RAM blocks and compute those (token, expert) rows on the CPU with ggml's CPU kernels (mul_mat_id gate and
// up, the layer's GLU, mul_mat_id down: the ops --cpu-moe runs on the CPU) while the other rows run on the
// pool as before; the graph then picks each row from its side before the weighted sum, in the model's order.
// Of a step's misses in RAM, the first round(n * upload_share) (first-seen order) are copied into the pool
// before the step's GPU work, while the CPU computes the others. fill_pool 1: the CPU's experts are copied
// into the pool too, after the CPU's work and without the step waiting for them (when the tier holds every
// key and never rewrites a block; otherwise beside the other copies), so the pool's policy decides as without
// hybrid and later steps hit them; 0: they stay out of the pool (with upload_share 0 the pool then never
// changes on a split step: every RAM miss runs on the CPU, the --cpu-moe endpoint). Only ubatches of at most
// max_tokens tokens, and layers whose experts have gate, up and down matrices with a plain SiLU or GELU GLU
// (no biases, scales, clamps, or weights applied before the FFN) are split; every other step runs on the GPU
// as without hybrid.
struct llama_expert_hybrid_desc {
    double           upload_share;         // in [0, 1]
    int32_t          n_threads;            // CPU threads computing experts (a pool of their own)
    int32_t          max_tokens;           // larger ubatches keep every expert on the GPU
    const uint64_t * tensor_block_offsets; // per expert tensor (llama_model_expert_tensor_get's index): its offset in a RAM block
    int32_t          fill_pool;            // 1: the CPU's experts are copied into the pool behind the step
};
// desc NULL: off. Needs the fast path with a RAM tier; graphs built from now on carry the CPU op.
LLAMA_EXPERT_API int32_t llama_expert_hybrid_set(struct llama_context * ctx, const struct llama_expert_hybrid_desc * desc);
// Time computing one token's row of `layer`'s expert held in RAM block `block` on the CPU, mean of n_reps
// runs after one warm-up (seconds); -1 with llama_expert_last_error set when hybrid is off or the layer cannot run.
LLAMA_EXPERT_API double  llama_expert_hybrid_probe(struct llama_context * ctx, int32_t layer, int32_t block, int32_t n_reps);

// ---- Routing replay (benchmarks only) -------------------------------------------------------------------
// While set, the remap op replaces the router's ids by a recorded trace's before anything sees them (fast path
// and provider alike), so a synthetic model computes the experts a trained router chose. The outputs are NOT
// the model's: `llamapack bench --routing` uses it, nothing else. Rows are [n][n_layers][top_k] (n_layers:
// the served layers, ascending; top_k must be n_expert_used). Token t of the request takes prompt row
// t mod n_prompt_rows while t < n_prompt, then decode row (t - n_prompt) mod n_decode_rows. The first served
// layer of each ubatch moves the token cursor past the ubatch; a layer given fewer tokens (llama.cpp's last
// layer keeps only the tokens it outputs) gets the ubatch's last ones. Setting it starts a request (cursor 0);
// prompt_rows NULL: off.
LLAMA_EXPERT_API int32_t llama_expert_bench_replay_set(struct llama_context * ctx, const int32_t * prompt_rows,
        int32_t n_prompt_rows, const int32_t * decode_rows, int32_t n_decode_rows, int32_t n_prompt,
        int32_t n_layers, int32_t top_k);
// ids substituted since the pool was attached
LLAMA_EXPERT_API int64_t llama_expert_bench_replay_substituted(const struct llama_context * ctx);

// ---- Expert read pool (native/llama-expert-io.cpp) ----------------------------------------------------
// Threads that pread byte ranges of already opened files into caller memory, without Python's GIL. Two
// queues: demand reads always start before queued prefetch reads; a prefetch read starts only while no
// demand read is queued or running, and at most max_prefetch of them run at once, so n_threads -
// max_prefetch threads are always there for demand reads. A read is never preempted once running.
// The caller keeps dst valid and the fd open until the read is no longer queued or running.
struct llama_expert_read_pool;

enum llama_expert_read_state {
    LLAMA_EXPERT_READ_QUEUED    = 0,
    LLAMA_EXPERT_READ_RUNNING   = 1,
    LLAMA_EXPERT_READ_DONE      = 2,  // bytes may be short of nbytes (end of file)
    LLAMA_EXPERT_READ_FAILED    = 3,  // error holds the errno
    LLAMA_EXPERT_READ_CANCELLED = 4,
};

struct llama_expert_read_status {
    int32_t  state;   // enum llama_expert_read_state
    int32_t  error;   // errno of the failed pread, 0 otherwise
    uint64_t bytes;   // bytes read
    uint64_t order;   // when it started: 1 for the pool's first read, 2 for the next...; 0 while queued
};

// NULL when 0 <= max_prefetch < n_threads does not hold or a thread cannot start.
LLAMA_EXPERT_API struct llama_expert_read_pool * llama_expert_read_pool_new(int32_t n_threads, int32_t max_prefetch);
// Cancels the queued reads, waits for the running ones, stops the threads. NULL is a no-op.
LLAMA_EXPERT_API void    llama_expert_read_pool_free(struct llama_expert_read_pool * pool);
// Queue a read of nbytes at offset into dst; a read that ends off a multiple of `align` (O_DIRECT's block
// size; 0: any) stops there, as at the end of the file. Returns the read's id (> 0), or -1 once freeing.
LLAMA_EXPERT_API int64_t llama_expert_read_submit(struct llama_expert_read_pool * pool, int32_t fd, void * dst,
        uint64_t offset, uint64_t nbytes, uint64_t align, bool prefetch);
// Move a queued prefetch read to the end of the demand queue. Returns 1 when moved, 0 otherwise.
LLAMA_EXPERT_API int32_t llama_expert_read_promote(struct llama_expert_read_pool * pool, int64_t id);
// Cancel a queued read. Returns 1 when it was queued (now cancelled), 0 otherwise (running or finished).
LLAMA_EXPERT_API int32_t llama_expert_read_cancel(struct llama_expert_read_pool * pool, int64_t id);
// Returns 0 and fills out, or -1 for an unknown (or released and finished) id.
LLAMA_EXPERT_API int32_t llama_expert_read_get_status(struct llama_expert_read_pool * pool, int64_t id,
        struct llama_expert_read_status * out);
// Wait until at least one of ids is finished (done, failed, cancelled or unknown), or timeout_s seconds
// (< 0: forever). Returns how many of ids are finished; 0 after a timeout.
LLAMA_EXPERT_API int32_t llama_expert_read_wait_any(struct llama_expert_read_pool * pool, const int64_t * ids,
        int32_t n_ids, double timeout_s);
// While held, no queued read starts (running ones go on): to queue a batch before any of it starts.
LLAMA_EXPERT_API void    llama_expert_read_pool_hold(struct llama_expert_read_pool * pool, bool hold);
// Forget a read: a queued one is cancelled; a running one is forgotten when it finishes.
LLAMA_EXPERT_API void    llama_expert_read_release(struct llama_expert_read_pool * pool, int64_t id);

#ifdef __cplusplus
}
#endif

#endif // LLAMA_EXPERT_H
