// The table of kernels per ggml weight type (weight_types.h). A new candidate kernel for a type
// is one entry in its row and the kernel in its family's file (row_kernels.cpp, amx_tiles.cpp); a
// new type with kernels of its own is one more row.
#include "weight_types.h"

#include <array>
#include <cstdio>

#include "activations.h"
#include "amx_tiles.h"
#include "blocks.h"
#include "instructions.h"
#include "repack.h"  // ggml's interleaved gemm and gemv (ggml/src/ggml-cpu)
#include "row_kernels.h"

namespace specchat {

namespace {

// A kernel where this build has its family, else null (instructions.h).
#if defined(__AVX2__)
#define AVX2_KERNEL(kernel) kernel
#else
#define AVX2_KERNEL(kernel) nullptr
#endif
#ifdef VNNI_512
#define VNNI_512_KERNEL(kernel) kernel
#else
#define VNNI_512_KERNEL(kernel) nullptr
#endif
#ifdef AMX_TILES
#define AMX_KERNEL(kernel) kernel
#else
#define AMX_KERNEL(kernel) nullptr
#endif

// The op's own kernels and ggml's interleaved ones, by type; a type without a row here is
// multiplied by ggml's one-row kernel (vec_dot) alone.
std::array<WeightType, GGML_TYPE_COUNT> own_kernels() {
    std::array<WeightType, GGML_TYPE_COUNT> table{};
    // Each row: {dot type,
    //            as stored: {rows, fine rows (14 bits), AMX tiles, rows in 256 bits},
    //            interleaved: {rows, fine rows (14 bits), AMX tiles, rows in 256 bits},
    //            ggml's interleaved: {quantize four rows, gemv, gemm, put back as stored}}
    table[GGML_TYPE_Q4_K] = {
        GGML_TYPE_Q8_K,
        {},
        {AVX2_KERNEL(gemv_rows_q4_K<block_q8_K>),
         VNNI_512_KERNEL(gemv_rows_q4_K<block_q14>),
         AMX_KERNEL(q4_K_tiles),
         VNNI_512_KERNEL(narrow::q4_K_rows)},
        {ggml_quantize_mat_q8_K_4x8, ggml_gemv_q4_K_8x8_q8_K, ggml_gemm_q4_K_8x8_q8_K, deinterleave_q4_K}};
    table[GGML_TYPE_Q6_K] = {
        GGML_TYPE_Q8_K,
        {AVX2_KERNEL(vec_dot_rows_q6_K<block_q8_K>),
         VNNI_512_KERNEL(vec_dot_rows_q6_K<block_q14>),
         AMX_KERNEL(q6_K_tiles),
         VNNI_512_KERNEL(narrow::q6_K_rows)},
        {},
        {}};
    table[GGML_TYPE_Q4_0] = {
        GGML_TYPE_Q8_0,
        {},
        {AVX2_KERNEL(gemv_rows_q4_0), nullptr, nullptr, VNNI_512_KERNEL(narrow::q4_0_rows)},
        {ggml_quantize_mat_q8_0_4x8, ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0, nullptr}};
    table[GGML_TYPE_IQ4_NL] = {
        GGML_TYPE_Q8_0,
        {},
        {},
        {ggml_quantize_mat_q8_0_4x8, ggml_gemv_iq4_nl_8x8_q8_0, ggml_gemm_iq4_nl_8x8_q8_0, nullptr}};
    return table;
}

// ggml's warnings and errors go to stderr; its notes (one per weight it repacks) are dropped.
void log_warnings(ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR)
        std::fputs(text, stderr);
}

// The table with ggml's kernels for every type, ggml's CPU backend set up first.
std::array<WeightType, GGML_TYPE_COUNT> built() {
    ggml_log_set(log_warnings, nullptr);
    ggml_cpu_init();
    auto table = own_kernels();
    for (int type = 0; type < GGML_TYPE_COUNT; ++type) {
        WeightType& row = table[static_cast<size_t>(type)];
        row.ggml = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
        // (the op's own kernels read the blocks ggml's quantizer writes for the type: a pinned
        // ggml that quantizes its activations to another type stops here, not in wrong sums)
        GGML_ASSERT(row.dot == GGML_TYPE_COUNT || (row.ggml != nullptr && row.dot == row.ggml->vec_dot_type));
    }
    return table;
}

}  // namespace

const WeightType* weight_type(int64_t type) {
    static const std::array<WeightType, GGML_TYPE_COUNT> table = built();
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return nullptr;
    const WeightType& row = table[static_cast<size_t>(type)];
    return row.ggml != nullptr && row.ggml->vec_dot != nullptr ? &row : nullptr;
}

}  // namespace specchat
