// llamapack: the hook's native hot path (contract: llama_expert_fast_path_desc in llama-expert.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-fast.cpp. It decides nothing itself: the pool's
// and the tier's policies (llama-expert-policy.cpp, the same instances the Python provider uses) decide; it
// only spares the step a trip through the provider when no SSD read is needed.
#include "llama-expert-fast.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

static double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

std::unique_ptr<llama_expert_fast_path> llama_expert_fast_path::create(
        const llama_expert_fast_path_desc & desc, char * pool_base, std::string & error) {
    if (desc.pool == nullptr || pool_base == nullptr) {
        error = "fast path: needs the pool's policy and an attached pool";
        return nullptr;
    }
    if (desc.tier != nullptr && (desc.n_blocks < 1 || desc.block_addrs == nullptr || desc.n_spans < 1 ||
                                 desc.spans == nullptr)) {
        error = "fast path: a RAM tier needs its block addresses and the copy spans";
        return nullptr;
    }
    if ((desc.h2d == nullptr) != (desc.sync == nullptr)) {
        error = "fast path: a device pool needs both the copy and the synchronize functions";
        return nullptr;
    }
    std::unique_ptr<llama_expert_fast_path> fast(new llama_expert_fast_path());
    fast->pool                 = desc.pool;
    fast->tier                 = desc.tier;
    fast->tier_holds_every_key = desc.tier_holds_every_key != 0;
    fast->first_layer          = desc.first_layer;
    fast->pool_base            = pool_base;
    fast->h2d                  = desc.h2d;
    fast->d2d                  = desc.d2d;
    fast->sync                 = desc.sync;
    fast->stream               = desc.stream;
    if (const char * early = std::getenv("LLAMAPACK_WINDOW_EARLY"); early != nullptr && *early != '\0') {
        fast->window_early = std::atoi(early);
    }
    if (const char * from_pool = std::getenv("LLAMAPACK_WINDOW_FROM_POOL"); from_pool != nullptr) {
        fast->window_from_pool = std::string(from_pool) != "0";
    }
    if (desc.tier != nullptr) {
        for (int32_t i = 0; i < desc.n_blocks; ++i) {
            if (desc.block_addrs[i] == nullptr) {
                error = "fast path: RAM block " + std::to_string(i) + " has no address";
                return nullptr;
            }
            fast->blocks.push_back((char *) desc.block_addrs[i]);
        }
        for (int32_t i = 0; i < desc.n_spans; ++i) {
            fast->spans_of_layer[desc.spans[i].layer].push_back(desc.spans[i]);
        }
    }
    return fast;
}

bool llama_expert_fast_path::set_block(int32_t block, void * addr) {
    if (block < 0 || block >= (int32_t) blocks.size() || addr == nullptr) {
        return false;
    }
    blocks[block] = (char *) addr;
    return true;
}

