// The op's own multi-row kernels (row_kernels.h), on AVX2 and up: AVX2's byte multiply-adds, or
// VNNI's where the CPU has them, 512-bit with AVX-512 VNNI (ROWS_512). Built a second time
// (SPECCHAT_NARROW, into specchat::narrow): on 256-bit registers alone where the CPU has 512-bit
// VNNI, and nothing where it has one width.
#include "row_kernels.h"

#if defined(VNNI_512) && !defined(SPECCHAT_NARROW)
#define ROWS_512 1
#endif
#ifdef SPECCHAT_NARROW
#define ROWS_NAMESPACE specchat::narrow
#else
#define ROWS_NAMESPACE specchat
#endif

#if defined(__AVX2__) && (defined(VNNI_512) || !defined(SPECCHAT_NARROW))
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "activations.h"
#include "blocks.h"

namespace ROWS_NAMESPACE {

namespace {

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

// A block's bytes into the cache ahead of use, into the next weight rows as `ahead` says
// (weight_types.h): the blocks' compute, longer with more rows, would otherwise leave each block's
// first lines to arrive from memory while the core waits. Six blocks ahead, not two or twelve, by plain steps
// timed in alternating processes (docs/benchmarks.md, "The op's fixed constants"); whether to
// read ahead at all, and into which cache, is timed where the op runs (tuning.h).
constexpr int64_t AHEAD = 6;  // blocks of 8 Q4_K rows ahead (4 times as many Q6_K blocks, 8 of Q4_0)

// (Always inlined: once the row kernels were templates, GCC 12 left out every prefetch of theirs,
// which cost a plain step a fifth on the AMX VM.)
template <typename Block>
__attribute__((always_inline)) inline void prefetch(const Block* block, ReadAhead ahead) {
    if (static_cast<const void*>(block + 1) > ahead.end)
        return;
    const auto* bytes = reinterpret_cast<const char*>(block);
    for (size_t line = 0; line < sizeof(Block); line += 64)
        if (ahead.into_l1)
            _mm_prefetch(bytes + line, _MM_HINT_T0);
        else
            _mm_prefetch(bytes + line, _MM_HINT_T1);
}

// 8 floats summed as ggml's hsum_float_8 sums them.
inline float sum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

#ifdef ROWS_512
// Activation rows whose Q4_K sums are kept in registers at once: a pass's rows go four at a
// time, and a last row left alone joins the tile before it, so a 5-row verify unpacks each block
// once rather than for a tile of 4 and again for 1 (docs/benchmarks.md, "The GGUF's own
// kernels"). Tiles of up to 8 for every width were slower at 9 and 17 rows.
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

#ifdef ROWS_512
inline __m256i min_sums(const __m256i* mins, const block_q14* a) {
    __m256i low = _mm256_setzero_si256(), high = low;
    for (int t = 0; t < 4; ++t) {
        low = _mm256_add_epi32(low, _mm256_madd_epi16(mins[t], _mm256_set1_epi32(a->sums32_low[t])));
        high = _mm256_add_epi32(high, _mm256_madd_epi16(mins[t], _mm256_set1_epi32(a->sums32_high[t])));
    }
    return _mm256_add_epi32(low, _mm256_slli_epi32(high, 15));
}
#endif

// The activations' sums of each 16 values times their Q6_K scales (16-bit), pairs added per lane.
inline __m256i sums_by_scales(const block_q8_K* a, __m256i scales16) {
    return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums)), scales16);
}

#ifdef ROWS_512
inline __m256i sums_by_scales(const block_q14* a, __m256i scales16) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->sums16_low));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->sums16_high));
    return _mm256_add_epi32(_mm256_madd_epi16(low, scales16), _mm256_slli_epi32(_mm256_madd_epi16(high, scales16), 15));
}
#endif

#ifdef ROWS_512
// A Q6_K block's quants as q6_K_quants gives them, two runs of 32 values to a register (values
// 64v..64v+31 in q2[v]'s lanes 0-7, the next 32 in lanes 8-15), and each 32-bit lane's scale
// (its 16 values', from `scales16`) as a 16-bit value in its low half, 0 in its high half. In
// 512-bit steps: in 256-bit ones, with the runs put together after, a block's unpacking took
// more than two rows' products (docs/benchmarks.md, "Reading ahead into L2").
inline void q6_K_runs(const block_q6_K& blk, __m256i scales16, __m512i* q2, __m512i* scale2) {
    const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(48);
    // 16-bit shifts of the high bits to bits 4-5: left by 4 and 2 for a pair's first and second
    // runs, right by 0 and 2 for the next pair's (what crosses a byte's edge is masked off)
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    constexpr int LOW_OR_HIGH = 0xEC;  // ternary logic: (a & c) | b
    for (int j = 0; j < 2; ++j) {
        const __m512i lo = _mm512_loadu_si512(blk.ql + 64 * j);
        const __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * j)));
        q2[2 * j] = _mm512_ternarylogic_epi32(lo, _mm512_and_si512(_mm512_sllv_epi16(hi, left), m48), m15, LOW_OR_HIGH);
        q2[2 * j + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo, 4), _mm512_and_si512(_mm512_srlv_epi16(hi, right), m48),
                                                  m15, LOW_OR_HIGH);
    }
    const __m512i wide16 = _mm512_castsi256_si512(scales16);
    for (int v = 0; v < 4; ++v) {  // lane i: scale 4v + i / 4, in its even word (the odd ones zeroed)
        const short s = static_cast<short>(4 * v);
        const __m512i pick = _mm512_set_epi16(0, s + 3, 0, s + 3, 0, s + 3, 0, s + 3, 0, s + 2, 0, s + 2, 0, s + 2, 0, s + 2,
                                              0, s + 1, 0, s + 1, 0, s + 1, 0, s + 1, 0, s, 0, s, 0, s, 0, s);
        scale2[v] = _mm512_maskz_permutexvar_epi16(0x55555555, pick, wide16);
    }
}
#endif

}  // namespace

