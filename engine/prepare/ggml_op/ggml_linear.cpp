// GgmlLinear: y_i = x @ W_i^T for weights kept in their GGUF blocks, computed by ggml's CPU kernels
// inside an OpenVINO graph (docs/design.md, "The GGUF's own kernels").
//
// Inputs: x, f32 [..., K]; flags, i64 (or i32) [1] (a graph input, named ggml_gemm): GEMM to
// multiply by ggml's batched kernels, whose rows round with where they fall in a pass (a prompt's
// passes set it), FINE for activations in 14 bits where the CPU can (below); w_1 .. w_n,
// u8 [N_i, row_bytes_i], each weight's rows in the GGUF's blocks. The weights share their input: a
// layer's q, k and v projections, or its gate and up, are one node, so the activations are
// quantized once and the plugin runs one node instead of three (each node costs it a shape
// inference and a hand-over to its threads on every pass).
// Attributes, one entry per weight: ggml_types, the rows' ggml type (Q4_K, Q6_K, Q8_0, Q5_0, F16,
// ...); interleaved, 1 where the rows are interleaved 8 at a time as ggml's CPU "repack" buffer
// lays them out for its gemm and gemv (specchat_interleave below writes them), 0 where they are as
// the file stores them. Outputs: f32 [..., N_i].
//
// Activation rows are quantized once per dot type (Q8_K for the K-quants, Q8_0 for the legacy
// ones), as llama.cpp does. Rows of Q4_K and Q4_0 (interleaved) and Q6_K (as stored) go through
// the op's own kernels, which share each block's unpacking among a pass's rows and give every row
// what ggml's one-row kernel gives it (gemv for interleaved weights, vec_dot for rows as stored),
// bit for bit; other types go row by row through those. With FINE, the op's own Q4_K and Q6_K
// kernels take a block of activations whose largest value stands out in 14 bits instead (on
// AVX-512 VNNI; block_q14), each row still alike at any width: the file's model to a rounding 64
// times finer where an LLM's huge activation channels would leave Q8_K a handful of levels.
// With GEMM (prompt passes), ggml's batched
// kernels take over where they are faster: its own mul_mat for rows as stored (its tiled kernels
// for the K-quants from 8 rows on, as llama.cpp reads a prompt through a Q6_K weight), Q4_K rows
// put back as stored for it from TILED_ROWS rows, and its gemm for IQ4_NL; where the CPU has AMX,
// from AMX_ROWS rows the op's own bf16 tile kernels instead (weights and activations in bf16, f32
// sums). Their rows round differently with where they fall in a pass. Without gemm, a row's
// result never depends on the other rows, bit for bit.
// A weight row is read once per tile of activation rows, and the weights' columns are split across
// the plugin's own threads (the TBB arena the inference runs in): the op adds no thread of its
// own (ggml's mul_mat runs on the thread that calls it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"
#include "repack.h"  // ggml's interleaved gemm and gemv (ggml/src/ggml-cpu)
#include "tuning.h"

