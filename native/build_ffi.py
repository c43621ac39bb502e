"""cffi definitions of the llamapack expert-hook C API (native/llama-expert.h).

Built out-of-line in ABI mode by setup.py (``cffi_modules``) into ``llamapack._expert_cffi``: no compiler
is needed, and the library is opened at run time (the one llama-cpp-python loaded).
"""
import cffi

CDEF = """
struct llama_model;
struct llama_context;

struct llama_expert_tensor_info {
    char     name[64];
    int32_t  layer;
    int32_t  role;
    int32_t  type;
    int32_t  file_idx;
    int64_t  ne[4];
    uint64_t nb[4];
    uint64_t file_offset;
    uint64_t nbytes;
    int32_t  lazy;
};

typedef int32_t (*llama_expert_provider_fn)(
        void * user_data, int32_t layer, const int32_t * expert_ids,
        int32_t n_expert_used, int32_t n_tokens, int32_t * slot_ids);

typedef void (*llama_expert_prefetch_fn)(
        void * user_data, int32_t layer, const int32_t * expert_ids, int32_t n_expert_used, int32_t n_tokens);

struct llama_expert_hook_stats {
    int64_t provider_calls;
    int64_t prefetch_calls;
    double  provider_s;
    double  prefetch_s;
    int64_t lookup_steps;
    int64_t whole_pool_steps;
    int64_t whole_pool_span;
};

struct llama_expert_pool_desc {
    void *           base;
    size_t           size;
    int32_t          n_slots;
    int32_t          device;
    const uint64_t * tensor_offsets;
    const uint64_t * tensor_strides;
};

int32_t llama_expert_api_version(void);
void    llama_expert_set_lazy_load(bool enable);
int32_t llama_model_expert_tensor_count(const struct llama_model * model);
int32_t llama_model_expert_tensor_get(const struct llama_model * model, int32_t i, struct llama_expert_tensor_info * out);
int32_t llama_expert_pool_attach(struct llama_context * ctx, const struct llama_expert_pool_desc * desc);
void *  llama_expert_pool_base(const struct llama_context * ctx);
int32_t llama_expert_provider_set(struct llama_context * ctx, llama_expert_provider_fn fn, void * user_data);
int32_t llama_expert_prefetch_set(struct llama_context * ctx, llama_expert_prefetch_fn fn, void * user_data, int32_t depth);
int32_t llama_expert_hook_stats_get(const struct llama_context * ctx, struct llama_expert_hook_stats * out);
void    llama_expert_detach(struct llama_context * ctx);
const char * llama_expert_last_error(const struct llama_context * ctx);

struct llama_expert_policy;
struct llama_expert_policy * llama_expert_policy_new(int32_t n_slots, double half_life, int32_t horizon, double rate_half_life);
void    llama_expert_policy_free(struct llama_expert_policy * policy);
int32_t llama_expert_policy_acquire(struct llama_expert_policy * policy, const int32_t * keys, int32_t n_keys,
                                    int32_t n_tokens, int32_t * out_keys, int32_t * out_slots, uint8_t * out_hits,
                                    int32_t * evicted_keys, int32_t * evicted_slots, int32_t * n_evicted);
int32_t llama_expert_policy_abandon(struct llama_expert_policy * policy, int32_t layer, int32_t expert);
int32_t llama_expert_policy_slot_of(const struct llama_expert_policy * policy, int32_t layer, int32_t expert);
int32_t llama_expert_policy_size(const struct llama_expert_policy * policy);
int32_t llama_expert_policy_layer_size(const struct llama_expert_policy * policy, int32_t layer);
int32_t llama_expert_policy_resident(const struct llama_expert_policy * policy, int32_t * keys, int32_t * slots, int32_t cap);
double  llama_expert_policy_frequency(const struct llama_expert_policy * policy, int32_t layer, int32_t expert);
double  llama_expert_policy_next_use(struct llama_expert_policy * policy, int32_t layer, int32_t expert);
int32_t llama_expert_policy_reuse_rates(const struct llama_expert_policy * policy, double * out, int32_t cap);
int32_t llama_expert_policy_popular_layers(const struct llama_expert_policy * policy, int32_t * layers, int32_t cap);
int32_t llama_expert_policy_popularity(const struct llama_expert_policy * policy, int32_t layer, double * shares, int32_t cap);
void    llama_expert_policy_seed(struct llama_expert_policy * policy, const int32_t * layers, const int32_t * n_shares,
                                 const double * shares, int32_t n_layers);
int32_t llama_expert_policy_preload(struct llama_expert_policy * policy, const int32_t * keys, int32_t n_keys,
                                    int32_t * load_keys, int32_t * load_slots);
int32_t llama_expert_policy_load_ahead(struct llama_expert_policy * policy, const int32_t * keys, int32_t n_keys,
                                       const int32_t * pinned, int32_t n_pinned, int32_t * load_keys,
                                       int32_t * load_slots, int32_t * evicted_keys, int32_t * evicted_slots,
                                       int32_t * n_evicted);

struct llama_expert_policy;
typedef int32_t (*llama_expert_h2d_fn)(uint64_t dst, const void * src, size_t nbytes, void * stream);
typedef int32_t (*llama_expert_d2d_fn)(uint64_t dst, uint64_t src, size_t nbytes, void * stream);
typedef int32_t (*llama_expert_sync_fn)(void * stream);
struct llama_expert_copy_span {
    int32_t  layer;
    uint64_t pool_offset;
    uint64_t slot_stride;
    uint64_t block_offset;
    uint64_t nbytes;
};
struct llama_expert_fast_path_desc {
    struct llama_expert_policy * pool;
    struct llama_expert_policy * tier;
    int32_t                      tier_holds_every_key;
    int32_t                      n_blocks;
    void * const *               block_addrs;
    int32_t                      n_spans;
    const struct llama_expert_copy_span * spans;
    int32_t                      first_layer;
    llama_expert_h2d_fn          h2d;
    llama_expert_sync_fn         sync;
    void *                       stream;
    llama_expert_d2d_fn          d2d;
};
struct llama_expert_fast_path_stats {
    int64_t  steps;
    int64_t  tokens;
    int64_t  cache_hits;
    int64_t  cache_misses;
    int64_t  cache_evictions;
    int64_t  ram_hits;
    uint64_t h2d_bytes;
    double   seconds;
    double   copy_s;
    int64_t  cpu_experts;
    double   cpu_s;
    int64_t  ahead_loads;
    int64_t  ahead_unused;
    int64_t  ahead_early;
    double   ahead_early_s;
    int64_t  window_skipped;
    uint64_t d2d_bytes;
    int64_t  window_from_pool;
};
int32_t llama_expert_slot_lookup_set(struct llama_context * ctx, int32_t max_tokens, bool whole_pool);
int32_t llama_expert_fast_path_set(struct llama_context * ctx, const struct llama_expert_fast_path_desc * desc);
int32_t llama_expert_fast_path_set_block(struct llama_context * ctx, int32_t block, void * addr);
int32_t llama_expert_fast_path_stats_get(const struct llama_context * ctx, struct llama_expert_fast_path_stats * out);
int32_t llama_expert_load_ahead_set(struct llama_context * ctx, int32_t min_tokens);
int32_t llama_expert_layer_windows_set(struct llama_context * ctx, int32_t min_tokens);

struct llama_expert_hybrid_desc {
    double           upload_share;
    int32_t          n_threads;
    int32_t          max_tokens;
    const uint64_t * tensor_block_offsets;
    int32_t          fill_pool;
};
int32_t llama_expert_hybrid_set(struct llama_context * ctx, const struct llama_expert_hybrid_desc * desc);
double  llama_expert_hybrid_probe(struct llama_context * ctx, int32_t layer, int32_t block, int32_t n_reps);

int32_t llama_expert_bench_replay_set(struct llama_context * ctx, const int32_t * prompt_rows, int32_t n_prompt_rows,
        const int32_t * decode_rows, int32_t n_decode_rows, int32_t n_prompt, int32_t n_layers, int32_t top_k);
int64_t llama_expert_bench_replay_substituted(const struct llama_context * ctx);

struct llama_expert_read_pool;
struct llama_expert_read_status {
    int32_t  state;
    int32_t  error;
    uint64_t bytes;
    uint64_t order;
};
struct llama_expert_read_pool * llama_expert_read_pool_new(int32_t n_threads, int32_t max_prefetch);
void    llama_expert_read_pool_free(struct llama_expert_read_pool * pool);
int64_t llama_expert_read_submit(struct llama_expert_read_pool * pool, int32_t fd, void * dst,
                                 uint64_t offset, uint64_t nbytes, uint64_t align, bool prefetch);
int32_t llama_expert_read_promote(struct llama_expert_read_pool * pool, int64_t id);
int32_t llama_expert_read_cancel(struct llama_expert_read_pool * pool, int64_t id);
int32_t llama_expert_read_get_status(struct llama_expert_read_pool * pool, int64_t id, struct llama_expert_read_status * out);
int32_t llama_expert_read_wait_any(struct llama_expert_read_pool * pool, const int64_t * ids, int32_t n_ids, double timeout_s);
void    llama_expert_read_pool_hold(struct llama_expert_read_pool * pool, bool hold);
void    llama_expert_read_release(struct llama_expert_read_pool * pool, int64_t id);
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("llamapack._expert_cffi", None)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
