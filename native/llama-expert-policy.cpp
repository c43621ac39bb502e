// llamapack: the NextUse cache policy in C++ (llama-expert-policy.h) and its C API (llama-expert.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-policy.cpp. A port of llamapack/policy_next_use.py
// (the reference; its docstring explains the estimate): the same state, updated in the same order with the
// same floating-point operations, so that both take the same decisions bit for bit. Where the reference
// keeps Python sets and dicts, this keeps flat per-layer arrays indexed by expert id; where it allocates per
// step, this reuses scratch vectors.

// Bit-identical decisions need plain IEEE double operations: no reassociation, no fused multiply-add (with
// -march=native GCC would otherwise fuse e.g. visits * decay + 1.0). GCC's pragma comes before the includes:
// functions compiled with other options than their callers' are not inlined (std::sort's comparator).
#if defined(__FAST_MATH__)
#    error "llama-expert-policy.cpp must be compiled without -ffast-math (it must match the Python reference)"
#endif
#if defined(__clang__)
#    pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#    pragma GCC optimize("fp-contract=off")
#elif defined(_MSC_VER)
#    pragma fp_contract(off)
#endif

#include "llama-expert.h"
#include "llama-expert-policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

constexpr double k_tiny = 1e-300;  // floor of a class's total count in the weights (the reference's _tiny)
constexpr double k_inf  = std::numeric_limits<double>::infinity();
constexpr double k_recompute = -k_inf;  // a heap entry's -next_use that says "compute me when popped"

// One layer's state (the reference's _Layer).
struct layer_state {
    int32_t  id      = 0;
    int64_t  last    = 0;  // step of its latest visit; 0: never visited
    int64_t  period  = 0;
    uint64_t version = 0;
    double   visits  = 0.0;  // decayed like the counts

    // per expert id (all as long as the highest id seen + 1)
    std::vector<double>  counts;   // decayed count of uses
    std::vector<int32_t> ages;     // visits since last use as of the next visit, capped at horizon + 1
    std::vector<int32_t> slots;    // slot when resident, -1 otherwise (the reference's members)
    std::vector<uint8_t> in_step;  // 1 for the experts of its latest visit
    int32_t              n_resident = 0;  // experts with a slot

    std::vector<int32_t> step_keys;  // the experts of its latest visit
    std::vector<int64_t> classes;    // horizon + 2: how many experts of each age
    std::vector<double>  weight;     // horizon + 2: p = weight[age] * count, as of the latest visit

    // expert ids by p (lowest, i.e. farthest next use, first) and their p; order[:front] are gone.
    // ranked false: to be ranked when a victim is first looked for (the reference's order None)
    bool                 ranked = true;
    std::vector<int32_t> order;
    std::vector<double>  p;
    size_t               front = 0;
};

// An entry of the layer heap: the reference's tuple (-next use of the layer's front key, layer, version).
// An entry is valid while its version is its layer's; a layer has at most one valid entry, so the heap's
// shape and the invalid entries (dropped when popped, or by a compaction) never change which layer comes out.
struct heap_entry {
    double   negative_next_use;
    int32_t  layer;  // id
    int32_t  index;  // in layers
    uint64_t version;
};

// std::*_heap keep the greatest first: "greater" in the tuple order makes the smallest tuple come first
struct heap_after {
    bool operator()(const heap_entry & a, const heap_entry & b) const {
        if (a.negative_next_use != b.negative_next_use) {
            return a.negative_next_use > b.negative_next_use;
        }
        if (a.layer != b.layer) {
            return a.layer > b.layer;
        }
        return a.version > b.version;
    }
};

struct ranked_key {
    double  p;
    int32_t expert;
};

// np.lexsort((experts, p)): by p (NaN last, as numpy sorts), then by expert id
struct ranks_before {
    bool operator()(const ranked_key & a, const ranked_key & b) const {
        if (a.p < b.p) {
            return true;
        }
        if (b.p < a.p) {
            return false;
        }
        const bool a_nan = std::isnan(a.p), b_nan = std::isnan(b.p);
        if (a_nan != b_nan) {
            return b_nan;
        }
        return a.expert < b.expert;
    }
};

struct victim_key {
    int32_t index;  // in layers
    int32_t expert;
};

} // namespace

struct llama_expert_next_use_impl {
    int32_t n_slots;
    int32_t horizon;
    int32_t oldest;  // horizon + 1: "older or never"
    double  decay;
    double  rate_decay;

    std::vector<double> used;  // horizon + 2 (index 0 unused): keys used / keys seen per age class, decayed
    std::vector<double> seen;

    std::vector<int32_t>     free_slots;      // a min-heap
    int32_t                  n_resident = 0;
    std::vector<layer_state> layers;          // in first-seen order
    std::vector<int32_t>     index_of_layer;  // by layer id: index in layers, -1: not seen
    std::vector<heap_entry>  by_next_use;     // the lazy layer heap
    int64_t                  step = 0;