namespace specchat {

namespace {

// Output columns a thread takes at a time in a pass of several rows (a multiple of INTERLEAVE):
// their weight rows stay in the core's L2 while a tile of activation rows passes. A 1-row pass
// takes its whole range at once (in one call, a plain step is faster by a tenth).
constexpr int64_t COLUMNS_PER_BLOCK = 256;
// Activation rows multiplied with a block of weight rows before the next block (a multiple of
// GEMM_ROWS): their quantized copies stay in cache however long the pass (a prompt).
constexpr int64_t ROWS_PER_TILE = 64;
constexpr int64_t INTERLEAVE = 8;  // weight rows interleaved together
constexpr int64_t GEMM_ROWS = 4;   // activation rows a gemm call takes at a time
// From this many rows a prompt pass puts interleaved Q4_K rows back as stored and multiplies them
// by ggml's tiled kernels; below, by the op's own multi-row kernel, which a large layer took less
// time through than through ggml's gemm or tiled kernels up to this width (docs/benchmarks.md,
// "The op's fixed constants").
constexpr int64_t TILED_ROWS = 256;
constexpr size_t WEIGHTS = 2;      // the first weight's input (after x and the flags)
// The flags input's bits: a pass multiplies by ggml's batched kernels (prompt passes), or by
// activations in 14 bits (block_q14, where the CPU can; not with GEMM).
constexpr int64_t GEMM = 1, FINE = 2;
constexpr size_t GRAPH_NODES = 4;  // ggml's graph of one mul_mat: its weight, activations and result

using Gemx = void (*)(int, float*, size_t, const void*, const void*, int, int);
using Quantize4 = void (*)(const float*, void*, int64_t);

using Deinterleave = void (*)(const uint8_t* group, uint8_t* rows, int64_t blocks);

// Q4_K's 12 bytes of 6-bit scales and mins (8 of each), as the GGUF format packs them.
void unpack_scales(const uint8_t* q, uint8_t* scales, uint8_t* mins) {
    for (int j = 0; j < 4; ++j) {
        scales[j] = q[j] & 63;
        mins[j] = q[j + 4] & 63;
        scales[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
        mins[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

void pack_scales(const uint8_t* scales, const uint8_t* mins, uint8_t* q) {
    for (int j = 0; j < 4; ++j) {
        q[j] = static_cast<uint8_t>(scales[j] | ((scales[j + 4] >> 4) << 6));
        q[j + 4] = static_cast<uint8_t>(mins[j] | ((mins[j + 4] >> 4) << 6));
        q[j + 8] = static_cast<uint8_t>((scales[j + 4] & 15) | ((mins[j + 4] & 15) << 4));
    }
}

// A group of 8 interleaved Q4_K rows (`blocks` block_q4_Kx8 in a row) back into the 8 rows of
// blocks the file stores: the inverse of the layout ggml's repack writes (its d and dmin side by
// side, its quants 8 bytes from each row in turn, and per sub-block the 8 rows' scales and mins
// packed as one Q4_K block packs its 8 sub-blocks').
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

#if defined(__AVX2__)
// Rows that share a pass share its weight reads: the kernels below unpack a block of weights once
// for every activation row, and give each row exactly what ggml's one-row kernel gives it (Q4_K
// and Q4_0 interleaved: its gemv; Q6_K as stored: its vec_dot), bit for bit. Those compute the integer sums
// of each block exactly (no term can overflow), then accumulate them in f32 in a fixed order; the
// integer sums are computed here another way (VNNI where the CPU has it) and the f32 steps are
// theirs, in their order.

// The multi-row kernels' 512-bit paths: AVX-512 VNNI on byte and word lanes.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_512 1
#endif

// Per 32-bit lane, partial sums of the products of unsigned bytes u and signed bytes s, added to
// acc: with VNNI the lane's sum; without, its two 16-bit halves' (maddubs), added up by `scaled`
// (a multiply-add fewer per 32 bytes). Exact while a lane's sum, and each half's, fits 16 bits.
inline __m256i partial(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

// acc + each 32-bit lane's partial sums (`partial`) times the lane's scale, given in both 16-bit
// halves of its lane.
inline __m256i scaled(__m256i acc, __m256i part, __m256i scale) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    scale = _mm256_and_si256(scale, _mm256_set1_epi32(0xFFFF));  // (the lane's high half: its sign)
#endif
    return _mm256_add_epi32(acc, _mm256_madd_epi16(part, scale));
}

// Each 32-bit lane's low 16 bits in both halves.
inline __m256i twice16(__m256i x) {
    return _mm256_or_si256(x, _mm256_slli_epi32(x, 16));
}

// Q4_K's 12 bytes of 6-bit scales and mins as 8 bytes of each (as unpack_scales, in registers: a
// round trip through bytes in memory stalled on store forwarding).
inline std::pair<int64_t, int64_t> scales_and_mins(const uint8_t* q) {
    uint32_t u[3];
    std::memcpy(u, q, sizeof(u));
    constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const uint64_t scales = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | (((u[0] >> 6) & low2) << 4)) << 32;
    const uint64_t mins = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)) << 32;
    return {static_cast<int64_t>(scales), static_cast<int64_t>(mins)};
}

// A block's bytes into the cache ahead of use, into the next weight rows (up to `end`, the last
// of the thread's range): the blocks' compute, longer with more rows, would otherwise leave each
// block's first lines to arrive from memory while the core waits. Six blocks ahead, not two or
// twelve, by plain steps timed in alternating processes (docs/benchmarks.md, "The op's fixed
// constants").
constexpr int64_t AHEAD = 6;  // blocks of 8 Q4_K rows ahead (4 times as many Q6_K blocks, 8 of Q4_0)

// (Always inlined: once the row kernels were templates, GCC 12 left out every prefetch of theirs,
// which cost a plain step a fifth on the AMX VM.)
template <typename Block>
__attribute__((always_inline)) inline void prefetch(const Block* block, const void* end) {
    if (static_cast<const void*>(block + 1) > end)
        return;
    const auto* bytes = reinterpret_cast<const char*>(block);
    for (size_t line = 0; line < sizeof(Block); line += 64)
        _mm_prefetch(bytes + line, _MM_HINT_T0);
}

// 8 floats summed as ggml's hsum_float_8 sums them.
inline float sum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

#ifdef VNNI_512
// Activation rows whose Q4_K sums are kept in registers at once: a pass's rows go four at a
// time, and a last row left alone joins the tile before it, so a 5-row verify unpacks each block
// once rather than for a tile of 4 and again for 1 (a target pass of 5 tokens 42.7 against 44.4
// ms, AVX-512 AMD VM). Tiles of up to 8 for every width were slower at 9 and 17 rows.
constexpr int ROW_TILE = 4;

// The integer sums of one block of 8 interleaved Q4_K columns by T activation rows `a`: per row,
// each sub-block's sums times its scales, lanes 2c and 2c+1 holding column c's. Each 64 bytes of
// quants are loaded and split into their two sub-blocks' nibbles once for the T rows.
template <int T>
inline void q4_K_block_sums(const block_q4_Kx8& g, const int32_t (*scale)[16], const block_q8_K* const* a,
                            __m512i* wide) {
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int t = 0; t < T; ++t)
        wide[t] = _mm512_setzero_si512();
    for (int l = 0; l < 4; ++l) {  // sub-blocks 2l (low nibbles) and 2l + 1 (high)
        __m512i lo[T], hi[T];
        for (int t = 0; t < T; ++t)
            lo[t] = hi[t] = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {  // chunk i: 8 values of each column
            const __m512i raw = _mm512_loadu_si512(g.qs + l * 256 + i * 64);
            const __m512i ql = _mm512_and_si512(raw, m15), qh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15);
            for (int t = 0; t < T; ++t) {
                int64_t first, second;
                std::memcpy(&first, a[t]->qs + 64 * l + 8 * i, sizeof(first));
                std::memcpy(&second, a[t]->qs + 64 * l + 32 + 8 * i, sizeof(second));
                lo[t] = _mm512_dpbusd_epi32(lo[t], ql, _mm512_set1_epi64(first));
                hi[t] = _mm512_dpbusd_epi32(hi[t], qh, _mm512_set1_epi64(second));
            }
        }
        const __m512i s0 = _mm512_load_si512(scale[2 * l]), s1 = _mm512_load_si512(scale[2 * l + 1]);
        for (int t = 0; t < T; ++t)  // (a sub-block's sums fit 16 bits: times its scales in one step)
            wide[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(wide[t], lo[t], s0), hi[t], s1);
    }
}

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
constexpr int32_t FINE_MAX = 8191, COARSE_MAX = 127;
// A block is fine where its largest value is more than this many times its root mean square (at
// most 16, the square root of a block's 256 values). On the default target (the 3,625
// teacher-forced positions of benchmarks/fidelity.py) 11% of blocks were fine, and the next token
// the file model's at 0.996 of them against 0.96-0.97 with Q8_K alone; at 8, 24% and 0.996-0.997;
// at 12, 5% and 0.991-0.996; with every block fine, 0.999-1.000.
constexpr float FINE_RATIO = 10.0f;
struct block_q14 {
    float d;
    int32_t sums32_low[QK_K / 64], sums32_high[QK_K / 64];  // entry t: sub-blocks 2t and 2t + 1, 16 bits each
    int16_t sums16_low[QK_K / 16], sums16_high[QK_K / 16];
    int8_t lo[QK_K];
    int8_t hi[QK_K];
    bool fine;  // hi holds anything but zeros
};

void quantize_row_q14(const float* x, block_q14* y, int64_t k) {
    const auto low = [](int32_t sum) { return sum & 0x7FFF; };
    const auto high = [](int32_t sum) { return sum >> 15; };
    const auto pair = [](int32_t first, int32_t second) {
        return static_cast<int32_t>((static_cast<uint32_t>(first) & 0xFFFF) | (static_cast<uint32_t>(second) << 16));
    };
    constexpr int RUNS = QK_K / 16;
    for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K) {
        __m512 v[RUNS], amax = _mm512_setzero_ps(), squares = _mm512_setzero_ps();
        for (int j = 0; j < RUNS; ++j) {
            v[j] = _mm512_loadu_ps(x + 16 * j);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
            squares = _mm512_fmadd_ps(v[j], v[j], squares);
        }
        const float top = _mm512_reduce_max_ps(amax);
        block_q14& out = y[b];
        out.fine = top * top * QK_K > FINE_RATIO * FINE_RATIO * _mm512_reduce_add_ps(squares);
        const int32_t most = out.fine ? FINE_MAX : COARSE_MAX;
        out.d = top / most;
        const __m512 scale = _mm512_set1_ps(top > 0.0f ? most / top : 0.0f);
        int32_t sums[RUNS];
        for (int j = 0; j < RUNS; ++j) {  // (to nearest, ties to even)
            __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], scale));
            a = _mm512_max_epi32(_mm512_min_epi32(a, _mm512_set1_epi32(most)), _mm512_set1_epi32(-most));
            sums[j] = _mm512_reduce_add_epi32(a);
            const __m512i hi =  // (fine: lo in [-64, 63])
                out.fine ? _mm512_srai_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(64)), 7) : _mm512_setzero_si512();
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo + 16 * j),
                             _mm512_cvtepi32_epi8(_mm512_sub_epi32(a, _mm512_slli_epi32(hi, 7))));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi + 16 * j), _mm512_cvtepi32_epi8(hi));
        }
        for (int j = 0; j < RUNS; ++j) {
            out.sums16_low[j] = static_cast<int16_t>(low(sums[j]));
            out.sums16_high[j] = static_cast<int16_t>(high(sums[j]));
        }
        for (int t = 0; t < QK_K / 64; ++t) {
            const int32_t first = sums[4 * t] + sums[4 * t + 1], second = sums[4 * t + 2] + sums[4 * t + 3];
            out.sums32_low[t] = pair(low(first), low(second));
            out.sums32_high[t] = pair(high(first), high(second));
        }
    }
}

inline __m512i eight_bytes(const void* p) {
    int64_t bytes;
    std::memcpy(&bytes, p, sizeof(bytes));
    return _mm512_set1_epi64(bytes);
}

// q4_K_block_sums for 14-bit activations: per sub-block, the sums of the weights by the low and
// by the high bytes (each lane's 16 products fit 16 bits) times its scales, the high ones' times
// 128; the high bytes only where a row's block is fine.
template <int T>
inline void q4_K_block_sums(const block_q4_Kx8& g, const int32_t (*scale)[16], const block_q14* const* a,
                            __m512i* wide) {
    const __m512i m15 = _mm512_set1_epi8(15);
    bool fine = false;
    for (int t = 0; t < T; ++t)
        fine |= a[t]->fine;
    __m512i low[T], high[T];
    for (int t = 0; t < T; ++t)
        low[t] = high[t] = _mm512_setzero_si512();
    for (int l = 0; l < 4; ++l) {  // sub-blocks 2l (low nibbles) and 2l + 1 (high)
        __m512i lo0[T], hi0[T], lo1[T], hi1[T];
        for (int t = 0; t < T; ++t)
            lo0[t] = hi0[t] = lo1[t] = hi1[t] = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {  // chunk i: 8 values of each column
            const __m512i raw = _mm512_loadu_si512(g.qs + l * 256 + i * 64);
            const __m512i ql = _mm512_and_si512(raw, m15), qh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15);
            const int at = 64 * l + 8 * i;
            for (int t = 0; t < T; ++t) {
                lo0[t] = _mm512_dpbusd_epi32(lo0[t], ql, eight_bytes(a[t]->lo + at));
                lo1[t] = _mm512_dpbusd_epi32(lo1[t], qh, eight_bytes(a[t]->lo + at + 32));
            }
            if (fine)
                for (int t = 0; t < T; ++t) {
                    hi0[t] = _mm512_dpbusd_epi32(hi0[t], ql, eight_bytes(a[t]->hi + at));
                    hi1[t] = _mm512_dpbusd_epi32(hi1[t], qh, eight_bytes(a[t]->hi + at + 32));
                }
        }
        const __m512i s0 = _mm512_load_si512(scale[2 * l]), s1 = _mm512_load_si512(scale[2 * l + 1]);
        for (int t = 0; t < T; ++t)
            low[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(low[t], lo0[t], s0), lo1[t], s1);
        if (fine)
            for (int t = 0; t < T; ++t)
                high[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(high[t], hi0[t], s0), hi1[t], s1);
    }
    for (int t = 0; t < T; ++t)
        wide[t] = _mm512_add_epi32(low[t], _mm512_slli_epi32(high[t], 7));
}
#endif