llama_expert_fast_path::result llama_expert_fast_path::serve(
        int32_t layer, int32_t n_expert, const int32_t * ids, int32_t n_used, int32_t n_tokens, int32_t * slots,
        std::vector<llama_expert_cpu_row> * cpu_rows, std::string & error) {
    const auto started = std::chrono::steady_clock::now();
    const int32_t n_ids = n_used * n_tokens;
    // load-ahead's copies still unissued (no split input copy started them), then every copy left running; a
    // window's unissued loads are skipped: this step gives the windows back to the pool
    skip_window_loads_behind();
    if (!start_copies_behind(error) || (copies_pending && !finish_copies(error))) {
        return FAILED;
    }
    windows_owned = false;                        // the acquire below may give out window slots
    loads_are_windows = false;
    const bool ahead_step = layer == ahead_layer; // its flags are read when the step is served
    if (ahead_layer >= 0 && !ahead_step) {        // loaded ahead for a step that did not come next
        for (uint8_t flag : ahead_loaded) {
            counts.ahead_unused += flag;
        }
        ahead_layer = -1;
    }

    // the step's distinct keys in first-seen order (the policy's order too)
    if ((int32_t) position.size() < n_expert) {
        position.assign(n_expert, -1);
    }
    keys.clear();
    for (int32_t i = 0; i < n_ids; ++i) {
        if (position[ids[i]] < 0) {
            position[ids[i]] = (int32_t) keys.size() / 2;
            keys.push_back(layer);
            keys.push_back(ids[i]);
        }
    }
    const int32_t n_keys = (int32_t) keys.size() / 2;
    auto forget_positions = [&]() {
        for (int32_t k = 0; k < n_keys; ++k) {
            position[keys[2*k + 1]] = -1;
        }
    };

    // decline (nothing changed) unless every key is in the pool, or in the tier with copies possible here
    int32_t n_missing = 0;
    for (int32_t k = 0; k < n_keys; ++k) {
        if (llama_expert_policy_slot_of(pool, layer, keys[2*k + 1]) >= 0) {
            continue;
        }
        n_missing++;
        if (tier == nullptr || spans_of_layer.count(layer) == 0 ||
                llama_expert_policy_slot_of(tier, layer, keys[2*k + 1]) < 0) {
            forget_positions();
            return DECLINED;
        }
    }

    // hybrid: past the upload share, the misses stay in RAM and their rows run on the CPU; with fill_pool the
    // pool's policy still sees every key (its plan is the one without hybrid) and those misses are copied
    // into their slots after the CPU's work
    on_cpu.assign(n_keys, 0);
    int32_t n_cpu = 0, n_upload = n_missing;
    if (cpu_rows != nullptr && upload_share >= 0.0 && n_missing > 0) {
        n_upload = (int32_t) std::floor(n_missing * upload_share + 0.5);
        for (int32_t k = 0, seen = 0; k < n_keys; ++k) {
            if (llama_expert_policy_slot_of(pool, layer, keys[2*k + 1]) < 0 && seen++ >= n_upload) {
                on_cpu[k] = 1;
                n_cpu++;
            }
        }
    }
    const bool behind = n_cpu > 0 && fill_pool;
    pool_keys.clear();
    for (int32_t k = 0; k < n_keys; ++k) {
        if (!on_cpu[k] || behind) {
            pool_keys.push_back(layer);
            pool_keys.push_back(keys[2*k + 1]);
        }
    }
    const int32_t n_pool_keys = (int32_t) pool_keys.size() / 2;

    out_keys.resize(2 * n_keys); out_slots.resize(n_keys); hits.resize(n_keys);
    evicted_keys.resize(2 * n_keys); evicted_slots.resize(n_keys);
    int32_t n_evicted = 0;
    const int32_t n_tokens_policy = n_tokens > 0 ? n_tokens : 1;
    if (n_pool_keys > 0 &&
            llama_expert_policy_acquire(pool, pool_keys.data(), n_pool_keys, n_tokens_policy, out_keys.data(),
                                        out_slots.data(), hits.data(), evicted_keys.data(), evicted_slots.data(),
                                        &n_evicted) != n_pool_keys) {
        forget_positions();
        return DECLINED; // more keys than slots: the provider raises the capacity error
    }

    load_keys.clear(); load_slots.clear();
    for (int32_t k = 0; k < n_pool_keys; ++k) {
        if (!hits[k]) {
            load_keys.push_back(out_keys[2*k]);
            load_keys.push_back(out_keys[2*k + 1]);
            load_slots.push_back(out_slots[k]);
        }
    }
    const int32_t n_loads = (int32_t) load_slots.size();
    key_slot.assign(n_keys, 0); // a CPU row's slot: any valid one (with fill_pool its own), its GPU result is not used
    for (int32_t k = 0, p = 0; k < n_keys; ++k) {
        if (!on_cpu[k] || behind) {
            key_slot[k] = out_slots[p++];
        }
    }
    const int32_t n_to_load = behind ? n_missing : n_missing - n_cpu;
    if (n_loads != n_to_load) {
        error = "layer " + std::to_string(layer) + ": the pool's policy planned " + std::to_string(n_loads) +
                " loads for " + std::to_string(n_to_load) + " experts it did not hold";
        abandon_loads();
        forget_positions();
        return FAILED;
    }
    if (behind) {
        // the loads are the misses in first-seen order: the first n_upload now, the CPU's after its work (or
        // now too when the tier may rewrite a block before a late copy reads it); the CPU waits for them
        const int32_t n_now = tier_holds_every_key ? n_upload : n_loads;
        if (copy_loads(layer, n_tokens_policy, n_now, /*wait =*/ false, error) != SERVED ||
                !rows_from_loads(layer, n_keys, n_upload, *cpu_rows, ids, n_ids, n_used, error)) {
            forget_positions();
            return FAILED;
        }
    } else {
        if (n_cpu > 0 && !cpu_blocks(layer, n_keys, n_tokens_policy, *cpu_rows, ids, n_ids, n_used, error)) {
            abandon_loads();
            forget_positions();
            return FAILED;
        }
        if (n_loads > 0 && copy_loads(layer, n_tokens_policy, n_loads, /*wait =*/ n_cpu == 0, error) != SERVED) {
            forget_positions();
            return FAILED;
        }
    }

    for (int32_t i = 0; i < n_ids; ++i) {
        slots[i] = key_slot[position[ids[i]]];
    }
    forget_positions();
    int32_t n_ahead = 0; // hits loaded ahead for this step: counted as the misses they were
    if (ahead_step) {
        int32_t n_flagged = 0;
        for (uint8_t flag : ahead_loaded) {
            n_flagged += flag;
        }
        for (int32_t k = 0; k < n_keys; ++k) {
            n_ahead += ahead_loaded[keys[2*k + 1]];
        }
        counts.ahead_unused += n_flagged - n_ahead;
        ahead_layer = -1;
    }
    counts.steps++;
    counts.tokens          += layer == first_layer ? n_tokens : 0;
    const int32_t n_misses = (behind ? n_loads : n_loads + n_cpu) + n_ahead;
    counts.cache_hits      += n_pool_keys - n_loads - n_ahead;
    counts.cache_misses    += n_misses;
    counts.cache_evictions += n_evicted;
    counts.ram_hits        += n_misses;
    counts.cpu_experts     += n_cpu;
    counts.seconds         += seconds_between(started, std::chrono::steady_clock::now());
    return SERVED;
}