    // scratch, reused from call to call
    uint32_t                           stamp = 0;
    std::vector<std::vector<uint32_t>> key_stamps;    // by layer id, expert id: == stamp for the current call's keys
    std::vector<uint32_t>              layer_stamps;  // by layer id: == stamp for the current call's layers
    std::vector<int32_t>               group_of_layer;
    std::vector<llama_expert_key>      wanted;        // the current call's distinct keys, first seen first
    std::vector<llama_expert_key>      ahead_order, both; // load_ahead's keys, and its pins then keys
    std::vector<int32_t>               group_layers, group_starts, grouped_experts;
    std::vector<int64_t>               step_ages;
    std::vector<double>                class_totals;
    std::vector<ranked_key>            ranking;

    llama_expert_next_use_impl(int32_t slots, double half_life, int32_t age_classes, double rate_half_life)
        : n_slots(slots), horizon(age_classes), oldest(age_classes + 1),
          decay(std::pow(2.0, -1.0 / half_life)), rate_decay(std::pow(2.0, -1.0 / rate_half_life)),
          used(age_classes + 2, 0.25), seen(age_classes + 2, 1.0), step_ages(age_classes + 2),
          class_totals(age_classes + 2) {
        free_slots.reserve(slots);
        for (int32_t slot = 0; slot < slots; ++slot) {
            free_slots.push_back(slot);  // ascending: already a min-heap
        }
    }

    // -- lookups

    int32_t layer_index(int32_t id) const {
        return id >= 0 && (size_t) id < index_of_layer.size() ? index_of_layer[id] : -1;
    }

    int32_t slot_of(llama_expert_key key) const {
        const int32_t index = layer_index(key.layer);
        if (index < 0 || key.expert < 0 || (size_t) key.expert >= layers[index].slots.size()) {
            return -1;
        }
        return layers[index].slots[key.expert];
    }

    bool pinned(int32_t layer, int32_t expert) const {  // one of the current acquire's keys
        if ((size_t) layer >= key_stamps.size()) {
            return false;
        }
        const std::vector<uint32_t> & stamps = key_stamps[layer];
        return (size_t) expert < stamps.size() && stamps[expert] == stamp;
    }

    int32_t pop_free_slot() {
        std::pop_heap(free_slots.begin(), free_slots.end(), std::greater<int32_t>());
        const int32_t slot = free_slots.back();
        free_slots.pop_back();
        return slot;
    }

    void push_free_slot(int32_t slot) {
        free_slots.push_back(slot);
        std::push_heap(free_slots.begin(), free_slots.end(), std::greater<int32_t>());
    }

    // -- the call's keys

    void next_stamp() {
        if (++stamp == 0) {  // wrapped: no stale mark may equal a new stamp
            for (std::vector<uint32_t> & stamps : key_stamps) {
                std::fill(stamps.begin(), stamps.end(), 0);
            }
            std::fill(layer_stamps.begin(), layer_stamps.end(), 0);
            stamp = 1;
        }
    }

    // wanted = the keys without repeats, in first-seen order; marks them (the pins of an acquire)
    void collect_distinct(const llama_expert_key * keys, int32_t n_keys) {
        next_stamp();
        wanted.clear();
        for (int32_t i = 0; i < n_keys; ++i) {
            const llama_expert_key key = keys[i];
            if ((size_t) key.layer >= key_stamps.size()) {
                key_stamps.resize(key.layer + 1);
            }
            std::vector<uint32_t> & stamps = key_stamps[key.layer];
            if ((size_t) key.expert >= stamps.size()) {
                stamps.resize(key.expert + 1, 0);
            }
            if (stamps[key.expert] != stamp) {
                stamps[key.expert] = stamp;
                wanted.push_back(key);
            }
        }
    }

    // true the first time the current call names this layer
    bool first_of_layer(int32_t layer) {
        if ((size_t) layer >= layer_stamps.size()) {
            layer_stamps.resize(layer + 1, 0);
            group_of_layer.resize(layer + 1, 0);
        }
        if (layer_stamps[layer] == stamp) {
            return false;
        }
        layer_stamps[layer] = stamp;
        return true;
    }

