// One weight of a node's call, and the kernels its columns go through: the op's own multi-row
// kernels, ggml's one-row kernels (vec_dot, gemv), ggml's gemm, ggml's own mul_mat, or the AMX
// tiles, as the weight's type (weight_types.h) and the pass's flags say.
//
// With GEMM (prompt passes), ggml's batched kernels take over where they are faster: its own
// mul_mat for rows as stored (its tiled kernels for the K-quants from 8 rows on, as llama.cpp
// reads a prompt through a Q6_K weight), Q4_K rows put back as stored for it from TILED_ROWS rows,
// and its gemm for IQ4_NL; where the CPU has AMX, from AMX_ROWS rows the op's own bf16 tile kernels
// instead (weights and activations in bf16, f32 sums). Their rows round differently with where
// they fall in a pass. Without gemm, a row's result never depends on the other rows, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "activations.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "shared.h"
#include "weight_types.h"

namespace specchat {

struct TiledActivations;

// One weight of a call: its n rows against the m quantized activation rows, into y [m, n].
struct Product {
    ggml_type type;
    const ggml_type_traits_cpu* tr;
    const OwnKernels* own_kernels;  // the op's own for the rows' layout (the type's row of the table)
    const Interleaved* il;          // null: rows as stored (vec_dot)
    bool gemm;                      // interleaved rows by ggml's gemm
    bool own;                       // rows by the op's own multi-row kernel (has_rows_kernel), else ggml's row by row
    bool narrow;                    // the own kernel in 256 bits where the table has it (narrow_rows)
    bool read_ahead;                // the own kernel prefetches the blocks it reads next,
    bool into_l1;                   // into the core's L1 cache, else into its L2 alone (ReadAhead)
    bool by_ggml;                   // rows (put back) as stored by ggml's own mul_mat
    const TiledActivations* tiles;  // null, or the activations in bf16 tiles: p by the AMX tiles
    const uint8_t* w;
    size_t w_row;
    int64_t n;
    const Quantized* x;
    float* y;

    int64_t unit() const {  // columns stay whole interleaved groups
        return il ? INTERLEAVE : 1;
    }
    // Whether the rows go through the op's own multi-row kernel where a pass has several rows
    // (the table's, on AVX2 and up): with gemm too, but for Q4_K rows put back as stored from
    // TILED_ROWS rows.
    bool has_rows_kernel() const {
        return own_kernels->rows != nullptr;
    }
    // Whether the activations can go in 14 bits (the table's, where the CPU has AVX-512 VNNI).
    bool takes_fine() const {
        return own_kernels->fine_rows != nullptr;
    }
};

// Columns [first, last) of p, every row.
void multiply_columns(const Product& p, int64_t m, int64_t k, int64_t first, int64_t last);

}  // namespace specchat
