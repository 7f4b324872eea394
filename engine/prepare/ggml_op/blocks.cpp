// Q4_K's scales and mins, and rows interleaved 8 at a time as ggml's CPU repack buffer lays them
// out: written by ggml's own repack for prepare (specchat_interleave), put back as stored for its
// mul_mat and the AMX tiles (deinterleave_q4_K).
#include "blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "shared.h"
#include "weight_types.h"

namespace specchat {

// (INTERLEAVE, which engine.ggml's own reading of the layout shares, is the width of ggml's groups.)
static_assert(INTERLEAVE == sizeof(block_q4_Kx8::d) / sizeof(ggml_half), "Q4_K groups of INTERLEAVE rows");
static_assert(INTERLEAVE == sizeof(block_q4_0x8::d) / sizeof(ggml_half), "Q4_0 groups of INTERLEAVE rows");

void unpack_scales(const uint8_t* q, uint8_t* scales, uint8_t* mins) {
    for (int j = 0; j < 4; ++j) {
        scales[j] = q[j] & 63;
        mins[j] = q[j + 4] & 63;
        scales[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
        mins[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

namespace {

void pack_scales(const uint8_t* scales, const uint8_t* mins, uint8_t* q) {
    for (int j = 0; j < 4; ++j) {
        q[j] = static_cast<uint8_t>(scales[j] | ((scales[j + 4] >> 4) << 6));
        q[j + 4] = static_cast<uint8_t>(mins[j] | ((mins[j + 4] >> 4) << 6));
        q[j + 8] = static_cast<uint8_t>((scales[j + 4] & 15) | ((mins[j + 4] & 15) << 4));
    }
}

}  // namespace

void deinterleave_q4_K(const uint8_t* group, uint8_t* rows, int64_t blocks) {
    constexpr int ROWS = 8, SUBS = 8, CHUNK = 8;
    const auto* in = reinterpret_cast<const block_q4_Kx8*>(group);
    auto* out = reinterpret_cast<block_q4_K*>(rows);
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t scales[SUBS][ROWS], mins[SUBS][ROWS];  // [sub-block][row]
        for (int sub = 0; sub < SUBS; ++sub)
            unpack_scales(in[b].scales + sub * 12, scales[sub], mins[sub]);
        for (int r = 0; r < ROWS; ++r) {
            block_q4_K& row = out[r * blocks + b];
            row.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.d = in[b].d[r];
            row.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.dmin = in[b].dmin[r];
            uint8_t row_scales[SUBS], row_mins[SUBS];
            for (int sub = 0; sub < SUBS; ++sub) {
                row_scales[sub] = scales[sub][r];
                row_mins[sub] = mins[sub][r];
            }
            pack_scales(row_scales, row_mins, row.scales);
        }
        for (int r = 0; r < ROWS; ++r) {
            uint8_t* qs = out[r * blocks + b].qs;
            for (int i = 0; i < static_cast<int>(sizeof(out[0].qs)) / CHUNK; ++i)
                std::memcpy(qs + i * CHUNK, in[b].qs + (i * ROWS + r) * CHUNK, CHUNK);
        }
    }
}

}  // namespace specchat

// Writes n weight rows of k values of `type` (as the GGUF stores them) interleaved as ggml's CPU
// repack buffer lays them out, into `out` (as many bytes). Returns 1 where that layout is the one
// the op's interleaved kernels read (checked on a row of activations against vec_dot), else 0
// and `out` is left as it was: the rows then stay as stored.
extern "C" int specchat_interleave(int type, const void* rows, void* out, int64_t n, int64_t k) {
    using namespace specchat;
    const WeightType* kind = weight_type(type);
    const Interleaved* il = kind != nullptr ? kind->interleaved() : nullptr;
    if (il == nullptr || n % INTERLEAVE != 0 || k % ggml_blck_size(static_cast<ggml_type>(type)) != 0)
        return 0;
    const ggml_type_traits_cpu* tr = kind->ggml;
    ggml_init_params params{ggml_tensor_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* t = ggml_new_tensor_2d(ctx, static_cast<ggml_type>(type), k, n);
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_repack_buffer_type(), ggml_nbytes(t));
    int ok = buffer != nullptr && ggml_backend_tensor_alloc(buffer, t, ggml_backend_buffer_get_base(buffer)) ==
                                      GGML_STATUS_SUCCESS && t->extra != nullptr;  // (no repack for it on this CPU)
    if (ok) {
        ggml_backend_tensor_set(t, rows, 0, ggml_nbytes(t));
        // The layout is the one the kernels read when gemv gives what vec_dot gives on the rows as stored.
        std::vector<float> x(static_cast<size_t>(k)), by_rows(static_cast<size_t>(n)), by_groups(static_cast<size_t>(n));
        for (int64_t i = 0; i < k; ++i)
            x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) + 0.1f;
        const auto* tq = ggml_get_type_traits_cpu(tr->vec_dot_type);
        std::vector<uint8_t> xq(ggml_row_size(tr->vec_dot_type, k));
        tq->from_float(x.data(), xq.data(), k);
        float largest = 0, off = 0;
        for (int64_t col = 0; col < n; ++col) {
            tr->vec_dot(static_cast<int>(k), &by_rows[static_cast<size_t>(col)], 0,
                        static_cast<const uint8_t*>(rows) + col * ggml_row_size(static_cast<ggml_type>(type), k), 0,
                        xq.data(), 0, 1);
            largest = std::max(largest, std::fabs(by_rows[static_cast<size_t>(col)]));
        }
        il->gemv(static_cast<int>(k), by_groups.data(), static_cast<size_t>(n), t->data, xq.data(), 1, static_cast<int>(n));
        for (int64_t col = 0; col < n; ++col)
            off = std::max(off, std::fabs(by_rows[static_cast<size_t>(col)] - by_groups[static_cast<size_t>(col)]));
        ok = off <= 1e-4f * std::max(largest, 1.0f);
        if (ok)
            std::memcpy(out, t->data, ggml_nbytes(t));
    }
    if (buffer != nullptr)
        ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
    return ok;
}

