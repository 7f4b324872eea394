// Activations quantized for a pass (activations.h).
#include "activations.h"

#include <cstring>

#include "ggml-cpu.h"
#include "openvino/core/parallel.hpp"
#include "shared.h"

namespace specchat {

namespace {

#ifdef VNNI_512
// The largest integers of a fine block and of a coarse one (block_q14).
constexpr int32_t FINE_MAX = 8191, COARSE_MAX = 127;
// A block is fine where its largest value is more than this many times its root mean square (at
// most 16, the square root of a block's 256 values). On the default target (the 3,625
// teacher-forced positions of benchmarks/fidelity.py) 11% of blocks were fine, and the next token
// the file model's at 0.996 of them against 0.96-0.97 with Q8_K alone; at 8, 24% and 0.996-0.997;
// at 12, 5% and 0.991-0.996; with every block fine, 0.999-1.000.
constexpr float FINE_RATIO = 10.0f;

// A row of k values (whole blocks) into 14-bit blocks, each fine or coarse by its own values.
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
#endif

}  // namespace

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

}  // namespace specchat

// 1 where the op multiplies Q4_K and Q6_K rows by activations in 14 bits when a pass's flags ask
// for it (the CPU has AVX-512 VNNI), else 0.
extern "C" int specchat_fine_activations() {
#ifdef VNNI_512
    return 1;
#else
    return 0;
#endif
}