// Each column's mins times the activations' sums of their sub-blocks (`mins`: per pair of
// sub-blocks, each column's two mins as 16-bit halves of its lane, columns 0-3 then 4-7).
inline __m256i min_sums(const __m256i* mins, const block_q8_K* a) {
    int32_t bsum[4];  // the sums of each sub-block's 32 values, two sub-blocks per 32 bits
    const __m128i halves = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a->bsums)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a->bsums + 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bsum), halves);
    __m256i imin = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t)
        imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mins[t], _mm256_set1_epi32(bsum[t])));
    return imin;
}

#ifdef VNNI_512
inline __m256i min_sums(const __m256i* mins, const block_q14* a) {
    __m256i low = _mm256_setzero_si256(), high = low;
    for (int t = 0; t < 4; ++t) {
        low = _mm256_add_epi32(low, _mm256_madd_epi16(mins[t], _mm256_set1_epi32(a->sums32_low[t])));
        high = _mm256_add_epi32(high, _mm256_madd_epi16(mins[t], _mm256_set1_epi32(a->sums32_high[t])));
    }
    return _mm256_add_epi32(low, _mm256_slli_epi32(high, 15));
}
#endif

// A group of 8 interleaved Q4_K weight rows by `rows` activation rows (`x_row` bytes apart) of
// Q8_K or 14-bit blocks (A), into y (rows `y_row` floats apart): each row as
// ggml_gemv_q4_K_8x8_q8_K computes it alone (in 14 bits, in its steps).
template <typename A>
void gemv_rows_q4_K(const block_q4_Kx8* w, int64_t blocks, const void* end, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row) {
    thread_local std::vector<float> scratch;  // per row: 8 columns' sums, then 8 of their mins'
    scratch.assign(static_cast<size_t>(rows) * 16, 0.0f);
    float* const sums = scratch.data();  // (a thread_local in a shared library costs a call per use)
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q4_Kx8& g = w[b];
        prefetch(w + b + AHEAD, end);
        // Each column's scale for sub-block s in its two 32-bit lanes.
        alignas(64) int32_t scale[8][16];
        __m128i mn[8];  // per sub-block, the 8 columns' mins as 16-bit values
        for (int s = 0; s < 8; ++s) {
            const auto [scales, mins] = scales_and_mins(g.scales + s * 12);
            const __m128i twice = _mm_unpacklo_epi8(_mm_cvtsi64_si128(scales), _mm_cvtsi64_si128(scales));
            _mm256_store_si256(reinterpret_cast<__m256i*>(scale[s]), _mm256_cvtepu8_epi32(twice));
            _mm256_store_si256(reinterpret_cast<__m256i*>(scale[s] + 8), _mm256_cvtepu8_epi32(_mm_srli_si128(twice, 8)));
            mn[s] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins));
        }
        __m256i mins[4];  // per pair of sub-blocks, each column's two mins as 16-bit halves of its lane
        for (int t = 0; t < 4; ++t)
            mins[t] = _mm256_set_m128i(_mm_unpackhi_epi16(mn[2 * t], mn[2 * t + 1]), _mm_unpacklo_epi16(mn[2 * t], mn[2 * t + 1]));
        float d[8], dmin[8];
        for (int c = 0; c < 8; ++c) {
            d[c] = _cvtsh_ss(g.d[c]);
            dmin[c] = _cvtsh_ss(g.dmin[c]);
        }
        // Row r's sums and mins from its integer sums (per 32-bit lane, two per column, columns 0-3
        // then 4-7), in gemv's f32 steps.
        const auto finish = [&](int64_t r, const A* a, __m256i low, __m256i high) {
            // lanes 2c and 2c+1 hold column c's: hadd gives columns 0 1 4 5 2 3 6 7
            const __m256i by_column = _mm256_permute4x64_epi64(_mm256_hadd_epi32(low, high), 0xD8);
            const __m256i imin = min_sums(mins, a);
            const __m256 dy = _mm256_set1_ps(a->d);
            float* acc = sums + r * 16;
            const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by_column), _mm256_mul_ps(_mm256_loadu_ps(d), dy),
                                               _mm256_loadu_ps(acc));
            const __m256 min_sum =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(_mm256_loadu_ps(dmin), dy), _mm256_loadu_ps(acc + 8));
            _mm256_storeu_ps(acc, sum);
            _mm256_storeu_ps(acc + 8, min_sum);
        };
        const auto row = [&](int64_t r) { return reinterpret_cast<const A*>(x + r * x_row) + b; };
#ifdef VNNI_512
        for (int64_t r0 = 0, tile = 0; r0 < rows; r0 += tile) {
            tile = rows - r0 == ROW_TILE + 1 ? ROW_TILE + 1 : std::min<int64_t>(ROW_TILE, rows - r0);
            const A* a[ROW_TILE + 1];
            for (int t = 0; t < tile; ++t)
                a[t] = row(r0 + t);
            __m512i wide[ROW_TILE + 1];
            switch (tile) {
            case 5: q4_K_block_sums<5>(g, scale, a, wide); break;
            case 4: q4_K_block_sums<4>(g, scale, a, wide); break;
            case 3: q4_K_block_sums<3>(g, scale, a, wide); break;
            case 2: q4_K_block_sums<2>(g, scale, a, wide); break;
            default: q4_K_block_sums<1>(g, scale, a, wide);
            }
            for (int t = 0; t < tile; ++t)
                finish(r0 + t, a[t], _mm512_castsi512_si256(wide[t]), _mm512_extracti64x4_epi64(wide[t], 1));
        }
#else
        static_assert(std::is_same_v<A, block_q8_K>, "14-bit activations take VNNI");
        // The quants as bytes, by sub-block s and chunk i: 64 bytes, 8 from each column in turn.
        alignas(64) uint8_t q[8][4][64];
        for (int l = 0; l < 4; ++l)
            for (int i = 0; i < 4; ++i)
                for (int h = 0; h < 2; ++h) {
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.qs + l * 256 + i * 64 + h * 32));
                    _mm256_store_si256(reinterpret_cast<__m256i*>(q[2 * l][i] + 32 * h), _mm256_and_si256(raw, _mm256_set1_epi8(15)));
                    _mm256_store_si256(reinterpret_cast<__m256i*>(q[2 * l + 1][i] + 32 * h),
                                       _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15)));
                }
        __m256i scale16[8][2];
        for (int s = 0; s < 8; ++s)
            for (int h = 0; h < 2; ++h)
                scale16[s][h] = twice16(_mm256_load_si256(reinterpret_cast<const __m256i*>(scale[s] + 8 * h)));
        for (int64_t r = 0; r < rows; ++r) {
            const block_q8_K* a = row(r);
            __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int s = 0; s < 8; ++s) {  // (a sub-block's partial sums fit 16 bits: 4 x 2 x 15 x 128)
                __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int i = 0; i < 4; ++i) {
                    int64_t eight;
                    std::memcpy(&eight, a->qs + 32 * s + 8 * i, sizeof(eight));
                    const __m256i act = _mm256_set1_epi64x(eight);
                    for (int h = 0; h < 2; ++h)
                        part[h] = partial(part[h], _mm256_load_si256(reinterpret_cast<const __m256i*>(q[s][i] + 32 * h)), act);
                }
                for (int h = 0; h < 2; ++h)
                    isum[h] = scaled(isum[h], part[h], scale16[s][h]);
            }
            finish(r, a, isum[0], isum[1]);
        }
#endif
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float* acc = sums + r * 16;
        _mm256_storeu_ps(y + r * y_row, _mm256_sub_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)));
    }
}

