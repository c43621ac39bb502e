// llamapack: the hook's native hot path (see llama_expert_fast_path_desc in llama-expert.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-fast.h. No llama.cpp internals: the remap op hands
// it one layer's expert ids; it either serves the step (slot ids written), declines it (the provider gets
// it, nothing changed) or fails it (error set, the step's loads abandoned).
#pragma once

#include "llama-expert.h"
#include "llama-expert-hybrid.h"

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

    // ids: [n_tokens][n_used], each in [0, n_expert); slots written only when SERVED.
    // cpu_rows (hybrid, non-null when this step's graph can compute rows on the CPU): with an upload share
    // set, the pool misses in RAM blocks beyond that share are not loaded; their rows are listed here (their
    // slot: 0, computed but not used) and the copies of the others are left running (finish_copies()).
    result serve(int32_t layer, int32_t n_expert, const int32_t * ids, int32_t n_used, int32_t n_tokens,
                 int32_t * slots, std::vector<llama_expert_cpu_row> * cpu_rows, std::string & error);

    // load-ahead (llama_expert_load_ahead_set): after a step of `layer` (ids: its experts, kept), give the
    // experts of next_layer that wait in RAM blocks slots; their copies are left behind, for
    // start_copies_behind() (the hook calls it once this layer's slot ids are on the GPU) or the next serve(),
    // which starts them and waits. Does nothing without a tier that holds every key or while hybrid copies
    // are pending. False with error set when the policy refused (its loads abandoned).
    bool load_ahead(int32_t layer, const int32_t * ids, int32_t n_ids, int32_t next_layer, int32_t n_expert_next,
                    std::string & error);

    // wait for copies serve() left running; false with error set when they failed
    bool finish_copies(std::string & error);

    // start the copies left behind: hybrid with fill_pool's (the experts this step computed on the CPU, into the
    // slots the pool's policy gave them) or load-ahead's; serve() waits for them before the next step (and
    // starts them first if nobody did). Nothing to do: true. False with error set on failure. early: called by
    // the scheduler's copy callback while the GPU computes (counted in ahead_early for the loads ahead).
    bool start_copies_behind(std::string & error, bool early = false);
    bool has_copies_ahead() const { return behind_layer >= 0 && behind_ahead; } // load-ahead's or a window's

    // layer windows (llama_expert_layer_windows_set): window w is pool slots [w * n_window, w * n_window + n_expert),
    // expert e of its layer in slot w * n_window + e, the view its matmuls read. The first window step after any
    // other step takes slots [0, 2 * n_window) from the pool's policy (their experts forgotten). window_step: the
    // step's experts are in window w when it returns true (loaded ahead, else copied now: the step's own, and
    // waited for); counted as misses served from RAM (the pool's policy sees nothing). window_load_ahead: every
    // expert of `layer` into window w (those its last window step used first), the copies left behind: the
    // copy callback starts at most window_early of them (start_copies_behind(early)), the layer's own step
    // copies the rest it uses and skips the others (window_skipped), a step of another kind skips them all.
    // Only with a RAM tier that holds every key (tier_holds_all()). False with error set on failure.
    bool window_step(int32_t layer, int32_t n_expert, int32_t window, int32_t n_window, const int32_t * ids, int32_t n_ids,
                     int32_t n_tokens, std::string & error);
    bool window_load_ahead(int32_t layer, int32_t n_expert, int32_t window, int32_t n_window, std::string & error);
    // a RAM tier that holds every key and has n_keys of them loaded (it then never evicts)
    bool tier_holds_all(int32_t n_keys) const {
        return tier != nullptr && tier_holds_every_key && llama_expert_policy_size(tier) >= n_keys;
    }

    bool set_block(int32_t block, void * addr);

    // hybrid: the share of a step's RAM-tier misses that are still loaded into the pool (0: none, all
    // computed on the CPU); < 0: hybrid off
    void set_upload_share(double share, bool fill) { upload_share = share; fill_pool = fill; }
    double get_upload_share() const { return upload_share; }
    bool has_tier() const { return tier != nullptr; }

    // whole-pool graphs: true when every expert of the layer is in the pool and no copy is pending, so a step
    // of that layer is all hits whatever its ids; pool_slot: the pool's slot of an expert
    bool holds_layer(int32_t layer, int32_t n_expert) const {
        return !copies_pending && llama_expert_policy_layer_size(pool, layer) >= n_expert;
    }
    int32_t pool_slot(int32_t layer, int32_t expert) const { return llama_expert_policy_slot_of(pool, layer, expert); }
    const char * block_address(int32_t block) const {
        return block >= 0 && block < (int32_t) blocks.size() ? blocks[block] : nullptr;
    }

    llama_expert_fast_path_stats & stats_mut() { return counts; }

    const llama_expert_fast_path_stats & stats() const { return counts; }