bool llama_expert_fast_path::load_ahead(int32_t layer, const int32_t * ids, int32_t n_ids, int32_t next_layer,
                                        int32_t n_expert_next, std::string & error) {
    if (tier == nullptr || !tier_holds_every_key || copies_pending || behind_layer >= 0 ||
            spans_of_layer.count(next_layer) == 0) {
        return true;
    }
    ahead_keys.clear();
    for (int32_t e = 0; e < n_expert_next; ++e) {
        if (llama_expert_policy_slot_of(pool, next_layer, e) < 0 && llama_expert_policy_slot_of(tier, next_layer, e) >= 0) {
            ahead_keys.push_back(next_layer);
            ahead_keys.push_back(e);
        }
    }
    const int32_t n_candidates = (int32_t) ahead_keys.size() / 2;
    if (n_candidates == 0) {
        return true;
    }
    ahead_pins.resize(2 * (size_t) n_ids);
    for (int32_t i = 0; i < n_ids; ++i) {
        ahead_pins[2*i]     = layer;
        ahead_pins[2*i + 1] = ids[i];
    }
    load_keys.resize(2 * n_candidates); load_slots.resize(n_candidates);
    evicted_keys.resize(2 * n_candidates); evicted_slots.resize(n_candidates);
    int32_t n_evicted = 0;
    const int32_t n_loads = llama_expert_policy_load_ahead(pool, ahead_keys.data(), n_candidates, ahead_pins.data(), n_ids,
                                                           load_keys.data(), load_slots.data(), evicted_keys.data(),
                                                           evicted_slots.data(), &n_evicted);
    if (n_loads < 0) {
        error = "layer " + std::to_string(next_layer) + ": the pool's policy refused the experts to load ahead";
        return false;
    }
    load_keys.resize(2 * n_loads); load_slots.resize(n_loads);
    counts.cache_evictions += n_evicted;
    if (n_loads == 0) {
        return true;
    }
    // the copies start later (start_copies_behind): once the GPU split that reads this layer's slot ids is
    // launched (the hook's copy callback), else at the next step
    if (copy_loads(next_layer, 0, /*n_now =*/ 0, /*wait =*/ false, error) != SERVED) {
        return false; // copy_loads abandoned the loads
    }
    behind_ahead = true;
    ahead_layer = next_layer;
    ahead_loaded.assign(n_expert_next, 0);
    for (int32_t i = 0; i < n_loads; ++i) {
        ahead_loaded[load_keys[2*i + 1]] = 1;
    }
    counts.ahead_loads += n_loads;
    return true;
}

