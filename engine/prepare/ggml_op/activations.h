// A pass's activations quantized for the weights' kernels: once per dot type and layout a node's
// weights take, as llama.cpp quantizes them (Q8_K for the K-quants, Q8_0 for the legacy ones), or
// in the op's own 14-bit blocks (block_q14) where a pass's flags ask for FINE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ggml.h"
#include "instructions.h"
#include "repack.h"  // QK_K (ggml/src/ggml-common.h)
#include "weight_types.h"

namespace specchat {

#ifdef VNNI_512
// Activations in 14 bits where a block needs them, the op's finer dot type (docs/design.md,
// "Activations in 14 bits"): per 256 values a scale d and integers a, the value d * a, each a
// kept as two signed bytes, a = 128 hi + lo, which the VNNI units multiply by the weights' bytes as
// they multiply Q8_K's. A block whose largest value stands out from the rest (an LLM's few huge
// activation channels) is fine: a in [-8191, 8191], lo in [-64, 63], two products for one, each
// value rounded 64 times finer than Q8_K rounds it. Any other block is coarse: a in [-127, 127]
// as Q8_K rounds it, all in lo, hi zero, and the kernels leave out the high products of a block
// no row of theirs has fine. Every integer sum is exact either way. The sums of a that the
// K-quants' offsets take (over each 32 values for Q4_K's mins, each 16 for Q6_K's 32) are kept as
// their low 15 bits and the rest, for 16-bit multiply-adds.
struct block_q14 {
    float d;
    int32_t sums32_low[QK_K / 64], sums32_high[QK_K / 64];  // entry t: sub-blocks 2t and 2t + 1, 16 bits each
    int16_t sums16_low[QK_K / 16], sums16_high[QK_K / 16];
    int8_t lo[QK_K];
    int8_t hi[QK_K];
    bool fine;  // hi holds anything but zeros
};
#endif

// The activations in one dot type and layout, m rows of k values.
struct Quantized {
    ggml_type type;
    const Interleaved* gemm;  // whole fours of rows in this gemm's layout; null: row by row
    bool fine;                // in 14-bit blocks (block_q14) rather than `type`'s
    size_t row;               // bytes per row
    std::vector<uint8_t> data;
};

// Quantize x into q: for the gemm, whole fours of rows in its layout and the rest row by row (as
// llama.cpp quantizes them), else every row by itself.
void quantize(const float* x, int64_t m, int64_t k, Quantized& q);

}  // namespace specchat
