// The constants the op shares with Python, each defined once, in engine/ggml.py:
// engine/prepare/kernels.py hands them to the build as definitions (SPECCHAT_SHARED in
// CMakeLists.txt), so the flag bits a pass sets and the widths the engine and its probes name are
// the ones the op reads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace specchat {

// The flags input's bits: a pass multiplies by ggml's batched kernels (prompt passes), or by
// activations in 14 bits (block_q14, where the CPU can; not with GEMM).
constexpr int64_t GEMM = SPECCHAT_GEMM, FINE = SPECCHAT_FINE;
constexpr size_t FIRST_WEIGHT = SPECCHAT_FIRST_WEIGHT;  // the first weight's input (after x and the flags)
constexpr int64_t INTERLEAVE = SPECCHAT_INTERLEAVE;     // weight rows interleaved together
constexpr int64_t GEMM_ROWS = SPECCHAT_GEMM_ROWS;       // activation rows a gemm call takes at a time
// From this many rows a prompt pass puts interleaved Q4_K rows back as stored and multiplies them
// by ggml's tiled kernels; below, by the op's own multi-row kernel (engine/ggml.py says why).
constexpr int64_t TILED_ROWS = SPECCHAT_TILED_ROWS;
constexpr int64_t AMX_ROWS = SPECCHAT_AMX_ROWS;  // a prompt pass takes the AMX tiles from this many rows

}  // namespace specchat