// the experts in slots [0, 2 * n_window) forgotten by the pool's policy: the windows are ours until the next serve()
bool llama_expert_fast_path::claim_windows(int32_t n_window, std::string & error) {
    const int32_t n_resident = llama_expert_policy_size(pool);
    std::vector<int32_t> resident_keys(2 * (size_t) n_resident), resident_slots(n_resident);
    llama_expert_policy_resident(pool, resident_keys.data(), resident_slots.data(), n_resident);
    for (int32_t i = 0; i < n_resident; ++i) {
        if (resident_slots[i] < 2 * n_window &&
                llama_expert_policy_abandon(pool, resident_keys[2*i], resident_keys[2*i + 1]) != 1) {
            error = "layer windows: the pool's policy did not free slot " + std::to_string(resident_slots[i]);
            return false;
        }
    }
    windows_owned = true;
    window_layer[0] = window_layer[1] = -1;
    return true;
}

bool llama_expert_fast_path::window_step(int32_t layer, int32_t n_expert, int32_t window, int32_t n_window,
                                         const int32_t * ids, int32_t n_ids, int32_t n_tokens, std::string & error) {
    const auto started = std::chrono::steady_clock::now();
    // this window's loads still behind (not started early): only those the step uses are copied, below
    const bool own_loads_behind = windows_owned && loads_are_windows && behind_layer == layer &&
                                  window >= 0 && window <= 1 && window_layer[window] == layer;
    if (!own_loads_behind && (!start_copies_behind(error) || (copies_pending && !finish_copies(error)))) {
        return false;
    }
    if (tier == nullptr || !tier_holds_every_key || window < 0 || window > 1 || n_expert > n_window) {
        error = "layer " + std::to_string(layer) + ": a layer window needs a RAM tier that holds every expert";
        return false;
    }
    if (!windows_owned && !claim_windows(n_window, error)) {
        return false;
    }
    const bool loaded_ahead = window_layer[window] == layer;
    window_layer[window] = -1; // the next load into this window is for another layer
    if ((int32_t) position.size() < n_expert) {
        position.assign(n_expert, -1);
    }
    keys.clear();
    for (int32_t i = 0; i < n_ids; ++i) {
        if (position[ids[i]] < 0) {
            position[ids[i]] = 1;
            keys.push_back(layer);
            keys.push_back(ids[i]);
        }
    }
    const int32_t n_keys = (int32_t) keys.size() / 2;
    const bool copied = !own_loads_behind || copy_used_window_loads(layer, error); // reads position's marks
    auto & used = window_used_last[layer];
    used.assign(n_expert, 0);
    for (int32_t k = 0; k < n_keys; ++k) {
        position[keys[2*k + 1]] = -1;
        used[keys[2*k + 1]] = 1;
    }
    if (!copied || (copies_pending && !finish_copies(error))) {
        return false;
    }
    loads_are_windows = true; // until the next serve()
    if (!loaded_ahead) { // the step's experts, now
        load_keys = keys;
        load_slots.resize(n_keys);
        for (int32_t k = 0; k < n_keys; ++k) {
            load_slots[k] = window * n_window + keys[2*k + 1];
        }
        find_window_loads_in_pool(n_window);
        if (copy_loads(layer, n_tokens, n_keys, /*wait =*/ true, error) != SERVED) {
            return false;
        }
    } else {
        counts.ahead_unused += n_expert - n_keys;
    }
    counts.steps++;
    counts.tokens       += layer == first_layer ? n_tokens : 0;
    counts.cache_misses += n_keys;
    counts.ram_hits     += n_keys;
    counts.seconds      += seconds_between(started, std::chrono::steady_clock::now());
    return true;
}

bool llama_expert_fast_path::window_load_ahead(int32_t layer, int32_t n_expert, int32_t window, int32_t n_window,
                                               std::string & error) {
    if (copies_pending || behind_layer >= 0 || window < 0 || window > 1 || n_expert > n_window) {
        return true; // nothing loaded ahead: the step loads its own experts
    }
    loads_are_windows = true;
    load_keys.resize(2 * (size_t) n_expert); load_slots.resize(n_expert);
    const auto last = window_used_last.find(layer); // those its last window step used first: the early copies
    int32_t n = 0;
    for (const bool used_first : { true, false }) {
        for (int32_t e = 0; e < n_expert; ++e) {
            const bool used = last != window_used_last.end() && e < (int32_t) last->second.size() && last->second[e];
            if (used == used_first) {
                load_keys[2*n] = layer;
                load_keys[2*n + 1] = e;
                load_slots[n++] = window * n_window + e;
            }
        }
    }
    find_window_loads_in_pool(n_window);
    if (copy_loads(layer, 0, /*n_now =*/ 0, /*wait =*/ false, error) != SERVED) {
        return false;
    }
    behind_ahead = true;
    window_layer[window] = layer;
    counts.ahead_loads += n_expert;
    return true;
}