// A group of 8 interleaved Q4_0 weight rows by `rows` Q8_0 activation rows (`x_row` bytes apart),
// into y (rows `y_row` floats apart): each row as ggml_gemv_q4_0_8x8_q8_0 computes it alone (per
// block one fused multiply-add of the exact integer sum by the weight's and the activations'
// scales). The repack stores each nibble as a signed 4-bit value (its code xor 8): here they are
// sign-extended to bytes, the activations shifted by 128 to unsigned (their products' sums exact in
// 32 bits) and 128 times each column's sum of weights, computed once for the rows, taken back off.
void gemv_rows_q4_0(const block_q4_0x8* w, int64_t blocks, const void* end, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row) {
    thread_local std::vector<__m256> scratch;
    scratch.assign(static_cast<size_t>(rows), _mm256_setzero_ps());
    __m256* const sums = scratch.data();  // (a thread_local in a shared library costs a call per use)
    constexpr int64_t flip = static_cast<int64_t>(0x8080808080808080ULL);
    const __m128i signed4 = _mm_set_epi8(-1, -2, -3, -4, -5, -6, -7, -8, 7, 6, 5, 4, 3, 2, 1, 0);
    const auto row = [&](int64_t r, int64_t b) { return reinterpret_cast<const block_q8_0*>(x + r * x_row) + b; };
    // 8 bytes of row r's block b from byte `at`, shifted to unsigned, in every 64 bits.
    const auto eight = [&](int64_t r, int64_t b, int at) {
        int64_t bytes;
        std::memcpy(&bytes, row(r, b)->qs + at, sizeof(bytes));
        return bytes ^ flip;
    };
    // Row r's integer sums (per 32-bit lane, two per column: columns 0-3 in `low`, 4-7 in `high`)
    // into its f32 sums, in gemv's steps.
    const auto finish = [&](int64_t r, int64_t b, __m256i low, __m256i high, __m256 dw) {
        const __m256i by_column = _mm256_permute4x64_epi64(_mm256_hadd_epi32(low, high), 0xD8);
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(_cvtsh_ss(row(r, b)->d)));
        sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by_column), scale, sums[r]);
    };
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q4_0x8& g = w[b];
        prefetch(w + b + AHEAD * 8, end);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g.d)));
#ifdef VNNI_512
        // v[k][h]: the values k*8..k*8+7 (h = 0) and 16+k*8.. (h = 1) of every column, 8 bytes each
        const __m512i lut = _mm512_broadcast_i32x4(signed4), m15 = _mm512_set1_epi8(15);
        __m512i v[2][2], wsum = _mm512_setzero_si512();
        for (int k = 0; k < 2; ++k) {
            const __m512i raw = _mm512_loadu_si512(g.qs + 64 * k);
            v[k][0] = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, m15));
            v[k][1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m15));
            for (int h = 0; h < 2; ++h)
                wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(1), v[k][h]);
        }
        const __m512i shift = _mm512_slli_epi32(wsum, 7);
        for (int64_t r = 0; r < rows; ++r) {
            __m512i acc = _mm512_sub_epi32(_mm512_setzero_si512(), shift);
            for (int k = 0; k < 2; ++k)
                for (int h = 0; h < 2; ++h)
                    acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi64(eight(r, b, 8 * k + 16 * h)), v[k][h]);
            finish(r, b, _mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1), dw);
        }
#else
        // v[k][h][c]: as above, columns 4c..4c+3
        // (a block's partial sums fit 16 bits: 4 x 2 x 255 x 8)
        const __m256i lut = _mm256_broadcastsi128_si256(signed4), m15 = _mm256_set1_epi8(15);
        const __m256i one = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
        __m256i v[2][2][2], shift[2];
        for (int c = 0; c < 2; ++c) {
            __m256i wsum = _mm256_setzero_si256();
            for (int k = 0; k < 2; ++k) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.qs + 64 * k + 32 * c));
                v[k][0][c] = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, m15));
                v[k][1][c] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m15));
                for (int h = 0; h < 2; ++h)
                    wsum = partial(wsum, one, v[k][h][c]);
            }
            shift[c] = _mm256_slli_epi32(scaled(_mm256_setzero_si256(), wsum, ones), 7);
        }
        for (int64_t r = 0; r < rows; ++r) {
            __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int k = 0; k < 2; ++k)
                for (int h = 0; h < 2; ++h) {
                    const __m256i act = _mm256_set1_epi64x(eight(r, b, 8 * k + 16 * h));
                    for (int c = 0; c < 2; ++c)
                        part[c] = partial(part[c], act, v[k][h][c]);
                }
            finish(r, b, _mm256_sub_epi32(scaled(_mm256_setzero_si256(), part[0], ones), shift[0]),
                   _mm256_sub_epi32(scaled(_mm256_setzero_si256(), part[1], ones), shift[1]), dw);
        }
#endif
    }
    for (int64_t r = 0; r < rows; ++r)
        _mm256_storeu_ps(y + r * y_row, sums[r]);
}

// A Q6_K block's quants of values 32v..32v+31 in q[v], as unsigned bytes (0..63: ggml's less 32).
inline void q6_K_quants(const block_q6_K& blk, __m256i* q) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int j = 0; j < 2; ++j) {
        const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * j));
        const __m256i lo2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * j + 32));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * j));
        q[4 * j] = _mm256_or_si256(_mm256_and_si256(lo1, m15), _mm256_slli_epi16(_mm256_and_si256(hi, m3), 4));
        q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(lo2, m15),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2), m3), 4));
        q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m15),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m3), 4));
        q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo2, 4), m15),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 6), m3), 4));
    }
}

// The activations' sums of each 16 values times their Q6_K scales (16-bit), pairs added per lane.
inline __m256i sums_by_scales(const block_q8_K* a, __m256i scales16) {
    return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums)), scales16);
}

#ifdef VNNI_512
inline __m256i sums_by_scales(const block_q14* a, __m256i scales16) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->sums16_low));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->sums16_high));
    return _mm256_add_epi32(_mm256_madd_epi16(low, scales16), _mm256_slli_epi32(_mm256_madd_epi16(high, scales16), 15));
}
#endif

// One Q6_K weight row (as stored) by `rows` activation rows of Q8_K or 14-bit blocks (A), into y
// (rows `y_row` floats apart): each as ggml_vec_dot_q6_K_q8_K computes it alone (in 14 bits, in its
// steps). Its lanes: lane j of each 32 bytes of quants sums bytes 4j..4j+3 times the scale of their
// 16 (the first 16 bytes' scale in lanes 0-3), less 32 times the activations' sums of values
// 32j..32j+31 times their scales.
template <typename A>
void vec_dot_rows_q6_K(const block_q6_K* w, int64_t blocks, const void* end, const uint8_t* x, size_t x_row,
                       int64_t rows, float* y, int64_t y_row) {
    thread_local std::vector<__m256> scratch;
    scratch.assign(static_cast<size_t>(rows), _mm256_setzero_ps());
    __m256* const sums = scratch.data();  // (a thread_local in a shared library costs a call per use)
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q6_K& blk = w[b];
        prefetch(w + b + AHEAD * 4, end);
        __m256i q[8], scale[8];  // the quants of values 32v..32v+31 (0..63), and their lanes' scales
        q6_K_quants(blk, q);
        const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
        for (int v = 0; v < 8; ++v) {  // scale 2v four times, then 2v+1 four times
            const __m128i pick = _mm_set1_epi64x(0x0101010100000000LL + 0x0202020202020202LL * v);
            scale[v] = _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(scales8, pick)), _mm256_set1_epi32(0xFFFF));
        }
        const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
        const float wd = _cvtsh_ss(blk.d);
#ifndef VNNI_512
        __m256i scale16[8];
        for (int v = 0; v < 8; ++v)
            scale16[v] = twice16(scale[v]);
#else
        // Two runs of 32 values per register: lanes 8-15 hold the next run's, added to lanes 0-7
        // at the end (the integer sums are exact in any order).
        __m512i q2[4], scale2[4];
        for (int v = 0; v < 4; ++v) {
            q2[v] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * v]), q[2 * v + 1], 1);
            scale2[v] = _mm512_inserti64x4(_mm512_castsi256_si512(scale[2 * v]), scale[2 * v + 1], 1);
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
            const auto* a = reinterpret_cast<const A*>(x + r * x_row) + b;
