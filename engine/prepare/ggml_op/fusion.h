// What a node computes around its weights' products, so that the plugin runs one node where it ran
// up to five (each node it runs costs it some microseconds a pass whatever its work: on 2 AVX2
// cores about 9, docs/benchmarks.md, "What a step costs beside its bytes"): its input RMS-normed,
// a bias added to each product, the SwiGLU of its first two products as its one output, a
// residual added to its (first) output. Each as llama.cpp computes it (ggml's rms_norm and mul,
// add, swiglu), row by row: a row's result never depends on the pass's other rows.
#pragma once

#include <cstdint>

namespace specchat {

// Each of the m rows of x [m, k] RMS-normed and times gamma [k], into out [m, k]: the squares
// summed in double, then x times 1 / sqrt(mean + eps), then times gamma (ggml's rms_norm and mul).
void rms_norm(const float* x, const float* gamma, float eps, int64_t m, int64_t k, float* out);

// y [m, n] += bias [n], per row.
void add_bias(float* y, const float* bias, int64_t m, int64_t n);

// y [m, n] = silu(gate) * up, element by element (ggml's swiglu).
void swiglu(const float* gate, const float* up, int64_t m, int64_t n, float* y);

// y [size] += r [size].
void add_residual(float* y, const float* r, int64_t size);

}  // namespace specchat