// the window loads still behind whose expert the step uses (position[expert] >= 0), copied now; the others skipped
bool llama_expert_fast_path::copy_used_window_loads(int32_t layer, std::string & error) {
    const int32_t n_loads = (int32_t) load_slots.size();
    behind_layer = -1;
    behind_ahead = false;
    const auto started = std::chrono::steady_clock::now();
    for (int32_t i = behind_from; i < n_loads; ++i) {
        if (position[load_keys[2*i + 1]] < 0) {
            counts.window_skipped++;
        } else if (!copy_load(i, error)) {
            copies_pending = false;
            error = "layer " + std::to_string(layer) + ": " + error;
            return false;
        } else {
            copies_pending = sync != nullptr;
        }
    }
    counts.copy_s += seconds_between(started, std::chrono::steady_clock::now());
    return true;
}

// a window load whose expert the pool holds copies from its slot (device to device; a host pool: memcpy): the
// window steps leave the pool's policy alone, so that slot keeps the expert until a later step's copies, which
// the stream orders after this one. The slots of the windows themselves hold no key (claim_windows).
void llama_expert_fast_path::find_window_loads_in_pool(int32_t n_window) {
    const int32_t n_loads = (int32_t) load_slots.size();
    load_pool_slots.assign(n_loads, -1);
    if (!window_from_pool || (h2d != nullptr && d2d == nullptr)) {
        return;
    }
    for (int32_t i = 0; i < n_loads; ++i) {
        const int32_t slot = llama_expert_policy_slot_of(pool, load_keys[2*i], load_keys[2*i + 1]);
        load_pool_slots[i] = slot >= 2 * n_window ? slot : -1;
    }
}

void llama_expert_fast_path::skip_window_loads_behind() {
    if (behind_layer >= 0 && loads_are_windows) {
        counts.window_skipped += (int64_t) load_slots.size() - behind_from;
        behind_layer = -1;
        behind_ahead = false;
    }
}

// the CPU keys' RAM blocks (the tier's acquire marks them used, as a copy's would), one row per id
bool llama_expert_fast_path::cpu_blocks(int32_t layer, int32_t n_keys, int32_t n_tokens,
                                        std::vector<llama_expert_cpu_row> & rows, const int32_t * ids, int32_t n_ids,
                                        int32_t n_used, std::string & error) {
    cpu_keys.clear();
    for (int32_t k = 0; k < n_keys; ++k) {
        if (on_cpu[k]) {
            cpu_keys.push_back(layer);
            cpu_keys.push_back(keys[2*k + 1]);
        }
    }
    const int32_t n_cpu = (int32_t) cpu_keys.size() / 2;
    std::vector<int32_t> & block_of = cpu_key_blocks;
    block_of.assign(n_cpu, -1);
    if (tier_holds_every_key) {
        for (int32_t i = 0; i < n_cpu; ++i) {
            block_of[i] = llama_expert_policy_slot_of(tier, layer, cpu_keys[2*i + 1]);
        }
    } else {
        std::vector<int32_t> out(2 * n_cpu), evicted(2 * n_cpu), evicted_at(n_cpu);
        std::vector<uint8_t> hit(n_cpu);
        int32_t n_evicted = 0;
        if (llama_expert_policy_acquire(tier, cpu_keys.data(), n_cpu, n_tokens, out.data(), block_of.data(), hit.data(),
                                        evicted.data(), evicted_at.data(), &n_evicted) != n_cpu || n_evicted != 0) {
            error = "layer " + std::to_string(layer) + ": the RAM tier's policy did not keep the experts it held";
            return false;
        }
    }
    key_block.assign(n_keys, -1);
    for (int32_t k = 0, i = 0; k < n_keys; ++k) {
        if (on_cpu[k]) {
            const int32_t block = block_of[i++];
            if (block < 0 || block >= (int32_t) blocks.size()) {
                error = "layer " + std::to_string(layer) + ": expert " + std::to_string(keys[2*k + 1]) + " has RAM block " +
                        std::to_string(block) + " outside the tier";
                return false;
            }
            key_block[k] = block;
        }
    }
    step_cpu_rows(rows, ids, n_ids, n_used);
    return true;
}

