// llamapack expert-provider hook: the glue the patched llama.cpp sources call.
//
// Copied into the vendored llama.cpp as src/llama-expert-impl.h. Each function here is one call site in
// patches/0001-expert-provider-hook.patch; the logic lives in llama-expert.cpp.
#pragma once

#include "llama-expert.h"

#include <cstdint>
#include <initializer_list>
#include <string>

struct ggml_backend_sched;
struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct llama_context;
struct llama_model_loader;
struct llama_expert_hook;

// loader: should this tensor be forced lazy (pack mode, routed-expert weight)?
bool llama_expert_force_lazy(const std::string & tensor_name);

// model: record the routed-expert tensors once they are created (file offsets from the loader)
void llama_expert_model_init(llama_model & model, const llama_model_loader & ml);

// context: refuse to decode when experts are lazy and nothing serves them, or warmup in pack mode.
// Returns false (after logging why) when the decode must not run.
bool llama_expert_decode_allowed(const llama_context & lctx, bool warmup);

// context: true (and clears the flag) when the provider failed during the last graph compute
// after a ubatch's compute (sched, graph: the ubatch's): serves its whole-pool steps, then takes the failure flag
bool llama_expert_take_failure(llama_expert_hook * hook, ggml_backend_sched * sched, ggml_cgraph * graph);

// graph: reuse is only valid for the same hook state
uint64_t llama_expert_hook_generation(const llama_expert_hook * hook);

// graph: one remap per MoE layer. Empty (ids == nullptr) when the layer is not served by a pool.
struct llama_expert_remap {
    llama_expert_hook * hook = nullptr;
    ggml_tensor       * ids  = nullptr; // I32 slot ids [n_expert_used, n_tokens]
    // whole-pool graphs: the ids count from the layer's first slot, and the matmuls take its slot view
    bool                whole_pool = false;
    // layer windows: 1 + the window whose view the matmuls take (the ids are the expert ids); 0: none
    int32_t             window = 0;
    // hybrid (llama_expert_hybrid_set): rows computed on the CPU [n_embd, n_expert_used, n_tokens], and per row
    // where merge takes it from (k: the CPU's, n_expert_used + k: the pool's)
    ggml_tensor       * cpu_rows = nullptr;
    ggml_tensor       * pick     = nullptr;
};

// ffn_input [n_embd, n_tokens]: the FFN input (the lookahead's guesses, and hybrid's CPU rows). ffn_op,
// weight_before_ffn and expert_extras (biases, scales; null when absent) say whether hybrid may split the layer.
// sched: the graph's scheduler (the slot lookup pins its get_rows to the pool's GPU and copies through it).
llama_expert_remap llama_expert_remap_build(
        llama_expert_hook * hook, ggml_context * ctx, ggml_backend_sched * sched, ggml_tensor * selected_experts,
        ggml_tensor * ffn_input, std::initializer_list<ggml_tensor *> expert_weights, int ffn_op, bool weight_before_ffn,
        std::initializer_list<ggml_tensor *> expert_extras);

// point a freshly built mul_mat_id node at the pool tensor and the slot ids (no-op for an empty remap)
void llama_expert_remap_apply(const llama_expert_remap * remap, ggml_tensor * mul_mat_id);

// hybrid: the down projection's rows [n_embd, n_expert_used, n_tokens], each from the CPU or the pool as the
// remap op chose (returns experts unchanged when the layer is not split)
ggml_tensor * llama_expert_remap_merge(const llama_expert_remap * remap, ggml_context * ctx, ggml_tensor * experts);