    // the wanted keys by layer (the reference's by_layer): group_layers in first-seen order, the experts of
    // group g at grouped_experts[group_starts[g] .. group_starts[g + 1]), in first-seen order
    void group_by_layer() {
        group_layers.clear();
        group_starts.assign(1, 0);
        for (const llama_expert_key & key : wanted) {
            if (first_of_layer(key.layer)) {
                group_of_layer[key.layer] = (int32_t) group_layers.size();
                group_layers.push_back(key.layer);
                group_starts.push_back(0);
            }
            group_starts[group_of_layer[key.layer] + 1]++;
        }
        for (size_t g = 1; g < group_starts.size(); ++g) {
            group_starts[g] += group_starts[g - 1];
        }
        grouped_experts.resize(wanted.size());
        for (const llama_expert_key & key : wanted) {  // group_starts[g] moves to the end of group g ...
            grouped_experts[group_starts[group_of_layer[key.layer]]++] = key.expert;
        }
        for (size_t g = group_starts.size() - 1; g > 0; --g) {  // ... and back
            group_starts[g] = group_starts[g - 1];
        }
        group_starts[0] = 0;
    }

    // -- layers

    int32_t create_layer(int32_t id, int64_t period) {
        if ((size_t) id >= index_of_layer.size()) {
            index_of_layer.resize(id + 1, -1);
        }
        index_of_layer[id] = (int32_t) layers.size();
        layers.emplace_back();
        layer_state & layer = layers.back();
        layer.id     = id;
        layer.period = period;
        layer.classes.assign(horizon + 2, 0);
        layer.weight.assign(horizon + 2, 0.0);
        return index_of_layer[id];
    }

    void grow(layer_state & layer, size_t n) {
        if (n > layer.counts.size()) {
            const size_t extra = n - layer.counts.size();
            layer.counts.resize(n, 0.0);
            layer.ages.resize(n, oldest);
            layer.slots.resize(n, -1);
            layer.in_step.resize(n, 0);
            layer.classes[oldest] += (int64_t) extra;
        }
    }

    // weight[a] = rate[a] / mean count of the layer's keys of age a (the reference's _weights)
    void compute_weights(layer_state & layer) {
        std::fill(class_totals.begin(), class_totals.end(), 0.0);
        for (size_t e = 0; e < layer.counts.size(); ++e) {  // np.bincount(ages, counts): in index order
            class_totals[layer.ages[e]] += layer.counts[e];
        }
        for (int32_t a = 0; a <= oldest; ++a) {
            layer.weight[a] = (used[a] * (double) layer.classes[a]) / std::max(seen[a] * class_totals[a], k_tiny);
        }
    }

    void set_step_keys(layer_state & layer, const int32_t * experts, int32_t n) {
        for (int32_t expert : layer.step_keys) {
            layer.in_step[expert] = 0;
        }
        layer.step_keys.assign(experts, experts + n);
        for (int32_t expert : layer.step_keys) {
            layer.in_step[expert] = 1;
        }
    }

    // what a decode visit teaches: reuse rates per age class, the layer's counts and ages
    void learn(layer_state & layer, const int32_t * experts, int32_t n) {
        layer.visits = layer.visits * decay + 1.0;
        for (int32_t a = 0; a <= oldest; ++a) {
            used[a] *= rate_decay;
            seen[a] *= rate_decay;
        }
        for (int32_t a = 0; a <= oldest; ++a) {
            seen[a] += (double) layer.classes[a];
        }
        std::fill(step_ages.begin(), step_ages.end(), 0);
        for (int32_t i = 0; i < n; ++i) {
            step_ages[layer.ages[experts[i]]]++;
        }
        for (int32_t a = 0; a <= oldest; ++a) {
            used[a] += (double) step_ages[a];
        }
        for (double & count : layer.counts) {
            count *= decay;
        }
        for (int32_t i = 0; i < n; ++i) {
            layer.counts[experts[i]] += 1.0;
        }
        for (int32_t & age : layer.ages) {
            age = std::min(age + 1, oldest);
        }
        for (int32_t i = 0; i < n; ++i) {
            layer.ages[experts[i]] = 1;
        }
        std::fill(layer.classes.begin(), layer.classes.end(), 0);
        for (int32_t age : layer.ages) {
            layer.classes[age]++;
        }
    }

    // a step names `experts` (distinct) of layer `id`; only a decode step (learn) teaches the estimate
    int32_t visit(int32_t id, const int32_t * experts, int32_t n, bool learning) {
        int32_t index = layer_index(id);
        if (index < 0) {
            index = create_layer(id, (int64_t) layers.size() + 1);
        } else if (layers[index].last) {
            layers[index].period = step - layers[index].last;
        }
        layer_state & layer = layers[index];
        layer.last = step;
        grow(layer, (size_t) *std::max_element(experts, experts + n) + 1);
        if (learning) {
            learn(layer, experts, n);
        }
        compute_weights(layer);
        set_step_keys(layer, experts, n);
        layer.ranked = false;
        queue(index);
        return index;
    }

