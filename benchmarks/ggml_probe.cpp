// ggml's own mul_mat over L weights, as llama.cpp computes a layer: one ggml graph of L mul_mats
// on a threadpool of T threads, the activations quantized by ggml itself; with `repacked`, the
// weights first set into ggml's CPU repack buffer (llama.cpp's default on CPUs that have one).
// Called by benchmarks/ggml_probe.py through ctypes (built there against the kernels' ggml).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

// ggml's CPU repack buffer type, or null where the CPU has none.
ggml_backend_buffer_type_t repack_type() {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    auto extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
    for (auto* type = extra ? extra(ggml_backend_reg_dev_get(reg, 0)) : nullptr; type && *type; ++type)
        if (std::strcmp(ggml_backend_buft_name(*type), "CPU_REPACK") == 0)
            return *type;
    return nullptr;
}

}  // namespace

extern "C" double ggml_mul_mat_ms(const void** weights, int layers, int64_t k, int64_t n, int type, const float* x,
                                  int64_t m, int threads, int reps, int repacked, float* y) {
    ggml_cpu_init();
    ggml_init_params held{ggml_tensor_overhead() * static_cast<size_t>(layers) + 1024, nullptr, true};
    ggml_context* wctx = ggml_init(held);
    size_t work = sizeof(float) * static_cast<size_t>((k + n * layers) * m) + ggml_graph_overhead() +
                  ggml_tensor_overhead() * static_cast<size_t>(2 * layers + 2) + (1 << 20);
    ggml_context* ctx = ggml_init({work, nullptr, false});
    ggml_tensor* xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    std::copy(x, x + k * m, static_cast<float*>(xt->data));
    ggml_cgraph* graph = ggml_new_graph(ctx);
    std::vector<ggml_tensor*> ws, outs;
    for (int l = 0; l < layers; ++l)
        ws.push_back(ggml_new_tensor_2d(wctx, static_cast<ggml_type>(type), k, n));
    ggml_backend_buffer_t buffer = nullptr;
    ggml_backend_buffer_type_t repack = repacked ? repack_type() : nullptr;
    if (repacked && repack == nullptr)
        return -1;
    if (repack != nullptr) {
        buffer = ggml_backend_alloc_ctx_tensors_from_buft(wctx, repack);
        for (int l = 0; l < layers; ++l)
            ggml_backend_tensor_set(ws[l], weights[l], 0, ggml_nbytes(ws[l]));
    } else {
        for (int l = 0; l < layers; ++l)
            ws[l]->data = const_cast<void*>(weights[l]);
    }
    for (int l = 0; l < layers; ++l) {
        outs.push_back(ggml_mul_mat(ctx, ws[l], xt));
        ggml_build_forward_expand(graph, outs.back());
    }
    ggml_threadpool_params params = ggml_threadpool_params_default(threads);
    ggml_threadpool* pool = ggml_threadpool_new(&params);
    ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    std::vector<uint8_t> scratch(plan.work_size);
    plan.work_data = scratch.data();
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
        auto start = std::chrono::steady_clock::now();
        ggml_graph_compute(graph, &plan);
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    const float* first = static_cast<const float*>(outs[0]->data);
    std::copy(first, first + n * m, y);
    ggml_threadpool_free(pool);
    if (buffer != nullptr)
        ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
    ggml_free(wctx);
    return best / layers;
}