// one row per id whose key runs on the CPU, from its key's RAM block (key_block)
void llama_expert_fast_path::step_cpu_rows(std::vector<llama_expert_cpu_row> & rows, const int32_t * ids, int32_t n_ids,
                                           int32_t n_used) const {
    rows.clear();
    for (int32_t i = 0; i < n_ids; ++i) {
        const int32_t k = position[ids[i]];
        if (on_cpu[k]) {
            rows.push_back({ i, i / n_used, blocks[key_block[k]] });
        }
    }
}

void llama_expert_fast_path::abandon_loads() {
    if (loads_are_windows) {
        return; // window slots belong to no key of the pool's policy
    }
    for (size_t i = 0; i + 1 < load_keys.size(); i += 2) {
        llama_expert_policy_abandon(pool, load_keys[i], load_keys[i + 1]); // its slot holds no expert
    }
}

bool llama_expert_fast_path::finish_copies(std::string & error) {
    if (!copies_pending) {
        return true;
    }
    copies_pending = false;
    const auto started = std::chrono::steady_clock::now();
    const int32_t rc = sync(stream);
    counts.copy_s += seconds_between(started, std::chrono::steady_clock::now());
    if (rc != 0) {
        for (size_t i = 0; !pending_are_windows && i + 1 < pending_loads.size(); i += 2) {
            llama_expert_policy_abandon(pool, pending_loads[i], pending_loads[i + 1]);
        }
        error = "waiting for the copies from RAM to the GPU failed (CUDA error " + std::to_string(rc) + ")";
        return false;
    }
    return true;
}

// every load is a RAM hit (checked by serve): the tier's acquire, then the copies block -> slot of the first
// n_now loads (the rest: start_copies_behind); wait: false leaves them running on the stream (finish_copies)
llama_expert_fast_path::result llama_expert_fast_path::copy_loads(int32_t layer, int32_t n_tokens, int32_t n_now,
                                                                  bool wait, std::string & error) {
    const int32_t n_loads = (int32_t) load_slots.size();
    auto fail = [&](const std::string & why) {
        abandon_loads();
        error = "layer " + std::to_string(layer) + ": " + why;
        return FAILED;
    };
    load_blocks.resize(n_loads);
    if (tier_holds_every_key) {
        for (int32_t i = 0; i < n_loads; ++i) {
            load_blocks[i] = llama_expert_policy_slot_of(tier, load_keys[2*i], load_keys[2*i + 1]);
        }
    } else {
        out_keys.resize(2 * n_loads); hits.resize(n_loads); evicted_keys.resize(2 * n_loads); evicted_slots.resize(n_loads);
        int32_t n_evicted = 0;
        if (llama_expert_policy_acquire(tier, load_keys.data(), n_loads, n_tokens, out_keys.data(), load_blocks.data(),
                                        hits.data(), evicted_keys.data(), evicted_slots.data(), &n_evicted) != n_loads ||
                n_evicted != 0) {
            return fail("the RAM tier's policy did not keep the experts it held");
        }
    }
    for (int32_t i = 0; i < n_loads; ++i) {
        if (load_blocks[i] < 0 || load_blocks[i] >= (int32_t) blocks.size()) {
            return fail("expert " + std::to_string(load_keys[2*i + 1]) + " has RAM block " + std::to_string(load_blocks[i]) +
                        " outside the tier");
        }
    }
    const auto started = std::chrono::steady_clock::now();
    for (int32_t i = 0; i < n_now; ++i) {
        if (!copy_load(i, error)) {
            return fail(error);
        }
    }
    counts.copy_s += seconds_between(started, std::chrono::steady_clock::now());
    behind_layer = n_now < n_loads ? layer : -1;
    behind_from  = n_now;
    if (sync != nullptr) {
        copies_pending = true;
        pending_loads = load_keys;
        pending_are_windows = loads_are_windows;
        if (wait && !finish_copies(error)) {
            error = "layer " + std::to_string(layer) + ": " + error;
            return FAILED;
        }
    }
    return SERVED;
}