    // order the layer's resident keys and its latest step's by p as of its latest visit, lowest first
    void rank(layer_state & layer) {
        ranking.clear();
        for (size_t e = 0; e < layer.counts.size(); ++e) {
            if (layer.slots[e] >= 0 || layer.in_step[e]) {
                ranking.push_back({layer.weight[layer.ages[e]] * layer.counts[e], (int32_t) e});
            }
        }
        std::sort(ranking.begin(), ranking.end(), ranks_before());
        layer.order.resize(ranking.size());
        layer.p.resize(ranking.size());
        for (size_t i = 0; i < ranking.size(); ++i) {
            layer.order[i] = ranking[i].expert;
            layer.p[i]     = ranking[i].p;
        }
        layer.front  = 0;
        layer.ranked = true;
    }

    static double upcoming(const layer_state & layer, double p) {  // p 0: preloaded, never counted
        return p > 0 ? (double) layer.last + (double) layer.period / p : k_inf;
    }

    // invalidate the layer's heap entry and queue a fresh one, computed when popped
    void queue(int32_t index) {
        layer_state & layer = layers[index];
        layer.version++;
        by_next_use.push_back({k_recompute, layer.id, index, layer.version});
        std::push_heap(by_next_use.begin(), by_next_use.end(), heap_after());
        if (by_next_use.size() > 4 * layers.size() + 64) {  // drop the invalidated entries
            by_next_use.erase(std::remove_if(by_next_use.begin(), by_next_use.end(),
                                             [this](const heap_entry & entry) {
                                                 return entry.version != layers[entry.index].version;
                                             }),
                              by_next_use.end());
            std::make_heap(by_next_use.begin(), by_next_use.end(), heap_after());
        }
    }

    // index in layer.order of its farthest unpinned resident key, or order.size() when none
    size_t front(layer_state & layer) {
        if (!layer.ranked) {
            rank(layer);
        }
        const std::vector<int32_t> & order = layer.order;
        while (layer.front < order.size() && layer.slots[order[layer.front]] < 0 &&
               !pinned(layer.id, order[layer.front])) {
            layer.front++;  // evicted or abandoned since the visit (a pinned one may be loading now)
        }
        size_t index = layer.front;
        while (index < order.size() && (layer.slots[order[index]] < 0 || pinned(layer.id, order[index]))) {
            index++;
        }
        return index;
    }

    // the unpinned resident key of farthest next use (one exists: the step fits and a slot is needed)
    victim_key pop_victim() {
        for (;;) {
            if (by_next_use.empty()) {
                std::fprintf(stderr, "llama-expert-policy: no victim in the layer heap (a bug)\n");
                std::abort();
            }
            std::pop_heap(by_next_use.begin(), by_next_use.end(), heap_after());
            heap_entry entry = by_next_use.back();
            by_next_use.pop_back();
            layer_state & layer = layers[entry.index];
            if (entry.version != layer.version) {
                continue;  // invalidated by a visit
            }
            const size_t index = front(layer);
            if (index == layer.order.size()) {
                continue;  // no key, or only pinned ones (a layer of this step: queued again at its end)
            }
            const double next_use = upcoming(layer, layer.p[index]);
            if (-entry.negative_next_use > next_use) {  // computed before an eviction (or "compute me"): re-rank
                entry.negative_next_use = -next_use;
                by_next_use.push_back(entry);
                std::push_heap(by_next_use.begin(), by_next_use.end(), heap_after());
                continue;
            }
            by_next_use.push_back(entry);  // an upper bound for the next front
            std::push_heap(by_next_use.begin(), by_next_use.end(), heap_after());
            return {entry.index, layer.order[index]};
        }
    }

    // a slot for a key being loaded: the lowest free one, else the victim's (recorded in evicted)
    int32_t take_slot(std::vector<llama_expert_eviction> & evicted) {
        if (!free_slots.empty()) {
            n_resident++;
            return pop_free_slot();
        }
        const victim_key victim = pop_victim();
        layer_state & owner = layers[victim.index];
        const int32_t slot = owner.slots[victim.expert];
        owner.slots[victim.expert] = -1;
        owner.n_resident--;
        evicted.push_back({{owner.id, victim.expert}, slot});
        return slot;
    }

    // -- the API

    bool acquire(const llama_expert_key * keys, int32_t n_keys, int32_t n_tokens,
                 std::vector<llama_expert_assignment> & out, std::vector<llama_expert_eviction> & evicted) {
        out.clear();
        evicted.clear();
        collect_distinct(keys, n_keys);
        if (wanted.size() > (size_t) n_slots) {
            return false;
        }
        step++;
        group_by_layer();
        for (size_t g = 0; g < group_layers.size(); ++g) {
            visit(group_layers[g], grouped_experts.data() + group_starts[g], group_starts[g + 1] - group_starts[g],
                  n_tokens == 1);
        }
        for (const llama_expert_key & key : wanted) {
            layer_state & layer = layers[index_of_layer[key.layer]];
            int32_t    slot  = layer.slots[key.expert];
            const bool hit   = slot >= 0;
            if (!hit) {
                slot = take_slot(evicted);
                layer.slots[key.expert] = slot;
                layer.n_resident++;
            }
            out.push_back({key, slot, hit});
        }
        for (int32_t id : group_layers) {  // its pins are released: its front may be a pinned key now
            queue(index_of_layer[id]);
        }
        return true;
    }

