// ggml's own mul_mat over L weights, as llama.cpp computes a layer without repacked weights: one
// ggml graph of L mul_mats on a threadpool of T threads, the activations quantized by ggml itself.
// Called by benchmarks/ggml_probe.py through ctypes (built there against the kernels' ggml).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

extern "C" double ggml_mul_mat_ms(const void** weights, int layers, int64_t k, int64_t n, int type, const float* x,
                                  int64_t m, int threads, int reps, float* y) {
    ggml_cpu_init();
    ggml_init_params held{ggml_tensor_overhead() * static_cast<size_t>(layers) + 1024, nullptr, true};
    ggml_context* wctx = ggml_init(held);
    size_t work = sizeof(float) * static_cast<size_t>((k + n * layers) * m) + ggml_graph_overhead() +
                  ggml_tensor_overhead() * static_cast<size_t>(2 * layers + 2) + (1 << 20);
    ggml_context* ctx = ggml_init({work, nullptr, false});
    ggml_tensor* xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    std::copy(x, x + k * m, static_cast<float*>(xt->data));
    ggml_cgraph* graph = ggml_new_graph(ctx);
    std::vector<ggml_tensor*> outs;
    for (int l = 0; l < layers; ++l) {
        ggml_tensor* w = ggml_new_tensor_2d(wctx, static_cast<ggml_type>(type), k, n);
        w->data = const_cast<void*>(weights[l]);
        outs.push_back(ggml_mul_mat(ctx, w, xt));
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
    ggml_free(ctx);
    ggml_free(wctx);
    return best / layers;
}