// load i's copy, role by role, from its RAM block to its slot (a window's: from the expert's pool slot when it has
// one) (false with error set; the caller abandons)
bool llama_expert_fast_path::copy_load(int32_t i, std::string & error) {
    const int32_t from_slot = loads_are_windows && i < (int32_t) load_pool_slots.size() ? load_pool_slots[i] : -1;
    if (from_slot >= 0) {
        for (const auto & span : spans_of_layer.at(load_keys[2*i])) {
            char * dst = pool_base + span.pool_offset + (uint64_t) load_slots[i] * span.slot_stride;
            const char * src = pool_base + span.pool_offset + (uint64_t) from_slot * span.slot_stride;
            if (h2d == nullptr) {
                memcpy(dst, src, span.nbytes);
            } else if (const int32_t rc = d2d((uint64_t) (uintptr_t) dst, (uint64_t) (uintptr_t) src, span.nbytes, stream);
                       rc != 0) {
                sync(stream);
                error = "copying expert " + std::to_string(load_keys[2*i + 1]) + " from pool slot " +
                        std::to_string(from_slot) + " to its window failed (CUDA error " + std::to_string(rc) + ")";
                return false;
            } else {
                counts.d2d_bytes += span.nbytes;
            }
        }
        counts.window_from_pool++;
        return true;
    }
    for (const auto & span : spans_of_layer.at(load_keys[2*i])) {
        char * dst = pool_base + span.pool_offset + (uint64_t) load_slots[i] * span.slot_stride;
        const char * src = blocks[load_blocks[i]] + span.block_offset;
        if (h2d == nullptr) {
            memcpy(dst, src, span.nbytes);
        } else if (const int32_t rc = h2d((uint64_t) (uintptr_t) dst, src, span.nbytes, stream); rc != 0) {
            sync(stream);
            error = "copying expert " + std::to_string(load_keys[2*i + 1]) + " from RAM to the GPU failed (CUDA error " +
                    std::to_string(rc) + ")";
            return false;
        } else {
            counts.h2d_bytes += span.nbytes;
        }
    }
    return true;
}

bool llama_expert_fast_path::start_copies_behind(std::string & error, bool early) {
    if (behind_layer < 0) {
        return true;
    }
    const int32_t layer = behind_layer;
    early = early && behind_ahead;
    const int32_t n_loads = (int32_t) load_slots.size();
    // early, a window's first window_early loads only: its step copies the rest it uses (copy_used_window_loads)
    const int32_t end = early && loads_are_windows && window_early >= 0 ? std::min(n_loads, behind_from + window_early)
                                                                       : n_loads;
    behind_layer = end < n_loads ? layer : -1;
    behind_ahead = false; // the copy callback starts nothing more of them
    const auto started = std::chrono::steady_clock::now();
    for (int32_t i = behind_from; i < end; ++i) {
        if (!copy_load(i, error)) {
            abandon_loads();
            behind_layer = -1;
            copies_pending = false;
            error = "layer " + std::to_string(layer) + ": " + error;
            return false;
        }
    }
    const double issued_s = seconds_between(started, std::chrono::steady_clock::now());
    counts.copy_s += issued_s;
    if (early) {
        counts.ahead_early   += end - behind_from;
        counts.ahead_early_s += issued_s;
    }
    behind_from = end;
    copies_pending = sync != nullptr; // serve() waits for them before the next step
    return true;
}

// hybrid with fill_pool: the CPU's rows are the loads from n_upload on (misses in first-seen order), from
// the RAM blocks copy_loads found
bool llama_expert_fast_path::rows_from_loads(int32_t layer, int32_t n_keys, int32_t n_upload,
                                             std::vector<llama_expert_cpu_row> & rows, const int32_t * ids,
                                             int32_t n_ids, int32_t n_used, std::string & error) {
    key_block.assign(n_keys, -1);
    for (int32_t k = 0, i = 0; k < n_keys; ++k) {
        if (i < (int32_t) load_keys.size() / 2 && load_keys[2*i + 1] == keys[2*k + 1]) {
            if (on_cpu[k] != (i >= n_upload)) {
                error = "layer " + std::to_string(layer) + ": the pool's loads are not the step's misses in order";
                abandon_loads();
                return false;
            }
            key_block[k] = load_blocks[i++];
        }
        if (on_cpu[k] && key_block[k] < 0) {
            error = "layer " + std::to_string(layer) + ": expert " + std::to_string(keys[2*k + 1]) + " has no RAM block";
            abandon_loads();
            return false;
        }
    }
    step_cpu_rows(rows, ids, n_ids, n_used);
    return true;
}