    bool abandon(llama_expert_key key) {
        const int32_t slot = slot_of(key);
        if (slot < 0) {
            return false;
        }
        layer_state & layer = layers[index_of_layer[key.layer]];
        layer.slots[key.expert] = -1;  // skipped when it reaches its layer's front
        layer.n_resident--;
        n_resident--;
        push_free_slot(slot);
        return true;
    }

    double next_use(llama_expert_key key) {
        const int32_t index = layer_index(key.layer);
        if (index < 0) {
            return k_inf;
        }
        layer_state & layer = layers[index];
        if (!layer.ranked) {
            rank(layer);
        }
        const auto found = std::find(layer.order.begin(), layer.order.end(), key.expert);
        return found == layer.order.end() ? k_inf : upcoming(layer, layer.p[found - layer.order.begin()]);
    }

    void seed(const std::vector<std::pair<int32_t, std::vector<double>>> & popularity) {
        const double steady = 1.0 / (1.0 - decay);
        for (const auto & [id, shares] : popularity) {
            if (id < 0 || layer_index(id) >= 0 || shares.empty()) {
                continue;
            }
            layer_state & layer = layers[create_layer(id, (int64_t) popularity.size())];
            grow(layer, shares.size());
            for (size_t e = 0; e < shares.size(); ++e) {
                layer.counts[e] = shares[e] * steady;
            }
            layer.visits = steady;
            compute_weights(layer);
        }
    }

    void preload(const llama_expert_key * keys, int32_t n_keys, std::vector<llama_expert_assignment> & loads) {
        loads.clear();
        collect_distinct(keys, n_keys);
        for (const llama_expert_key & key : wanted) {
            if (free_slots.empty()) {
                break;
            }
            if (slot_of(key) >= 0) {
                continue;
            }
            int32_t index = layer_index(key.layer);
            if (index < 0) {
                index = create_layer(key.layer, (int64_t) layers.size() + 1);
                compute_weights(layers[index]);
            }
            layer_state & layer = layers[index];
            grow(layer, (size_t) key.expert + 1);
            const int32_t slot = pop_free_slot();
            n_resident++;
            layer.slots[key.expert] = slot;
            layer.n_resident++;
            layer.ranked = false;  // ranked again, with its new members, when a victim is looked for
            loads.push_back({key, slot, false});
        }
        for (const llama_expert_assignment & load : loads) {
            if (first_of_layer(load.key.layer)) {
                queue(index_of_layer[load.key.layer]);
            }
        }
    }

    // the reference's load_ahead: slots for the keys not resident, never evicting the resident ones of `pinned`
    // or of `keys`; stops when nothing else is left to evict. No visit.
    void load_ahead(const llama_expert_key * keys, int32_t n_keys, const llama_expert_key * pinned, int32_t n_pinned,
                    std::vector<llama_expert_assignment> & loads, std::vector<llama_expert_eviction> & evicted) {
        loads.clear();
        evicted.clear();
        ahead_order.clear();  // the keys' first-seen order, taken before the pins' marks
        collect_distinct(keys, n_keys);
        ahead_order.swap(wanted);
        both.assign(pinned, pinned + std::max(n_pinned, 0));
        both.insert(both.end(), keys, keys + std::max(n_keys, 0));
        collect_distinct(both.data(), (int32_t) both.size());  // marked: pop_victim passes them over
        int64_t n_pins = 0;
        for (const llama_expert_key & key : wanted) {
            n_pins += slot_of(key) >= 0;
        }
        for (const llama_expert_key & key : ahead_order) {
            if (slot_of(key) >= 0) {
                continue;
            }
            if (n_pins >= n_slots) {
                break;
            }
            n_pins++;
            int32_t index = layer_index(key.layer);
            if (index < 0) {
                index = create_layer(key.layer, (int64_t) layers.size() + 1);
                compute_weights(layers[index]);
            }
            grow(layers[index], (size_t) key.expert + 1);
            const int32_t slot = take_slot(evicted);
            layer_state & layer = layers[index];
            layer.slots[key.expert] = slot;
            layer.n_resident++;
            layer.ranked = false;  // ranked again, with its new members, when a victim is looked for
            loads.push_back({key, slot, false});
        }
        for (const llama_expert_key & key : wanted) {  // pinned fronts were skipped: their layers queued again
            if (slot_of(key) >= 0 && first_of_layer(key.layer)) {
                queue(index_of_layer[key.layer]);
            }
        }
    }
};

