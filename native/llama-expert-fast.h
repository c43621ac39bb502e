// llamapack: the hook's native hot path (see llama_expert_fast_path_desc in llama-expert.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-fast.h. No llama.cpp internals: the remap op hands
// it one layer's expert ids; it either serves the step (slot ids written), declines it (the provider gets
// it, nothing changed) or fails it (error set, the step's loads abandoned).
#pragma once

#include "llama-expert.h"

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

class llama_expert_fast_path {
public:
    enum result { SERVED, DECLINED, FAILED };

    // nullptr with error set when the description does not hold together
    static std::unique_ptr<llama_expert_fast_path> create(
            const llama_expert_fast_path_desc & desc, char * pool_base, std::string & error);

    // ids: [n_tokens][n_used], each in [0, n_expert); slots written only when SERVED
    result serve(int32_t layer, int32_t n_expert, const int32_t * ids, int32_t n_used, int32_t n_tokens,
                 int32_t * slots, std::string & error);

    bool set_block(int32_t block, void * addr);

    const llama_expert_fast_path_stats & stats() const { return counts; }

private:
    llama_expert_fast_path() = default;

    result copy_loads(int32_t layer, int32_t n_tokens, std::string & error);

    llama_expert_policy * pool = nullptr;
    llama_expert_policy * tier = nullptr;
    bool                  tier_holds_every_key = false;
    std::vector<char *>   blocks;
    std::unordered_map<int32_t, std::vector<llama_expert_copy_span>> spans_of_layer;
    int32_t               first_layer = 0;
    char *                pool_base = nullptr;
    llama_expert_h2d_fn   h2d = nullptr;
    llama_expert_sync_fn  sync = nullptr;
    void *                stream = nullptr;

    llama_expert_fast_path_stats counts = {};

    // per step scratch (sized once per layer width, reused)
    std::vector<int32_t> position;  // expert id -> index among the step's distinct keys, -1: not in the step
    std::vector<int32_t> keys;      // distinct keys [n][2] in first-seen order
    std::vector<int32_t> out_keys, out_slots, evicted_keys, evicted_slots, load_keys, load_slots, load_blocks;
    std::vector<uint8_t> hits;
};
