// llamapack: the slot pool's default cache policy (NextUse) in C++, for the hook's native hot path.
//
// Copied into the vendored llama.cpp as src/llama-expert-policy.h. Pure bookkeeping: no llama.cpp or ggml
// types, no I/O. It is a port of llamapack/policy_next_use.py (the reference, whose docstring explains the
// estimate) and must take the same decisions, step by step, bit for bit: same hits, same slots, same
// victims (tests/test_policy_native.py replays traces through both). Floating-point work follows the
// reference's order of operations exactly (no FMA contraction, sums in the reference's order).
#pragma once

#include <cstdint>
#include <vector>

struct llama_expert_key {
    int32_t layer;
    int32_t expert;
};

struct llama_expert_assignment {
    llama_expert_key key;
    int32_t          slot;
    bool             hit;
};

struct llama_expert_eviction {
    llama_expert_key key;
    int32_t          slot;
};

struct llama_expert_next_use_impl;

class llama_expert_next_use {
public:
    // half_life: visits of a layer; horizon: age classes; rate_half_life: acquires (reference defaults 32, 32, 1024)
    llama_expert_next_use(int32_t n_slots, double half_life, int32_t horizon, double rate_half_life);
    ~llama_expert_next_use();
    llama_expert_next_use(const llama_expert_next_use &) = delete;
    llama_expert_next_use & operator=(const llama_expert_next_use &) = delete;

    int32_t n_slots() const;

    // One step: keys may repeat; out gets one assignment per distinct key in first-seen order, evicted the
    // victims in eviction order. n_tokens as in the reference (only n_tokens == 1 teaches the estimate).
    // Returns false, changing nothing, when the distinct keys outnumber the slots.
    bool acquire(const llama_expert_key * keys, int32_t n_keys, int32_t n_tokens,
                 std::vector<llama_expert_assignment> & out, std::vector<llama_expert_eviction> & evicted);

    // true when every key is resident (a step acquire would hit everywhere); changes nothing
    bool all_resident(const llama_expert_key * keys, int32_t n_keys) const;

    bool    abandon(llama_expert_key key);       // false when not resident
    int32_t slot_of(llama_expert_key key) const; // -1 when not resident
    int32_t size() const;                        // resident keys
    int32_t layer_size(int32_t layer) const;     // resident keys of that layer
    void    resident(std::vector<std::pair<llama_expert_key, int32_t>> & out) const;

    // the estimate (tests, warm start), as in the reference
    double frequency(llama_expert_key key) const;
    void   reuse_rates(std::vector<double> & out) const;   // horizon + 1 values, age 1 first
    double next_use(llama_expert_key key);                 // +inf when not ranked
    // per layer seen with visits > 0, in first-seen order: (layer, each expert's count / visits)
    void   popularity(std::vector<std::pair<int32_t, std::vector<double>>> & out) const;
    // before the first acquire: layers already seen are left alone; n_layers is len(popularity) in the reference
    void   seed(const std::vector<std::pair<int32_t, std::vector<double>>> & popularity);
    void   preload(const llama_expert_key * keys, int32_t n_keys, std::vector<llama_expert_assignment> & loads);
    // the reference's load_ahead: slots for `keys` not resident, never evicting the resident ones of `pinned` or
    // `keys` (stops when nothing else is left to evict); not a visit. False, changing nothing, on a negative id.
    bool   load_ahead(const llama_expert_key * keys, int32_t n_keys, const llama_expert_key * pinned, int32_t n_pinned,
                      std::vector<llama_expert_assignment> & loads, std::vector<llama_expert_eviction> & evicted);

private:
    llama_expert_next_use_impl * impl;
};