namespace {

bool valid_keys(const llama_expert_key * keys, int32_t n_keys) {
    for (int32_t i = 0; i < n_keys; ++i) {
        if (keys[i].layer < 0 || keys[i].expert < 0) {
            return false;
        }
    }
    return true;
}

} // namespace

// ---- the class -------------------------------------------------------------------------------------------

llama_expert_next_use::llama_expert_next_use(int32_t n_slots, double half_life, int32_t horizon,
                                             double rate_half_life) {
    if (!(n_slots >= 1 && half_life > 0 && rate_half_life > 0 && horizon >= 1)) {
        throw std::invalid_argument("llama_expert_next_use: needs n_slots >= 1, half_life > 0, "
                                    "rate_half_life > 0 and horizon >= 1");
    }
    impl = new llama_expert_next_use_impl(n_slots, half_life, horizon, rate_half_life);
}

llama_expert_next_use::~llama_expert_next_use() {
    delete impl;
}

int32_t llama_expert_next_use::n_slots() const {
    return impl->n_slots;
}

// also false, changing nothing, when an id is negative
bool llama_expert_next_use::acquire(const llama_expert_key * keys, int32_t n_keys, int32_t n_tokens,
                                    std::vector<llama_expert_assignment> & out,
                                    std::vector<llama_expert_eviction> & evicted) {
    if (!valid_keys(keys, n_keys)) {
        out.clear();
        evicted.clear();
        return false;
    }
    return impl->acquire(keys, n_keys, n_tokens, out, evicted);
}

bool llama_expert_next_use::all_resident(const llama_expert_key * keys, int32_t n_keys) const {
    for (int32_t i = 0; i < n_keys; ++i) {
        if (impl->slot_of(keys[i]) < 0) {
            return false;
        }
    }
    return true;
}

bool llama_expert_next_use::abandon(llama_expert_key key) {
    return impl->abandon(key);
}

int32_t llama_expert_next_use::slot_of(llama_expert_key key) const {
    return impl->slot_of(key);
}

int32_t llama_expert_next_use::size() const {
    return impl->n_resident;
}

int32_t llama_expert_next_use::layer_size(int32_t layer) const {
    const int32_t index = impl->layer_index(layer);
    return index < 0 ? 0 : impl->layers[index].n_resident;
}

// by layer (first seen first), then expert id: not the reference's order (a dict's insertion order)
void llama_expert_next_use::resident(std::vector<std::pair<llama_expert_key, int32_t>> & out) const {
    out.clear();
    for (const layer_state & layer : impl->layers) {
        for (size_t e = 0; e < layer.slots.size(); ++e) {
            if (layer.slots[e] >= 0) {
                out.push_back({{layer.id, (int32_t) e}, layer.slots[e]});
            }
        }
    }
}

double llama_expert_next_use::frequency(llama_expert_key key) const {
    const int32_t index = impl->layer_index(key.layer);
    if (index < 0 || key.expert < 0 || (size_t) key.expert >= impl->layers[index].counts.size()) {
        return 0.0;
    }
    return impl->layers[index].counts[key.expert];
}

void llama_expert_next_use::reuse_rates(std::vector<double> & out) const {
    out.resize(impl->oldest);
    for (int32_t a = 1; a <= impl->oldest; ++a) {
        out[a - 1] = impl->used[a] / impl->seen[a];
    }
}

double llama_expert_next_use::next_use(llama_expert_key key) {
    return impl->next_use(key);
}

void llama_expert_next_use::popularity(std::vector<std::pair<int32_t, std::vector<double>>> & out) const {
    out.clear();
    for (const layer_state & layer : impl->layers) {
        if (layer.visits > 0) {
            std::vector<double> shares(layer.counts.size());
            for (size_t e = 0; e < shares.size(); ++e) {
                shares[e] = layer.counts[e] / layer.visits;
            }
            out.emplace_back(layer.id, std::move(shares));
        }
    }
}

void llama_expert_next_use::seed(const std::vector<std::pair<int32_t, std::vector<double>>> & popularity) {
    impl->seed(popularity);
}

// keys with a negative id are skipped (they could never be loaded)
void llama_expert_next_use::preload(const llama_expert_key * keys, int32_t n_keys,
                                    std::vector<llama_expert_assignment> & loads) {
    if (!valid_keys(keys, n_keys)) {
        std::vector<llama_expert_key> valid;
        for (int32_t i = 0; i < n_keys; ++i) {
            if (keys[i].layer >= 0 && keys[i].expert >= 0) {
                valid.push_back(keys[i]);
            }
        }
        impl->preload(valid.data(), (int32_t) valid.size(), loads);
        return;
    }
    impl->preload(keys, n_keys, loads);
}

