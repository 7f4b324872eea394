// A node's work around its products (fusion.h).
#include "fusion.h"

#include <cmath>

// ggml's vector kernels (ggml-cpu's vec.h, linked in with its CPU backend).
extern "C" void ggml_vec_swiglu_f32(int n, float* y, const float* x, const float* g);

namespace specchat {

void rms_norm(const float* x, const float* gamma, float eps, int64_t m, int64_t k, float* out) {
    for (int64_t r = 0; r < m; ++r) {
        const float* row = x + r * k;
        double sum = 0.0;
        for (int64_t i = 0; i < k; ++i)
            sum += static_cast<double>(row[i] * row[i]);
        const float mean = static_cast<float>(sum / static_cast<double>(k));
        const float scale = 1.0f / std::sqrt(mean + eps);
        float* y = out + r * k;
        for (int64_t i = 0; i < k; ++i)
            y[i] = (row[i] * scale) * gamma[i];
    }
}

void add_bias(float* y, const float* bias, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c)
            y[r * n + c] += bias[c];
}

void swiglu(const float* gate, const float* up, int64_t m, int64_t n, float* y) {
    for (int64_t r = 0; r < m; ++r)
        ggml_vec_swiglu_f32(static_cast<int>(n), y + r * n, gate + r * n, up + r * n);
}

void add_residual(float* y, const float* r, int64_t size) {
    for (int64_t i = 0; i < size; ++i)
        y[i] += r[i];
}

}  // namespace specchat
