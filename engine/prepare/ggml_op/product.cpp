// A weight's columns through its kernels (product.h).
#include "product.h"

#include <algorithm>
#include <vector>

#include "amx_tiles.h"
#include "instructions.h"

namespace specchat {

namespace {

// Output columns a thread takes at a time in a pass of several rows (a multiple of INTERLEAVE):
// their weight rows stay in the core's L2 while a tile of activation rows passes. A 1-row pass
// takes its whole range at once (in one call, a plain step is faster by a tenth).
constexpr int64_t COLUMNS_PER_BLOCK = 256;
// Activation rows multiplied with a block of weight rows before the next block (a multiple of
// GEMM_ROWS): their quantized copies stay in cache however long the pass (a prompt).
constexpr int64_t ROWS_PER_TILE = 64;
static_assert(COLUMNS_PER_BLOCK % INTERLEAVE == 0 && ROWS_PER_TILE % GEMM_ROWS == 0, "whole groups and fours");
constexpr size_t GRAPH_NODES = 4;  // ggml's graph of one mul_mat: its weight, activations and result

// Columns [first, last) of rows [r0, r1) (r0 a multiple of GEMM_ROWS).
void multiply_block(const Product& p, int64_t k, int64_t r0, int64_t r1, int64_t first, int64_t last) {
    const uint8_t* xq = p.x->data.data();
    // (a single row too: its bits are gemv's and vec_dot's, and the kernels prefetch their blocks
    // ahead, which shortened a plain step where memory ran slow: docs/benchmarks.md, "The op's
    // fixed constants")
    if (!p.gemm && p.own) {
        const OwnKernels& own = *p.own_kernels;
        const RowsKernel rows = p.x->fine                                ? own.fine_rows
                                : p.narrow && own.narrow_rows != nullptr ? own.narrow_rows
                                                                         : own.rows;
        const ReadAhead ahead{p.w + (p.read_ahead ? last : first) * p.w_row, p.into_l1};
        for (int64_t col = first; col < last; col += p.unit())
            rows(p.w + col * p.w_row, k, ahead, xq + r0 * p.x->row, p.x->row, r1 - r0, p.y + r0 * p.n + col, p.n);
        return;
    }
    if (p.il == nullptr) {
        for (int64_t col = first; col < last; ++col)
            for (int64_t row = r0; row < r1; ++row)
                p.tr->vec_dot(static_cast<int>(k), p.y + row * p.n + col, 0, p.w + col * p.w_row, 0,
                              xq + row * p.x->row, 0, 1);
        return;
    }
    const int cols = static_cast<int>(last - first);
    const uint8_t* w = p.w + first * p.w_row;
    const int64_t fours = p.gemm ? (r1 - r0) / GEMM_ROWS * GEMM_ROWS : 0;
    if (fours > 0)
        p.il->gemm(static_cast<int>(k), p.y + r0 * p.n + first, p.n, w, xq + r0 * p.x->row, static_cast<int>(fours), cols);
    for (int64_t row = r0 + fours; row < r1; ++row)
        p.il->gemv(static_cast<int>(k), p.y + row * p.n + first, p.n, w, xq + row * p.x->row, 1, cols);
}

// `cols` weight rows as stored (`w_row` bytes apart) by the m activation rows `x`, into y (rows
// `y_row` floats apart), through ggml's own mul_mat on this thread (its tiled kernels for the
// K-quants from 8 rows on, llamafile's sgemm for the legacy ones): a prompt pass's way.
void multiply_by_ggml(ggml_type type, const uint8_t* w, size_t w_row, int64_t cols, const Quantized& x, float* y,
                      int64_t y_row, int64_t m, int64_t k) {
    thread_local std::vector<uint8_t> context(3 * ggml_tensor_overhead() +
                                              ggml_graph_overhead_custom(GRAPH_NODES, false));
    thread_local std::vector<uint8_t> work;
    ggml_init_params params{context.size(), context.data(), true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* weight = ggml_new_tensor_2d(ctx, type, k, cols);
    weight->data = const_cast<uint8_t*>(w);
    weight->nb[1] = w_row;
    weight->nb[2] = weight->nb[3] = w_row * static_cast<size_t>(cols);
    ggml_tensor* activations = ggml_new_tensor_2d(ctx, x.type, k, m);
    activations->data = const_cast<uint8_t*>(x.data.data());
    ggml_tensor* product = ggml_mul_mat(ctx, weight, activations);
    product->data = y;
    product->nb[1] = static_cast<size_t>(y_row) * sizeof(float);
    product->nb[2] = product->nb[3] = product->nb[1] * static_cast<size_t>(m);
    ggml_cgraph* graph = ggml_new_graph_custom(ctx, GRAPH_NODES, false);
    ggml_build_forward_expand(graph, product);
    ggml_cplan plan = ggml_graph_plan(graph, 1, nullptr);
    work.resize(plan.work_size);
    plan.work_data = work.data();
    ggml_graph_compute(graph, &plan);
    ggml_free(ctx);
}

// Columns [first, last) of p, every row, through ggml's own mul_mat; interleaved rows are put back
// as stored a block of columns at a time (in a scratch that stays in the core's L2).
void multiply_columns_by_ggml(const Product& p, int64_t m, int64_t k, int64_t first, int64_t last) {
    if (p.il == nullptr)
        return multiply_by_ggml(p.type, p.w + first * p.w_row, p.w_row, last - first, *p.x, p.y + first, p.n, m, k);
    thread_local std::vector<uint8_t> rows;
    rows.resize(static_cast<size_t>(COLUMNS_PER_BLOCK) * p.w_row);
    const int64_t blocks = k / ggml_blck_size(p.type);
    for (int64_t c0 = first; c0 < last; c0 += COLUMNS_PER_BLOCK) {
        const int64_t cols = std::min(last, c0 + COLUMNS_PER_BLOCK) - c0;
        for (int64_t g = 0; g < cols; g += INTERLEAVE)
            p.il->deinterleave(p.w + (c0 + g) * p.w_row, rows.data() + g * p.w_row, blocks);
        multiply_by_ggml(p.type, rows.data(), p.w_row, cols, *p.x, p.y + c0, p.n, m, k);
    }
}

}  // namespace

void multiply_columns(const Product& p, int64_t m, int64_t k, int64_t first, int64_t last) {
#ifdef AMX_TILES
    if (p.tiles != nullptr)
        return multiply_columns_by_tiles(p, m, k, first, last);
#endif
    if (p.by_ggml)
        return multiply_columns_by_ggml(p, m, k, first, last);
    const int64_t block = m > 1 ? COLUMNS_PER_BLOCK : last - first;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_TILE)
        for (int64_t c0 = first; c0 < last; c0 += block)
            multiply_block(p, k, r0, std::min(m, r0 + ROWS_PER_TILE), c0, std::min(last, c0 + block));
}

}  // namespace specchat