#ifdef VNNI_512
            __m512i wide = _mm512_setzero_si512();
            if constexpr (std::is_same_v<A, block_q14>) {  // (the high bytes' products where the block is fine)
                __m512i high = _mm512_setzero_si512();
                for (int v = 0; v < 4; ++v) {
                    const __m512i lo = _mm512_loadu_si512(a->lo + 64 * v);
                    wide = _mm512_dpwssd_epi32(wide, _mm512_dpbusd_epi32(_mm512_setzero_si512(), q2[v], lo), scale2[v]);
                }
                if (a->fine)
                    for (int v = 0; v < 4; ++v) {
                        const __m512i hi = _mm512_loadu_si512(a->hi + 64 * v);
                        high = _mm512_dpwssd_epi32(high, _mm512_dpbusd_epi32(_mm512_setzero_si512(), q2[v], hi), scale2[v]);
                    }
                wide = _mm512_add_epi32(wide, _mm512_slli_epi32(high, 7));
            } else {
                for (int v = 0; v < 4; ++v) {  // each lane's 4 products fit 16 bits: times its scale in one step
                    const __m512i act = _mm512_loadu_si512(a->qs + 64 * v);
                    wide = _mm512_dpwssd_epi32(wide, _mm512_dpbusd_epi32(_mm512_setzero_si512(), q2[v], act), scale2[v]);
                }
            }
            __m256i isum = _mm256_add_epi32(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64(wide, 1));
#else
            static_assert(std::is_same_v<A, block_q8_K>, "14-bit activations take VNNI");
            __m256i isum = _mm256_setzero_si256();
            for (int v = 0; v < 8; ++v) {  // (a lane's partial sums fit 16 bits: 2 x 63 x 128)
                const __m256i act = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->qs + 32 * v));
                isum = scaled(isum, partial(_mm256_setzero_si256(), q[v], act), scale16[v]);
            }
#endif
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(sums_by_scales(a, scales16), 5));
            const float dd = a->d * wd;
            sums[r] = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(isum), sums[r]);
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        y[r * y_row] = sum8(sums[r]);
}
#endif

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__)
#define AMX_TILES 1
// Prompt passes on AMX: activations and weights in bf16, multiplied by the CPU's tile unit
// (`tdpbf16ps`) with f32 sums. A weight is dequantized once per pass to the f32 values ggml's
// to_float gives (Q4_K and Q6_K here in registers, other types by to_float itself), and its bf16
// copy multiplied by every row of the pass: in a prompt pass of 256 rows the integer kernels
// above spend most of their time on instructions other than the multiply-adds, which the tile
// unit does 16 by 16 by 32 at a time. The rows round like the plugin's bf16 reader's (bf16
// inputs, f32 sums), not like llama.cpp's Q8_K activations; only prompt passes take it.
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

constexpr int64_t AMX_ROWS = 32;  // a prompt pass takes the tiles from this many rows
constexpr int64_t TILE = 16;      // a tile's rows, and its columns of 32 bits
constexpr int64_t TILE_K = 32;    // values of K a tile row holds (16 pairs of bf16)
constexpr int64_t AMX_COLUMNS = 2 * TILE;  // weight rows a thread dequantizes at a time (two tiles)

// Whether this CPU multiplies bf16 tiles and Linux lets this process use them (the tile data's
// state is off until a process asks: arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_ready() {
    static const bool ready = [] {
        unsigned a = 0, b = 0, c = 0, d = 0, a1 = 0, b1 = 0, c1 = 0, d1 = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1))
            return false;
        const bool tiles = (d >> 24) & 1, bf16_tiles = (d >> 22) & 1, avx512_bf16 = (a1 >> 5) & 1, avx512 = (b >> 16) & 1;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return tiles && bf16_tiles && avx512_bf16 && avx512 &&
               syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ready;
}

struct alignas(64) TileConfig {
    uint8_t palette = 0;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// 32 f32 values (in two registers, or in memory) as 32 bf16 (16 pairs, in order), rounded to
// nearest even.
AMX_TARGET inline __m512i bf16x32(__m512 first, __m512 second) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
}

AMX_TARGET inline __m512i bf16x32(const float* v) {
    return bf16x32(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16));
}

// 16 unsigned bytes as f32.
AMX_TARGET inline __m512 bytes_f32(__m128i bytes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// The activations in bf16 as the tiles take them: per block of TILE rows and step of TILE_K
// values, TILE pairs (tile rows) of the block's TILE rows (tile columns), 1 KB. Rows past m
// (to a whole number of two blocks) are zero.
struct TiledActivations {
    int64_t blocks = 0;  // row blocks
    int64_t steps = 0;   // steps of TILE_K values
    std::vector<uint32_t> data;

    const uint32_t* tile(int64_t block, int64_t step) const {
        return data.data() + (block * steps + step) * TILE * TILE;
    }
};

// Rows [start, stop) of x into t's tiles.
AMX_TARGET void tile_rows(const float* x, int64_t k, int64_t start, int64_t stop, TiledActivations& t) {
    alignas(64) uint32_t pairs[TILE];
    for (int64_t row = start; row < stop; ++row)
        for (int64_t s = 0; s < t.steps; ++s) {
            _mm512_store_si512(pairs, bf16x32(x + row * k + s * TILE_K));
            uint32_t* out = const_cast<uint32_t*>(t.tile(row / TILE, s)) + row % TILE;
            for (int64_t i = 0; i < TILE; ++i)
                out[i * TILE] = pairs[i];
        }
}

// (The tiles' intrinsics stay in functions compiled for them: a lambda is compiled for the
// file's target, which may lack AVX-512.)
void tile_activations(const float* x, int64_t m, int64_t k, TiledActivations& t) {
    t.blocks = (m + 2 * TILE - 1) / (2 * TILE) * 2;
    t.steps = k / TILE_K;
    t.data.assign(static_cast<size_t>(t.blocks * t.steps * TILE * TILE), 0);
    ov::parallel_nt_static(0, [&](int thread, int threads) {
        int64_t start = 0, stop = 0;
        ov::splitter(m, threads, thread, start, stop);
        tile_rows(x, k, start, stop, t);
    });
}

// y[:, c0 .. c0 + cols) for AMX_COLUMNS weight rows (zero past cols) by every row of `x`. The
// weights `w` in bf16 tiles: per step of TILE_K values, two tiles of TILE rows, 1 KB each.
AMX_TARGET void multiply_tiles(const uint16_t* w, const TiledActivations& x, int64_t m, float* y, int64_t y_row,
                               int64_t cols) {
    constexpr size_t stride = TILE_K * sizeof(uint16_t);
    alignas(64) float c[4][TILE][TILE];  // [weight tile * 2 + row tile][weight row][activation row]
    // each activation row's outputs: a column of the tiles (16 floats apart)
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(TILE));
    for (int64_t b = 0; b < x.blocks; b += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < x.steps; ++s) {
            _tile_loadd(4, w + (2 * s) * TILE * TILE_K, stride);
            _tile_loadd(5, w + (2 * s + 1) * TILE * TILE_K, stride);
            _tile_loadd(6, x.tile(b, s), TILE * sizeof(uint32_t));
            _tile_loadd(7, x.tile(b + 1, s), TILE * sizeof(uint32_t));
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0], TILE * sizeof(float));
        _tile_stored(1, c[1], TILE * sizeof(float));
        _tile_stored(2, c[2], TILE * sizeof(float));
        _tile_stored(3, c[3], TILE * sizeof(float));
        for (int64_t h = 0; h < 2; ++h)
            for (int64_t r = 0; r < TILE && (b + h) * TILE + r < m; ++r) {
                float* out = y + ((b + h) * TILE + r) * y_row;
                for (int64_t t = 0; t < 2 && t * TILE < cols; ++t) {
                    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(TILE, cols - t * TILE)) - 1);
                    _mm512_mask_storeu_ps(out + t * TILE, valid, _mm512_i32gather_ps(down, &c[t * 2 + h][0][r], 4));
                }
            }
    }
}

#endif

// ggml's kernels for a type whose weight rows are interleaved 8 at a time: on x86 (AVX2 and up)
// the layout ggml's repack buffer chooses for these types.
struct Interleaved {
    ggml_type type;
    Quantize4 quantize4;  // four activation rows into the gemm's interleaved dot-type blocks
    Gemx gemv;
    Gemx gemm;
    // Null, or the rows back as stored: a prompt pass of TILED_ROWS rows or more then multiplies
    // them by ggml's own mul_mat (its tiled kernels), faster than its gemm.
    Deinterleave deinterleave;
};

const Interleaved* interleaved_kernels(int64_t type) {
    static const Interleaved kernels[] = {
        {GGML_TYPE_Q4_K, ggml_quantize_mat_q8_K_4x8, ggml_gemv_q4_K_8x8_q8_K, ggml_gemm_q4_K_8x8_q8_K,
         deinterleave_q4_K},
        {GGML_TYPE_Q4_0, ggml_quantize_mat_q8_0_4x8, ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0, nullptr},
        {GGML_TYPE_IQ4_NL, ggml_quantize_mat_q8_0_4x8, ggml_gemv_iq4_nl_8x8_q8_0, ggml_gemm_iq4_nl_8x8_q8_0, nullptr},
    };
    for (const auto& found : kernels)
        if (found.type == type)
            return &found;
    return nullptr;
}