// A group of 8 interleaved Q4_K weight rows by `rows` activation rows (`x_row` bytes apart) of
// Q8_K or 14-bit blocks (A), into y (rows `y_row` floats apart): each row as
// ggml_gemv_q4_K_8x8_q8_K computes it alone (in 14 bits, in its steps).
template <typename A>
void gemv_rows_q4_K(const uint8_t* weights, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row) {
    const auto* w = reinterpret_cast<const block_q4_Kx8*>(weights);
    const int64_t blocks = k / QK_K;
    thread_local std::vector<float> scratch;  // per row: 8 columns' sums, then 8 of their mins'
    scratch.assign(static_cast<size_t>(rows) * 16, 0.0f);
    float* const sums = scratch.data();  // (a thread_local in a shared library costs a call per use)
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q4_Kx8& g = w[b];
        prefetch(w + b + AHEAD, ahead);
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
#ifdef ROWS_512
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
void gemv_rows_q4_0(const uint8_t* weights, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row, int64_t rows,
                    float* y, int64_t y_row) {
    const auto* w = reinterpret_cast<const block_q4_0x8*>(weights);
    const int64_t blocks = k / QK4_0;
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
        prefetch(w + b + AHEAD * 8, ahead);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g.d)));
#ifdef ROWS_512
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

// One Q6_K weight row (as stored) by `rows` activation rows of Q8_K or 14-bit blocks (A), into y
// (rows `y_row` floats apart): each as ggml_vec_dot_q6_K_q8_K computes it alone (in 14 bits, in its
// steps). Its lanes: lane j of each 32 bytes of quants sums bytes 4j..4j+3 times the scale of their
// 16 (the first 16 bytes' scale in lanes 0-3), less 32 times the activations' sums of values
// 32j..32j+31 times their scales.
template <typename A>
void vec_dot_rows_q6_K(const uint8_t* weights, int64_t k, ReadAhead ahead, const uint8_t* x, size_t x_row,
                       int64_t rows, float* y, int64_t y_row) {
    const auto* w = reinterpret_cast<const block_q6_K*>(weights);
    const int64_t blocks = k / QK_K;
    thread_local std::vector<__m256> scratch;
    scratch.assign(static_cast<size_t>(rows), _mm256_setzero_ps());
    __m256* const sums = scratch.data();  // (a thread_local in a shared library costs a call per use)
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q6_K& blk = w[b];
        prefetch(w + b + AHEAD * 4, ahead);
        const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
        const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
        const float wd = _cvtsh_ss(blk.d);
#ifdef ROWS_512
        __m512i q2[4], scale2[4];
        q6_K_runs(blk, scales16, q2, scale2);
#else
        __m256i q[8], scale16[8];  // the quants of values 32v..32v+31 (0..63), and their lanes' scales
        q6_K_quants(blk, q);
        for (int v = 0; v < 8; ++v) {  // scale 2v four times, then 2v+1 four times, in both halves of a lane
            const __m128i pick = _mm_set1_epi64x(0x0101010100000000LL + 0x0202020202020202LL * v);
            scale16[v] = twice16(_mm256_and_si256(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(scales8, pick)),
                                                  _mm256_set1_epi32(0xFFFF)));
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
            const auto* a = reinterpret_cast<const A*>(x + r * x_row) + b;
#ifdef ROWS_512
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

// The kernels the table names (weight_types.cpp), for each kind of activation block they take.
#ifdef SPECCHAT_NARROW
const RowsKernel q4_K_rows = gemv_rows_q4_K<block_q8_K>, q4_0_rows = gemv_rows_q4_0,
                 q6_K_rows = vec_dot_rows_q6_K<block_q8_K>;
#else
#define ROWS_KERNEL(kernel) \
    template void kernel(const uint8_t*, int64_t, ReadAhead, const uint8_t*, size_t, int64_t, float*, int64_t)
ROWS_KERNEL(gemv_rows_q4_K<block_q8_K>);
ROWS_KERNEL(vec_dot_rows_q6_K<block_q8_K>);
#ifdef ROWS_512
ROWS_KERNEL(gemv_rows_q4_K<block_q14>);
ROWS_KERNEL(vec_dot_rows_q6_K<block_q14>);
#endif
#endif

}  // namespace ROWS_NAMESPACE
#endif