// false, changing nothing, when an id is negative
bool llama_expert_next_use::load_ahead(const llama_expert_key * keys, int32_t n_keys, const llama_expert_key * pinned,
                                       int32_t n_pinned, std::vector<llama_expert_assignment> & loads,
                                       std::vector<llama_expert_eviction> & evicted) {
    loads.clear();
    evicted.clear();
    if (!valid_keys(keys, n_keys) || !valid_keys(pinned, n_pinned)) {
        return false;
    }
    impl->load_ahead(keys, n_keys, pinned, n_pinned, loads, evicted);
    return true;
}

// ---- the C API -------------------------------------------------------------------------------------------

// The C handle: the policy and the buffers its C functions copy through (no allocation per step once grown).
struct llama_expert_policy {
    llama_expert_next_use                policy;
    std::vector<llama_expert_key>        keys;
    std::vector<llama_expert_assignment> assignments;
    std::vector<llama_expert_eviction>   evictions;

    llama_expert_policy(int32_t n_slots, double half_life, int32_t horizon, double rate_half_life)
        : policy(n_slots, half_life, horizon, rate_half_life) {}

    const llama_expert_key * read_keys(const int32_t * flat, int32_t n) {
        keys.resize(n > 0 ? n : 0);
        for (int32_t i = 0; i < n; ++i) {
            keys[i] = {flat[2*i], flat[2*i + 1]};
        }
        return keys.data();
    }
};

namespace {

std::pair<int32_t, std::vector<double>> * find_layer(std::vector<std::pair<int32_t, std::vector<double>>> & layers,
                                                     int32_t layer) {
    for (auto & entry : layers) {
        if (entry.first == layer) {
            return &entry;
        }
    }
    return nullptr;
}

} // namespace