// ggml's warnings and errors go to stderr; its notes (one per weight it repacks) are dropped.
void log_warnings(ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR)
        std::fputs(text, stderr);
}

const ggml_type_traits_cpu* traits(int64_t type) {
    static std::once_flag initialized;
    std::call_once(initialized, [] {
        ggml_log_set(log_warnings, nullptr);
        ggml_cpu_init();
    });
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return nullptr;
    const auto* found = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    return found != nullptr && found->vec_dot != nullptr ? found : nullptr;
}

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
void quantize(const float* x, int64_t m, int64_t k, Quantized& q) {
    const auto* tq = ggml_get_type_traits_cpu(q.type);
#ifdef VNNI_512
    q.row = q.fine ? sizeof(block_q14) * static_cast<size_t>(k / QK_K) : ggml_row_size(q.type, k);
#else
    q.row = ggml_row_size(q.type, k);
#endif
    q.data.resize(q.row * static_cast<size_t>(m));
    uint8_t* xq = q.data.data();
    const int64_t fours = q.gemm ? m / GEMM_ROWS : 0;
    const int64_t singles = m - fours * GEMM_ROWS;
    ov::parallel_nt_static(fours + singles > 1 ? 0 : 1, [&](int thread, int threads) {
        int64_t start = 0, stop = 0;
        ov::splitter(fours + singles, threads, thread, start, stop);
        for (int64_t task = start; task < stop; ++task) {
            if (task < fours) {
                q.gemm->quantize4(x + task * GEMM_ROWS * k, xq + task * GEMM_ROWS * q.row, k);
                continue;
            }
            const int64_t row = fours * GEMM_ROWS + task - fours;
#ifdef VNNI_512
            if (q.fine) {
                quantize_row_q14(x + row * k, reinterpret_cast<block_q14*>(xq + row * q.row), k);
                continue;
            }
#endif
            if (tq->from_float != nullptr)
                tq->from_float(x + row * k, xq + row * q.row, k);
            else  // (an f32 dot type)
                std::memcpy(xq + row * q.row, x + row * k, q.row);
        }
    });
}

struct TiledActivations;

// One weight of a call: its n rows against the m quantized activation rows, into y [m, n].
struct Product {
    ggml_type type;
    const ggml_type_traits_cpu* tr;
    const Interleaved* il;  // null: rows as stored (vec_dot)
    bool gemm;              // interleaved rows by ggml's gemm
    bool own;               // rows by the op's own multi-row kernel (has_rows_kernel), else ggml's row by row
    bool by_ggml;           // rows (put back) as stored by ggml's own mul_mat
    const TiledActivations* tiles;  // null, or the activations in bf16 tiles: p by the AMX tiles
    const uint8_t* w;
    size_t w_row;
    int64_t n;
    const Quantized* x;
    float* y;

    int64_t unit() const {  // columns stay whole interleaved groups
        return il ? INTERLEAVE : 1;
    }
};

// Whether p's rows go through the op's own multi-row kernels where a pass has several rows
// (Q4_K and Q4_0 interleaved, Q6_K as stored; on AVX2 and up): with gemm too, but for Q4_K rows
// put back as stored from TILED_ROWS rows.
bool has_rows_kernel(const Product& p) {
#if defined(__AVX2__)
    return p.il ? p.type == GGML_TYPE_Q4_K || p.type == GGML_TYPE_Q4_0 : p.type == GGML_TYPE_Q6_K;
#else
    return false;
#endif
}

// Whether p's activations can go in 14 bits: Q4_K (interleaved) and Q6_K (as stored), where the
// CPU has AVX-512 VNNI.
bool takes_fine(const Product& p) {
#ifdef VNNI_512
    return p.il ? p.type == GGML_TYPE_Q4_K : p.type == GGML_TYPE_Q6_K;
#else
    return false;
#endif
}

#ifdef AMX_TILES
// Where weight row `col` (of AMX_COLUMNS) keeps its values s * TILE_K .. in the bf16 weight tiles.
inline uint16_t* tile_row(uint16_t* w, int64_t col, int64_t s) {
    return w + ((2 * s + col / TILE) * TILE + col % TILE) * TILE_K;
}

// A group of 8 interleaved Q4_K rows (`blocks` blocks) into the bf16 weight tiles, as rows col ..
// col + 7: each value d * scale * q - dmin * min in f32, as ggml's to_float computes it, rounded
// to bf16 (read straight from the group, not put back as stored first).
AMX_TARGET void q4_K_tiles(const block_q4_Kx8* group, int64_t blocks, int64_t col, uint16_t* w) {
    constexpr int ROWS = 8, SUBS = 8;
    const __m256i m15 = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q4_Kx8& g = group[b];
        uint8_t scales[SUBS][ROWS], mins[SUBS][ROWS];  // [sub-block][row]
        for (int sub = 0; sub < SUBS; ++sub)
            unpack_scales(g.scales + sub * 12, scales[sub], mins[sub]);
        for (int r = 0; r < ROWS; ++r) {
            const float d = _cvtsh_ss(g.d[r]), dmin = _cvtsh_ss(g.dmin[r]);
            for (int l = 0; l < SUBS / 2; ++l) {  // sub-blocks 2l (low nibbles) and 2l + 1 (high)
                int64_t eight[4];  // the row's 32 bytes of quants for them, 8 at a time 64 bytes apart
                for (int j = 0; j < 4; ++j)
                    std::memcpy(&eight[j], g.qs + ((4 * l + j) * ROWS + r) * 8, sizeof(eight[j]));
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eight));
                const __m256i nibbles[2] = {_mm256_and_si256(raw, m15), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m15)};
                for (int h = 0; h < 2; ++h) {
                    const int sub = 2 * l + h;
                    const __m512 scale = _mm512_set1_ps(d * scales[sub][r]), min = _mm512_set1_ps(dmin * mins[sub][r]);
                    const __m512 first = _mm512_fmsub_ps(bytes_f32(_mm256_castsi256_si128(nibbles[h])), scale, min);
                    const __m512 second = _mm512_fmsub_ps(bytes_f32(_mm256_extracti128_si256(nibbles[h], 1)), scale, min);
                    _mm512_storeu_si512(tile_row(w, col + r, b * SUBS + sub), bf16x32(first, second));
                }
            }
        }
    }
}

// Q6_K rows as stored (`blocks` blocks each) into the bf16 weight tiles as rows col .. col + n - 1:
// each value d * scale * (q - 32) in f32, as ggml's to_float computes it, rounded to bf16.
AMX_TARGET void q6_K_tiles(const block_q6_K* rows, int64_t blocks, int64_t col, int64_t n, uint16_t* w) {
    for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const block_q6_K& blk = rows[r * blocks + b];
            const float d = _cvtsh_ss(blk.d);
            __m256i q[8];
            q6_K_quants(blk, q);
            const __m512 offset = _mm512_set1_ps(32.0f);
            for (int v = 0; v < 8; ++v) {  // values 32v.. : their two 16s' scales 2v and 2v + 1
                const __m512 first = _mm512_mul_ps(_mm512_set1_ps(d * blk.scales[2 * v]),
                                                   _mm512_sub_ps(bytes_f32(_mm256_castsi256_si128(q[v])), offset));
                const __m512 second = _mm512_mul_ps(_mm512_set1_ps(d * blk.scales[2 * v + 1]),
                                                    _mm512_sub_ps(bytes_f32(_mm256_extracti128_si256(q[v], 1)), offset));
                _mm512_storeu_si512(tile_row(w, col + r, b * 8 + v), bf16x32(first, second));
            }
        }
}