private:
    llama_expert_fast_path() = default;

    result copy_loads(int32_t layer, int32_t n_tokens, int32_t n_now, bool wait, std::string & error);
    bool   copy_load(int32_t i, std::string & error);
    bool   rows_from_loads(int32_t layer, int32_t n_keys, int32_t n_upload, std::vector<llama_expert_cpu_row> & rows,
                           const int32_t * ids, int32_t n_ids, int32_t n_used, std::string & error);
    void   step_cpu_rows(std::vector<llama_expert_cpu_row> & rows, const int32_t * ids, int32_t n_ids, int32_t n_used) const;
    void   abandon_loads();
    bool   cpu_blocks(int32_t layer, int32_t n_keys, int32_t n_tokens, std::vector<llama_expert_cpu_row> & rows,
                      const int32_t * ids, int32_t n_ids, int32_t n_used, std::string & error);

    llama_expert_policy * pool = nullptr;
    llama_expert_policy * tier = nullptr;
    bool                  tier_holds_every_key = false;
    std::vector<char *>   blocks;
    std::unordered_map<int32_t, std::vector<llama_expert_copy_span>> spans_of_layer;
    int32_t               first_layer = 0;
    char *                pool_base = nullptr;
    llama_expert_h2d_fn   h2d = nullptr;
    llama_expert_d2d_fn   d2d = nullptr;
    bool                  window_from_pool = true; // a window's experts in the pool copied from there (env
                                                   // LLAMAPACK_WINDOW_FROM_POOL=0: from RAM, an experiment's knob)
    llama_expert_sync_fn  sync = nullptr;
    void *                stream = nullptr;
    double                upload_share = -1.0;
    bool                  fill_pool = false;
    bool                  copies_pending = false;
    std::vector<int32_t>  pending_loads;  // keys [n][2] whose copies are still running
    int32_t               behind_layer = -1, behind_from = 0; // loads [behind_from, n) of behind_layer: copies behind
    bool                  behind_ahead = false; // those copies are load-ahead's or a window's (not hybrid's)
    int32_t               ahead_layer = -1;  // load-ahead: the layer whose experts ahead_loaded flags
    std::vector<uint8_t>  ahead_loaded;      // per expert of ahead_layer: loaded ahead, not yet asked for
    std::vector<int32_t>  ahead_keys, ahead_pins;
    bool                  loads_are_windows = false, pending_are_windows = false; // load_keys / pending_loads: window slots
    bool                  windows_owned = false;     // window slots taken from the pool's policy since the last serve()
    int32_t               window_layer[2] = { -1, -1 }; // the layer each window was loaded ahead with (-1: none)
    int32_t               window_early = -1; // loads of a window the copy callback starts (-1: all; env
                                             // LLAMAPACK_WINDOW_EARLY, an experiment's knob)
    std::unordered_map<int32_t, std::vector<uint8_t>> window_used_last; // per layer: experts its last window step used

    bool claim_windows(int32_t n_window, std::string & error);
    bool copy_used_window_loads(int32_t layer, std::string & error); // the loads behind that the step's keys use
    void skip_window_loads_behind();                                 // a window's loads behind, never copied
    void find_window_loads_in_pool(int32_t n_window);                // load_pool_slots of the window loads

    llama_expert_fast_path_stats counts = {};

    // per step scratch (sized once per layer width, reused)
    std::vector<int32_t> position;  // expert id -> index among the step's distinct keys, -1: not in the step
    std::vector<int32_t> keys;      // distinct keys [n][2] in first-seen order
    std::vector<int32_t> out_keys, out_slots, evicted_keys, evicted_slots, load_keys, load_slots, load_blocks;
    std::vector<int32_t> load_pool_slots; // window loads: the expert's pool slot to copy from (-1: its RAM block)
    std::vector<uint8_t> hits;
    std::vector<uint8_t> on_cpu;           // per distinct key: computed on the CPU this step (hybrid)
    std::vector<int32_t> pool_keys, key_slot, key_block, cpu_keys, cpu_key_blocks;
};