extern "C" {

LLAMA_EXPERT_API llama_expert_policy * llama_expert_policy_new(
        int32_t n_slots, double half_life, int32_t horizon, double rate_half_life) {
    if (!(n_slots >= 1 && half_life > 0 && rate_half_life > 0 && horizon >= 1)) {
        return nullptr;
    }
    try {
        return new llama_expert_policy(n_slots, half_life, horizon, rate_half_life);
    } catch (const std::exception &) {
        return nullptr;
    }
}

LLAMA_EXPERT_API void llama_expert_policy_free(llama_expert_policy * policy) {
    delete policy;
}

// key i of an output array of keys [n][2]
static void put_key(int32_t * out, int32_t i, llama_expert_key key) {
    out[2*i]     = key.layer;
    out[2*i + 1] = key.expert;
}

// -1: more distinct keys than slots; -2: a negative id (nothing changed either way)
LLAMA_EXPERT_API int32_t llama_expert_policy_acquire(llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, int32_t n_tokens, int32_t * out_keys, int32_t * out_slots, uint8_t * out_hits,
        int32_t * evicted_keys, int32_t * evicted_slots, int32_t * n_evicted) {
    const llama_expert_key * key_list = policy->read_keys(keys, n_keys);
    *n_evicted = 0;
    if (!valid_keys(key_list, n_keys)) {
        return -2;
    }
    if (!policy->policy.acquire(key_list, n_keys, n_tokens, policy->assignments, policy->evictions)) {
        return -1;
    }
    const int32_t n_out = (int32_t) policy->assignments.size();
    for (int32_t i = 0; i < n_out; ++i) {
        const llama_expert_assignment & assignment = policy->assignments[i];
        put_key(out_keys, i, assignment.key);
        out_slots[i]      = assignment.slot;
        out_hits[i]       = assignment.hit ? 1 : 0;
    }
    const int32_t n_victims = (int32_t) policy->evictions.size();
    for (int32_t i = 0; i < n_victims; ++i) {
        put_key(evicted_keys, i, policy->evictions[i].key);
        evicted_slots[i] = policy->evictions[i].slot;
    }
    *n_evicted = n_victims;
    return n_out;
}

LLAMA_EXPERT_API int32_t llama_expert_policy_abandon(llama_expert_policy * policy, int32_t layer, int32_t expert) {
    return policy->policy.abandon({layer, expert}) ? 1 : 0;
}

LLAMA_EXPERT_API int32_t llama_expert_policy_slot_of(const llama_expert_policy * policy, int32_t layer,
        int32_t expert) {
    return policy->policy.slot_of({layer, expert});
}

LLAMA_EXPERT_API int32_t llama_expert_policy_size(const llama_expert_policy * policy) {
    return policy->policy.size();
}

LLAMA_EXPERT_API int32_t llama_expert_policy_layer_size(const llama_expert_policy * policy, int32_t layer) {
    return policy->policy.layer_size(layer);
}

LLAMA_EXPERT_API int32_t llama_expert_policy_resident(const llama_expert_policy * policy, int32_t * keys,
        int32_t * slots, int32_t cap) {
    std::vector<std::pair<llama_expert_key, int32_t>> resident;
    policy->policy.resident(resident);
    for (int32_t i = 0; i < cap && (size_t) i < resident.size(); ++i) {
        keys[2*i]     = resident[i].first.layer;
        keys[2*i + 1] = resident[i].first.expert;
        slots[i]      = resident[i].second;
    }
    return (int32_t) resident.size();
}

LLAMA_EXPERT_API double llama_expert_policy_frequency(const llama_expert_policy * policy, int32_t layer,
        int32_t expert) {
    return policy->policy.frequency({layer, expert});
}

LLAMA_EXPERT_API double llama_expert_policy_next_use(llama_expert_policy * policy, int32_t layer, int32_t expert) {
    return policy->policy.next_use({layer, expert});
}

LLAMA_EXPERT_API int32_t llama_expert_policy_reuse_rates(const llama_expert_policy * policy, double * out,
        int32_t cap) {
    std::vector<double> rates;
    policy->policy.reuse_rates(rates);
    std::copy_n(rates.begin(), std::min<size_t>(std::max(cap, 0), rates.size()), out);
    return (int32_t) rates.size();
}

LLAMA_EXPERT_API int32_t llama_expert_policy_popular_layers(const llama_expert_policy * policy, int32_t * layers,
        int32_t cap) {
    std::vector<std::pair<int32_t, std::vector<double>>> popularity;
    policy->policy.popularity(popularity);
    for (int32_t i = 0; i < cap && (size_t) i < popularity.size(); ++i) {
        layers[i] = popularity[i].first;
    }
    return (int32_t) popularity.size();
}

// -1 also for a layer seen but never visited by a decode step nor seeded (no visits: no shares)
LLAMA_EXPERT_API int32_t llama_expert_policy_popularity(const llama_expert_policy * policy, int32_t layer,
        double * shares, int32_t cap) {
    std::vector<std::pair<int32_t, std::vector<double>>> popularity;
    policy->policy.popularity(popularity);
    const auto * found = find_layer(popularity, layer);
    if (found == nullptr) {
        return -1;
    }
    std::copy_n(found->second.begin(), std::min<size_t>(std::max(cap, 0), found->second.size()), shares);
    return (int32_t) found->second.size();
}

LLAMA_EXPERT_API void llama_expert_policy_seed(llama_expert_policy * policy, const int32_t * layers,
        const int32_t * n_shares, const double * shares, int32_t n_layers) {
    std::vector<std::pair<int32_t, std::vector<double>>> popularity(std::max(n_layers, 0));
    for (int32_t i = 0; i < n_layers; ++i) {
        popularity[i].first = layers[i];
        popularity[i].second.assign(shares, shares + n_shares[i]);
        shares += n_shares[i];
    }
    policy->policy.seed(popularity);
}

LLAMA_EXPERT_API int32_t llama_expert_policy_preload(llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, int32_t * load_keys, int32_t * load_slots) {
    policy->policy.preload(policy->read_keys(keys, n_keys), n_keys, policy->assignments);
    const int32_t n_loads = (int32_t) policy->assignments.size();
    for (int32_t i = 0; i < n_loads; ++i) {
        put_key(load_keys, i, policy->assignments[i].key);
        load_slots[i] = policy->assignments[i].slot;
    }
    return n_loads;
}

// the loads (keys [n][2] and slots, first-seen order) and the victims; -2: a negative id (nothing changed)
LLAMA_EXPERT_API int32_t llama_expert_policy_load_ahead(llama_expert_policy * policy, const int32_t * keys,
        int32_t n_keys, const int32_t * pinned, int32_t n_pinned, int32_t * load_keys, int32_t * load_slots,
        int32_t * evicted_keys, int32_t * evicted_slots, int32_t * n_evicted) {
    std::vector<llama_expert_key> pins(std::max(n_pinned, 0));
    for (int32_t i = 0; i < n_pinned; ++i) {
        pins[i] = {pinned[2*i], pinned[2*i + 1]};
    }
    *n_evicted = 0;
    if (!policy->policy.load_ahead(policy->read_keys(keys, n_keys), n_keys, pins.data(), n_pinned,
                                   policy->assignments, policy->evictions)) {
        return -2;
    }
    const int32_t n_loads = (int32_t) policy->assignments.size();
    for (int32_t i = 0; i < n_loads; ++i) {
        put_key(load_keys, i, policy->assignments[i].key);
        load_slots[i] = policy->assignments[i].slot;
    }
    const int32_t n_victims = (int32_t) policy->evictions.size();
    for (int32_t i = 0; i < n_victims; ++i) {
        put_key(evicted_keys, i, policy->evictions[i].key);
        evicted_slots[i] = policy->evictions[i].slot;
    }
    *n_evicted = n_victims;
    return n_loads;
}

} // extern "C"
