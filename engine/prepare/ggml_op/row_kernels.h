// The op's own multi-row kernels (row_kernels.cpp), on AVX2 and up: RowsKernel's (weight_types.h)
// for the table's rows. Rows that share a pass share its weight reads: the kernels unpack a block
// of weights once for every activation row, and give each row exactly what ggml's one-row kernel
// gives it (Q4_K and Q4_0 interleaved: its gemv; Q6_K as stored: its vec_dot), bit for bit. Those
// compute the integer sums of each block exactly (no term can overflow), then accumulate them in
// f32 in a fixed order; the integer sums are computed here another way (VNNI where the CPU has
// it) and the f32 steps are theirs, in their order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "instructions.h"
#include "weight_types.h"

namespace specchat {

#if defined(__AVX2__)
// A group of 8 interleaved Q4_K rows by activations of block_q8_K, or of block_q14 (VNNI_512).
template <typename A>
void gemv_rows_q4_K(const uint8_t* w, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row);
// A group of 8 interleaved Q4_0 rows by activations of block_q8_0.
void gemv_rows_q4_0(const uint8_t* w, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row);
// One Q6_K row as stored by activations of block_q8_K, or of block_q14 (VNNI_512).
template <typename A>
void vec_dot_rows_q6_K(const uint8_t* w, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row, int64_t rows,
                       float* y, int64_t y_row);
#ifdef VNNI_512
// The three by block_q8_K on 256-bit registers alone (row_kernels.cpp built again): where the CPU
// has both widths, a candidate the op times against the 512-bit ones (tuning.h).
namespace narrow {
extern const RowsKernel q4_K_rows, q4_0_rows, q6_K_rows;
}  // namespace narrow
#endif
#endif

}  // namespace specchat