// Weight rows [c0, c0 + cols) of p into the bf16 weight tiles `w` (AMX_COLUMNS rows, zero past
// cols): Q4_K groups straight, other types by ggml's to_float (interleaved rows put back as
// stored first).
AMX_TARGET void weight_tiles(const Product& p, int64_t k, int64_t c0, int64_t cols, uint16_t* w) {
    thread_local std::vector<float> f32;
    thread_local std::vector<uint8_t> stored;
    f32.resize(static_cast<size_t>(p.unit() * k));
    stored.resize(static_cast<size_t>(p.unit()) * p.w_row);
    const int64_t blocks = k / ggml_blck_size(p.type);
    for (int64_t col = 0; col < AMX_COLUMNS; col += p.unit()) {
        const uint8_t* rows = p.w + (c0 + col) * p.w_row;
        if (col < cols && p.il != nullptr && p.type == GGML_TYPE_Q4_K) {
            q4_K_tiles(reinterpret_cast<const block_q4_Kx8*>(rows), blocks, col, w);
            continue;
        }
        if (col < cols && p.il == nullptr && p.type == GGML_TYPE_Q6_K) {
            q6_K_tiles(reinterpret_cast<const block_q6_K*>(rows), blocks, col, 1, w);
            continue;
        }
        if (col >= cols) {
            std::fill(f32.begin(), f32.end(), 0.0f);
        } else {
            if (p.il != nullptr) {
                p.il->deinterleave(rows, stored.data(), blocks);
                rows = stored.data();
            }
            for (int64_t r = 0; r < p.unit(); ++r)
                ggml_get_type_traits(p.type)->to_float(rows + r * p.w_row, f32.data() + r * k, k);
        }
        for (int64_t r = 0; r < p.unit(); ++r)
            for (int64_t s = 0; s < k / TILE_K; ++s)
                _mm512_storeu_si512(tile_row(w, col + r, s), bf16x32(f32.data() + r * k + s * TILE_K));
    }
}

// Columns [first, last) of p, every row, through the tiles, AMX_COLUMNS weight rows at a time.
// The thread's tile configuration is saved and restored around it (the plugin's own AMX kernels
// keep theirs configured between calls).
AMX_TARGET void multiply_columns_by_tiles(const Product& p, int64_t m, int64_t k, int64_t first, int64_t last) {
    thread_local std::vector<uint16_t> w;
    w.resize(static_cast<size_t>(AMX_COLUMNS * k));
    TileConfig saved, mine;
    _tile_storeconfig(&saved);
    mine.palette = 1;
    for (int i = 0; i < 8; ++i) {
        mine.bytes_per_row[i] = TILE_K * sizeof(uint16_t);
        mine.rows[i] = TILE;
    }
    _tile_loadconfig(&mine);
    for (int64_t c0 = first; c0 < last; c0 += AMX_COLUMNS) {
        const int64_t cols = std::min(last - c0, AMX_COLUMNS);
        weight_tiles(p, k, c0, cols, w.data());
        multiply_tiles(w.data(), *p.tiles, m, p.y + c0, p.n, cols);
    }
    if (saved.palette != 0)
        _tile_loadconfig(&saved);
    else
        _tile_release();
}
#endif

// Whether a prompt pass of m rows of k values goes through the AMX tiles here.
bool takes_tiles(int64_t m, int64_t k) {
#ifdef AMX_TILES
    return m >= AMX_ROWS && k % TILE_K == 0 && amx_ready();
#else
    return false;
#endif
}

// x (m rows of k values) in bf16 tiles, kept per calling thread.
const TiledActivations* tile(const float* x, int64_t m, int64_t k) {
#ifdef AMX_TILES
    thread_local TiledActivations tiles;
    tile_activations(x, m, k, tiles);
    return &tiles;
#else
    return nullptr;
#endif
}

// Columns [first, last) of rows [r0, r1) (r0 a multiple of GEMM_ROWS).
void multiply_block(const Product& p, int64_t k, int64_t r0, int64_t r1, int64_t first, int64_t last) {
    const uint8_t* xq = p.x->data.data();
#if defined(__AVX2__)
    // (a single row too: its bits are gemv's and vec_dot's, and the kernels prefetch their blocks
    // ahead, which shortened a plain step where memory ran slow: docs/benchmarks.md, "The op's
    // fixed constants")
    if (!p.gemm && p.own) {
        const int64_t blocks = k / QK_K;
        const uint8_t* end = p.w + last * p.w_row;
        for (int64_t col = first; col < last; col += p.unit()) {
            const uint8_t* w = p.w + col * p.w_row;
            const uint8_t* x = xq + r0 * p.x->row;
            float* y = p.y + r0 * p.n + col;
            const auto* q4_K = reinterpret_cast<const block_q4_Kx8*>(w);
            const auto* q6_K = reinterpret_cast<const block_q6_K*>(w);
            if (p.type == GGML_TYPE_Q4_0)
                gemv_rows_q4_0(reinterpret_cast<const block_q4_0x8*>(w), k / QK4_0, end, x, p.x->row, r1 - r0, y, p.n);
#ifdef VNNI_512
            else if (p.x->fine && p.il)
                gemv_rows_q4_K<block_q14>(q4_K, blocks, end, x, p.x->row, r1 - r0, y, p.n);
            else if (p.x->fine)
                vec_dot_rows_q6_K<block_q14>(q6_K, blocks, end, x, p.x->row, r1 - r0, y, p.n);
#endif
            else if (p.il)
                gemv_rows_q4_K<block_q8_K>(q4_K, blocks, end, x, p.x->row, r1 - r0, y, p.n);
            else
                vec_dot_rows_q6_K<block_q8_K>(q6_K, blocks, end, x, p.x->row, r1 - r0, y, p.n);
        }
        return;
    }
#endif
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

// Columns [first, last) of p, every row.
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

// The units (whole interleaved groups) of each product, one after another, in `parts` ranges of
// about as many weight bytes: (part, product, first column, last column) each, in order.
struct Range {
    int part;
    size_t product;
    int64_t first, last;
};
std::vector<Range> ranges(const std::vector<Product>& products, int parts) {
    int64_t bytes = 0;
    for (const auto& p : products)
        bytes += p.n * static_cast<int64_t>(p.w_row);
    std::vector<Range> out;
    for (int part = 0; part < parts; ++part) {
        int64_t start = 0, stop = 0;
        ov::splitter(bytes, parts, part, start, stop);
        int64_t offset = 0;  // the first byte of p
        for (size_t i = 0; i < products.size(); ++i) {
            const Product& p = products[i];
            // p's units that start in [start, stop)
            const int64_t unit_bytes = p.unit() * static_cast<int64_t>(p.w_row), units = p.n / p.unit();
            const auto first_at = [&](int64_t byte) {
                return std::clamp<int64_t>((byte - offset + unit_bytes - 1) / unit_bytes, 0, units);
            };
            const int64_t lo = first_at(start), hi = first_at(stop);
            if (lo < hi)
                out.push_back({part, i, lo * p.unit(), hi * p.unit()});
            offset += units * unit_bytes;
        }
    }
    return out;
}

// Chunks per thread a Counter split cuts a node's columns into (ggml's own threads take four).
constexpr int CHUNKS_PER_THREAD = 4;

void multiply(const std::vector<Product>& products, int64_t m, int64_t k, tuning::Split split) {
    // The weights' columns, one after another, split into as many bytes for each thread (a layer's
    // q and k in Q4_K groups of 8 rows and its v in Q6_K rows split by rows instead left one
    // thread twice the other's work): one contiguous range each, or chunks from a shared counter.
    const int threads = parallel_get_max_threads();
    const bool counter = split == tuning::Split::Counter && threads > 1;
    const auto parts = ranges(products, counter ? threads * CHUNKS_PER_THREAD : threads);
    std::atomic<size_t> next{0};
    ov::parallel_nt_static(0, [&](int thread, int nthreads) {
        const auto run = [&](const Range& r) { multiply_columns(products[r.product], m, k, r.first, r.last); };
        if (counter) {
            for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts.size();)
                run(parts[i]);
            return;
        }
        for (const Range& r : parts)
            if (r.part % nthreads == thread)
                run(r);
    });
}

}  // namespace

class GgmlLinear : public ov::op::Op {
public:
    OPENVINO_OP("GgmlLinear", "specchat");

    GgmlLinear() = default;

