// llamapack: hybrid execution, the CPU half (contract: llama_expert_hybrid_set in llama-expert.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-hybrid.h. Computes some (token, expert) rows of
// one MoE layer on the CPU, from the experts' bytes in RAM blocks, with ggml's own CPU kernels: for each
// expert, mul_mat_id (gate, up), the layer's GLU, mul_mat_id (down) - the ops --cpu-moe runs on the CPU.
// Each output row is a function of that row's input and weights alone, so computing a subset of the rows
// gives the bits the full op gives for them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct ggml_threadpool;

// one role's expert matrix inside a RAM block
struct llama_expert_cpu_role {
    int32_t  type = -1;    // enum ggml_type, -1: the layer has no such role
    int64_t  ne0 = 0, ne1 = 0;
    uint64_t block_offset = 0;
};

// what the CPU needs of one served layer
struct llama_expert_cpu_layer {
    llama_expert_cpu_role gate, up, down;
    int32_t glu = -1; // enum ggml_glu_op for gate/up (SWIGLU, GEGLU), -1: this layer is not computed here
};

// one (token, expert) row to compute: out row `row` (token * n_used + k) from the expert in `block`
struct llama_expert_cpu_row {
    int32_t      row;
    int32_t      token;
    const char * block;
};

class llama_expert_cpu_experts {
public:
    // nullptr with error set when the threads cannot start
    static std::unique_ptr<llama_expert_cpu_experts> create(int32_t n_threads, std::string & error);
    ~llama_expert_cpu_experts();

    // input: [n_embd, n_tokens] F32 (row stride input_nb1); out: [n_embd, n_used, n_tokens] F32, contiguous.
    // Writes the rows listed, leaves the others. False with error set when ggml refuses the graph.
    bool compute(const llama_expert_cpu_layer & layer, const char * input, uint64_t input_nb1, int64_t n_embd,
                 std::vector<llama_expert_cpu_row> & rows, float * out, std::string & error);

    int32_t n_threads() const { return threads; }

private:
    llama_expert_cpu_experts() = default;

    ggml_threadpool *    pool = nullptr;
    int32_t              threads = 1;
    std::vector<uint8_t> arena;     // the graph's tensors and intermediate results
    std::vector<uint8_t> weights;   // tensor headers of the weight views (no data)
    std::vector<uint8_t> work;      // ggml_graph_plan's work buffer
};
