// llamapack: hybrid execution, the CPU half (see llama-expert-hybrid.h).
//
// Copied into the vendored llama.cpp as src/llama-expert-hybrid.cpp. One small ggml graph per step, on a
// thread pool of its own: per distinct expert, mul_mat_id over a one-expert view of its RAM block (ids all
// 0) for gate and up, the GLU, mul_mat_id for down - the kernels and the op order of the vanilla graph's
// CPU placement under --cpu-moe.
#include "llama-expert-hybrid.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>

std::unique_ptr<llama_expert_cpu_experts> llama_expert_cpu_experts::create(int32_t n_threads, std::string & error) {
    std::unique_ptr<llama_expert_cpu_experts> cpu(new llama_expert_cpu_experts());
    cpu->threads = std::max(1, std::min(n_threads, (int32_t) GGML_MAX_N_THREADS));
    ggml_threadpool_params params = ggml_threadpool_params_default(cpu->threads);
    cpu->pool = ggml_threadpool_new(&params);
    if (cpu->pool == nullptr) {
        error = "hybrid: could not start " + std::to_string(cpu->threads) + " CPU threads";
        return nullptr;
    }
    return cpu;
}

llama_expert_cpu_experts::~llama_expert_cpu_experts() {
    if (pool != nullptr) {
        ggml_threadpool_free(pool);
    }
}

static size_t padded(size_t nbytes) {
    return (nbytes + GGML_MEM_ALIGN - 1) / GGML_MEM_ALIGN * GGML_MEM_ALIGN;
}

bool llama_expert_cpu_experts::compute(const llama_expert_cpu_layer & layer, const char * input, uint64_t input_nb1,
                                       int64_t n_embd, std::vector<llama_expert_cpu_row> & rows, float * out,
                                       std::string & error) {
    if (rows.empty()) {
        return true;
    }
    if (layer.glu < 0 || layer.gate.type < 0 || layer.up.type < 0 || layer.down.type < 0 ||
            layer.gate.ne0 != n_embd || layer.up.ne0 != n_embd || layer.down.ne1 != n_embd ||
            layer.down.ne0 != layer.up.ne1 || layer.gate.ne1 != layer.up.ne1) {
        error = "hybrid: this layer's experts cannot be computed on the CPU (shapes or activation)";
        return false;
    }
    // one group of rows per distinct expert (block)
    std::stable_sort(rows.begin(), rows.end(), [](const auto & a, const auto & b) { return a.block < b.block; });
    std::vector<std::pair<size_t, size_t>> groups; // [first, end) in rows
    for (size_t i = 0; i < rows.size(); ++i) {
        if (groups.empty() || rows[groups.back().first].block != rows[i].block) {
            groups.push_back({i, i});
        }
        groups.back().second = i + 1;
    }

    const int64_t n_ff = layer.up.ne1;
    const size_t  n_rows = rows.size();
    const size_t  n_nodes = 8 * groups.size() + 8;
    const size_t  per_tensor = ggml_tensor_overhead() + GGML_MEM_ALIGN;
    size_t arena_bytes = ggml_graph_overhead_custom(n_nodes, false) + 6 * groups.size() * per_tensor + 4096;
    arena_bytes += padded(n_embd * n_rows * sizeof(float)) * 2 + padded(n_ff * n_rows * sizeof(float)) * 3 +
                   groups.size() * padded(n_rows * sizeof(int32_t));
    if (arena.size() < arena_bytes) {
        arena.resize(arena_bytes);
    }
    const size_t weight_bytes = 3 * groups.size() * per_tensor + 1024;
    if (weights.size() < weight_bytes) {
        weights.resize(weight_bytes);
    }
    ggml_context * ctx  = ggml_init({ arena.size(), arena.data(), false });
    ggml_context * wctx = ggml_init({ weights.size(), weights.data(), true });
    if (ctx == nullptr || wctx == nullptr) {
        if (ctx) ggml_free(ctx);
        if (wctx) ggml_free(wctx);
        error = "hybrid: ggml_init failed";
        return false;
    }
    auto weight_view = [&](const llama_expert_cpu_role & role, const char * block) {
        ggml_tensor * w = ggml_new_tensor_3d(wctx, (ggml_type) role.type, role.ne0, role.ne1, 1);
        w->data = (void *) (block + role.block_offset);
        return w;
    };
    ggml_cgraph * graph = ggml_new_graph_custom(ctx, n_nodes, false);
    std::vector<ggml_tensor *> results;
    for (const auto & [first, end] : groups) {
        const int64_t m = (int64_t) (end - first);
        ggml_tensor * x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, m);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, m);
        for (int64_t j = 0; j < m; ++j) {
            memcpy((char *) x->data + j * x->nb[2], input + (uint64_t) rows[first + j].token * input_nb1,
                   n_embd * sizeof(float));
        }
        memset(ids->data, 0, ggml_nbytes(ids));
        const char * block = rows[first].block;
        ggml_tensor * up   = ggml_mul_mat_id(ctx, weight_view(layer.up, block), x, ids);   // [n_ff, 1, m]
        ggml_tensor * gate = ggml_mul_mat_id(ctx, weight_view(layer.gate, block), x, ids); // [n_ff, 1, m]
        ggml_tensor * act  = ggml_glu_split(ctx, gate, up, (ggml_glu_op) layer.glu);
        ggml_tensor * down = ggml_mul_mat_id(ctx, weight_view(layer.down, block), act, ids); // [n_embd, 1, m]
        ggml_build_forward_expand(graph, down);
        results.push_back(down);
    }
    ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    if (work.size() < plan.work_size) {
        work.resize(plan.work_size);
    }
    plan.work_data = work.data();
    const ggml_status status = ggml_graph_compute(graph, &plan);
    if (status == GGML_STATUS_SUCCESS) {
        for (size_t g = 0; g < groups.size(); ++g) {
            const ggml_tensor * down = results[g];
            for (size_t j = 0; j < groups[g].second - groups[g].first; ++j) {
                memcpy(out + (size_t) rows[groups[g].first + j].row * n_embd, (const char *) down->data + j * down->nb[2],
                       n_embd * sizeof(float));
            }
        }
    } else {
        error = "hybrid: the CPU graph failed (ggml status " + std::to_string((int) status) + ")";
    }
    ggml_free(ctx);
    ggml_free(wctx);
    return status == GGML_STATUS_SUCCESS;
}
