// The op's kernels per ggml weight type, in one table indexed by the type as ggml's own
// type_traits_cpu is (weight_types.cpp): the code that multiplies never asks which type it has.
//
// Rows of Q4_K and Q4_0 (interleaved) and Q6_K (as stored) go through the op's own kernels, which
// share each block's unpacking among a pass's rows and give every row what ggml's one-row kernel
// gives it (gemv for interleaved weights, vec_dot for rows as stored), bit for bit; other types go
// row by row through those. With FINE, the op's own Q4_K and Q6_K kernels take a block of
// activations whose largest value stands out in 14 bits instead (on AVX-512 VNNI; block_q14),
// each row still alike at any width: the file's model to a rounding 64 times finer where an LLM's
// huge activation channels would leave Q8_K a handful of levels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ggml-cpu.h"
#include "ggml.h"

namespace specchat {

// How a kernel reads its weight rows ahead of use: no further than `end`, the last byte of the
// thread's weight rows (at or before the rows' start: nothing ahead), into the core's L1 cache or
// its L2 alone. Each prefetch into L1 holds one of the core's few line-fill slots until its line
// arrives: on an AVX-512 AMD EPYC Zen 4 that capped a core's reads where a pass had rows enough to
// compute for long, and its L2 takes far more lines in flight (docs/benchmarks.md, "Reading ahead
// into L2"). Which is faster is timed where the op runs (tuning.h).
struct ReadAhead {
    const void* end;
    bool into_l1;
};

// A unit of weight rows (a group of INTERLEAVE interleaved rows, or one row as stored) of k values
// at `w` by `rows` activation rows (`x_row` bytes apart) into y (rows `y_row` floats apart),
// reading the thread's next weight rows ahead as `ahead` says.
using RowsKernel = void (*)(const uint8_t* w, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row,
                            int64_t rows, float* y, int64_t y_row);
// A unit of weight rows (`blocks` blocks each) into the AMX bf16 weight tiles `w` as rows col ..
using TilePacker = void (*)(const uint8_t* rows, int64_t blocks, int64_t col, uint16_t* w);
using Gemx = void (*)(int, float*, size_t, const void*, const void*, int, int);
using Quantize4 = void (*)(const float*, void*, int64_t);
using Deinterleave = void (*)(const uint8_t* group, uint8_t* rows, int64_t blocks);

// The op's own kernels for a type's rows laid out one way; each null where it has none.
struct OwnKernels {
    // The rows by a pass's activations in the dot type, shared among the rows; null: ggml's
    // one-row kernel row by row.
    RowsKernel rows;
    // The same by activations in 14 bits (block_q14); null: the rows take the dot type's even
    // where a pass's flags ask for FINE.
    RowsKernel fine_rows;
    // The rows straight into the AMX tiles' bf16; null: by ggml's to_float first.
    TilePacker tiles;
    // `rows` on 256-bit registers alone, where the CPU has 512-bit VNNI too (a candidate the op
    // times: tuning.h); null elsewhere.
    RowsKernel narrow_rows;
};

// ggml's kernels for a type whose weight rows are interleaved 8 at a time: on x86 (AVX2 and up)
// the layout ggml's repack buffer chooses for these types.
struct Interleaved {
    Quantize4 quantize4;  // four activation rows into the gemm's interleaved dot-type blocks
    Gemx gemv;
    Gemx gemm;
    // Null, or the rows back as stored: a prompt pass of TILED_ROWS rows or more then multiplies
    // them by ggml's own mul_mat (its tiled kernels), faster than its gemm.
    Deinterleave deinterleave;
};

// One ggml weight type's row of the table.
struct WeightType {
    // The dot type the op's own kernels read (GGML_TYPE_COUNT: the type has none of them). It is
    // ggml's vec_dot_type for the type, checked when the table is built: a pass's activations are
    // quantized once for ggml's kernels and the op's alike.
    ggml_type dot = GGML_TYPE_COUNT;
    OwnKernels own_stored;       // on rows as the file stores them (ggml's one-row kernel: vec_dot)
    OwnKernels own_interleaved;  // on rows interleaved 8 at a time (ggml's one-row kernel: gemv)
    Interleaved ggml_interleaved;  // gemv null: ggml has no interleaved kernels for the type
    // ggml's for rows as stored: vec_dot, and the dot type (vec_dot_type) and its quantizer.
    const ggml_type_traits_cpu* ggml = nullptr;

    const OwnKernels& own(bool interleaved) const {
        return interleaved ? own_interleaved : own_stored;
    }
    // ggml's interleaved kernels for the type, or null.
    const Interleaved* interleaved() const {
        return ggml_interleaved.gemv != nullptr ? &ggml_interleaved : nullptr;
    }
};

// `type`'s row, or null where ggml has no CPU dot product for it. (The first call sets ggml's
// CPU backend up.)
const WeightType* weight_type(int64_t type);

}  // namespace specchat