    GgmlLinear(const ov::OutputVector& inputs, std::vector<int64_t> types, std::vector<int64_t> interleaved)
        : Op(inputs),
          m_types(std::move(types)),
          m_interleaved(std::move(interleaved)) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const size_t weights = get_input_size() - WEIGHTS;
        NODE_VALIDATION_CHECK(this,
                              get_input_size() > WEIGHTS && m_types.size() == weights && m_interleaved.size() == weights,
                              "one ggml type and one interleaved flag per weight");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        // (declared i64; the CPU plugin runs its graphs' i64 as i32)
        const auto flag = get_input_element_type(1);
        NODE_VALIDATION_CHECK(this,
                              (flag == ov::element::i64 || flag == ov::element::i32) &&
                                  get_input_partial_shape(1).compatible({1}),
                              "the flags must be i64 [1]");
        const auto& x = get_input_partial_shape(0);
        for (size_t i = 0; i < weights; ++i)
            set_output_type(i, ov::element::f32, weight_output(i, x));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlLinear>(args, m_types, m_interleaved);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_types", m_types);
        visitor.on_attribute("interleaved", m_interleaved);
        return true;
    }

    bool has_evaluate() const override {
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Tensor& x = inputs[0];
        const auto x_shape = x.get_shape();
        const int64_t k = static_cast<int64_t>(x_shape.back());
        const int64_t m = k ? static_cast<int64_t>(x.get_size()) / k : 0;
        const int64_t flags = inputs[1].get_element_type() == ov::element::i64 ? inputs[1].data<const int64_t>()[0]
                                                                              : inputs[1].data<const int32_t>()[0];
        const bool gemm = (flags & GEMM) != 0, fine = !gemm && (flags & FINE) != 0;
        thread_local std::vector<Quantized> quantized;  // (scratch kept per calling thread)
        size_t kinds = 0;
        std::vector<Product> products(m_types.size());
        std::vector<size_t> inputs_of(m_types.size());  // which of `quantized` each weight reads
        // A prompt pass through the AMX tiles where the CPU has them (its weights' types dequantized).
        const bool tiled = gemm && takes_tiles(m, k);
        const TiledActivations* tiles = nullptr;
        for (size_t i = 0; i < m_types.size(); ++i) {
            Product& p = products[i];
            p.type = static_cast<ggml_type>(m_types[i]);
            p.tr = traits(m_types[i]);
            p.il = m_interleaved[i] ? interleaved_kernels(m_types[i]) : nullptr;
            if (p.tr == nullptr || (m_interleaved[i] && p.il == nullptr))
                return false;
            p.by_ggml = gemm && (p.il == nullptr || (p.il->deinterleave != nullptr && m >= TILED_ROWS));
            p.gemm = gemm && p.il != nullptr && !p.by_ggml && !has_rows_kernel(p);
            const ov::Tensor& w = inputs[i + WEIGHTS];
            p.w = w.data<const uint8_t>();
            p.w_row = w.get_shape()[1];
            p.n = static_cast<int64_t>(w.get_shape()[0]);
            auto y_shape = x_shape;
            y_shape.back() = static_cast<size_t>(p.n);
            if (outputs[i].get_shape() != y_shape)
                outputs[i].set_shape(y_shape);
            p.y = outputs[i].data<float>();
            if (tiled && (p.il == nullptr || p.il->deinterleave != nullptr) &&
                ggml_get_type_traits(p.type)->to_float != nullptr) {
                p.tiles = tiles != nullptr ? tiles : (tiles = tile(x.data<const float>(), m, k));
                continue;
            }
            // The activations in this weight's dot type and layout, quantized once per call.
            const Interleaved* layout = p.gemm ? p.il : nullptr;
            const bool p_fine = fine && takes_fine(p);
            size_t& found = inputs_of[i];
            while (found < kinds && (quantized[found].type != p.tr->vec_dot_type || quantized[found].gemm != layout ||
                                     quantized[found].fine != p_fine))
                ++found;
            if (found == kinds) {
                if (quantized.size() <= kinds)
                    quantized.resize(kinds + 1);
                quantized[kinds].type = p.tr->vec_dot_type;
                quantized[kinds].gemm = layout;
                quantized[kinds].fine = p_fine;
                quantize(x.data<const float>(), m, k, quantized[kinds++]);
            }
        }
        // A decode or verify pass takes the candidate chosen for its shape where it runs (tuning.h);
        // a prompt pass, or a wider one, the op's own kernels and the static split.
        const bool tuned = !gemm && m <= tuning::WIDEST_TUNED;
        const std::string key = tuned ? shape_key(products, m, k) : std::string();
        const tuning::Pick pick = tuned ? tuning::pick(key) : tuning::Pick{0, false};
        const bool own = tuning::kernel_of(pick.candidate) == tuning::Kernel::Own;
        for (size_t i = 0; i < products.size(); ++i) {  // (once the scratch stopped growing)
            Product& p = products[i];
            if (p.tiles != nullptr)
                continue;
            p.x = &quantized[inputs_of[i]];
            p.own = has_rows_kernel(p) && (own || p.x->fine);  // (ggml's kernels take no 14-bit activations)
        }
        const auto start = std::chrono::steady_clock::now();
        multiply(products, m, k, tuning::split_of(pick.candidate));
        if (pick.timed)
            tuning::record(key, pick.candidate,
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        return true;
    }

private:
    // What the tuning tells a node's passes apart by: its weights (type, interleaved, rows), K, the
    // pass's rows and the threads, e.g. "q4_Kx8:1536 q6_K:256 k1536 m1 t2".
    static std::string shape_key(const std::vector<Product>& products, int64_t m, int64_t k) {
        std::string key;
        for (const auto& p : products)
            key += std::string(ggml_type_name(p.type)) + (p.il ? "x8:" : ":") + std::to_string(p.n) + " ";
        return key + "k" + std::to_string(k) + " m" + std::to_string(m) + " t" +
               std::to_string(parallel_get_max_threads());
    }

    // Weight i's output shape for x's, checking its type and rows.
    ov::PartialShape weight_output(size_t i, const ov::PartialShape& x) {
        const int64_t type = m_types[i];
        const auto* tr = traits(type);
        NODE_VALIDATION_CHECK(this, tr != nullptr, "ggml has no CPU dot product for type ", type);
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved[i] || interleaved_kernels(type) != nullptr,
                              "ggml has no interleaved kernels for ",
                              ggml_type_name(static_cast<ggml_type>(type)));
        NODE_VALIDATION_CHECK(this, get_input_element_type(i + WEIGHTS) == ov::element::u8, "w must be u8 blocks");
        const auto& w = get_input_partial_shape(i + WEIGHTS);
        NODE_VALIDATION_CHECK(this, w.rank().is_static() && w.rank().get_length() == 2, "w must be [N, row_bytes]");
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved[i] || (w[0].is_static() && w[0].get_length() % INTERLEAVE == 0),
                              "interleaved rows come in whole groups of ",
                              INTERLEAVE);
        auto out = x;
        if (x.rank().is_static() && x.rank().get_length() >= 1) {
            const auto& k = x[x.rank().get_length() - 1];
            if (k.is_static() && w[1].is_static()) {
                const auto t = static_cast<ggml_type>(type);
                NODE_VALIDATION_CHECK(this,
                                      k.get_length() % ggml_blck_size(t) == 0 &&
                                          static_cast<int64_t>(ggml_row_size(t, k.get_length())) == w[1].get_length(),
                                      "a row of ",
                                      k.get_length(),
                                      " values takes ",
                                      ggml_row_size(t, k.get_length()),
                                      " bytes of ",
                                      ggml_type_name(t),
                                      ", not ",
                                      w[1].get_length());
            }
            out[x.rank().get_length() - 1] = w[0];
        }
        return out;
    }

    std::vector<int64_t> m_types;
    std::vector<int64_t> m_interleaved;
};

}  // namespace specchat

// Writes n weight rows of k values of `type` (as the GGUF stores them) interleaved as ggml's CPU
// repack buffer lays them out, into `out` (as many bytes). Returns 1 where that layout is the one
// the op's interleaved kernels read (checked on a row of activations against vec_dot), else 0
// and `out` is left as it was: the rows then stay as stored.
extern "C" int specchat_interleave(int type, const void* rows, void* out, int64_t n, int64_t k) {
    using namespace specchat;
    const auto* tr = traits(type);
    const auto* il = interleaved_kernels(type);
    if (tr == nullptr || il == nullptr || n % INTERLEAVE != 0 || k % ggml_blck_size(static_cast<ggml_type>(type)) != 0)
        return 0;
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

// 1 where a prompt pass of AMX_ROWS rows or more multiplies through the AMX tiles here (the CPU
// has bf16 tiles and Linux lets the process use them), else 0.
extern "C" int specchat_prompt_tiles() {
    return specchat::takes_tiles(1 << 10, 1 << 10);
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<specchat::GgmlLinear>>()}));

// 1 where the op multiplies Q4_K and Q6_K rows by activations in 14 bits when a pass's flags ask
// for it (the CPU has AVX-512 VNNI), else 0.
extern "C" int specchat_fine_activations() {
#ifdef VNNI_512
    return 1;
#else
    return 0;
#endif
}
