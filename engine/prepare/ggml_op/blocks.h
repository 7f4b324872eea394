// The GGUF blocks' fields unpacked, as more than one kernel family reads them, and Q4_K rows
// interleaved as ggml's repack lays them out put back as the file stores them.
#pragma once

#include <cstdint>

#include "instructions.h"
#include "repack.h"  // the blocks (ggml/src/ggml-common.h) and their interleaved groups

namespace specchat {

// Q4_K's 12 bytes of 6-bit scales and mins (8 of each), as the GGUF format packs them.
void unpack_scales(const uint8_t* q, uint8_t* scales, uint8_t* mins);

// A group of 8 interleaved Q4_K rows (`blocks` block_q4_Kx8 in a row) back into the 8 rows of
// blocks the file stores: the inverse of the layout ggml's repack writes (its d and dmin side by
// side, its quants 8 bytes from each row in turn, and per sub-block the 8 rows' scales and mins
// packed as one Q4_K block packs its 8 sub-blocks').
void deinterleave_q4_K(const uint8_t* group, uint8_t* rows, int64_t blocks);

#if defined(__AVX2__)
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
#endif

}  // namespace specchat
