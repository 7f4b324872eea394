// Prompt passes on AMX tiles (amx_tiles.h).
#include "amx_tiles.h"

#ifdef AMX_TILES
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "openvino/core/parallel.hpp"
#include "product.h"
#endif
#include "shared.h"

namespace specchat {

#ifdef AMX_TILES
namespace {

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

}  // namespace

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

namespace {

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

// Where weight row `col` (of AMX_COLUMNS) keeps its values s * TILE_K .. in the bf16 weight tiles.
inline uint16_t* tile_row(uint16_t* w, int64_t col, int64_t s) {
    return w + ((2 * s + col / TILE) * TILE + col % TILE) * TILE_K;
}

// Weight rows [c0, c0 + cols) of p into the bf16 weight tiles `w` (AMX_COLUMNS rows, zero past
// cols): by the table's packer where the type has one (Q4_K groups, Q6_K rows), straight; other
// types by ggml's to_float (interleaved rows put back as stored first).
AMX_TARGET void weight_tiles(const Product& p, int64_t k, int64_t c0, int64_t cols, uint16_t* w) {
    thread_local std::vector<float> f32;
    thread_local std::vector<uint8_t> stored;
    f32.resize(static_cast<size_t>(p.unit() * k));
    stored.resize(static_cast<size_t>(p.unit()) * p.w_row);
    const int64_t blocks = k / ggml_blck_size(p.type);
    for (int64_t col = 0; col < AMX_COLUMNS; col += p.unit()) {
        const uint8_t* rows = p.w + (c0 + col) * p.w_row;
        if (col < cols && p.own_kernels->tiles != nullptr) {
            p.own_kernels->tiles(rows, blocks, col, w);
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

}  // namespace

// A group of 8 interleaved Q4_K rows (`blocks` blocks) into the bf16 weight tiles, as rows col ..
// col + 7: each value d * scale * q - dmin * min in f32, as ggml's to_float computes it, rounded
// to bf16 (read straight from the group, not put back as stored first).
AMX_TARGET void q4_K_tiles(const uint8_t* rows, int64_t blocks, int64_t col, uint16_t* w) {
    const auto* group = reinterpret_cast<const block_q4_Kx8*>(rows);
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

// A Q6_K row as stored (`blocks` blocks) into the bf16 weight tiles as row col: each value
// d * scale * (q - 32) in f32, as ggml's to_float computes it, rounded to bf16.
AMX_TARGET void q6_K_tiles(const uint8_t* row, int64_t blocks, int64_t col, uint16_t* w) {
    const auto* row_blocks = reinterpret_cast<const block_q6_K*>(row);
    for (int64_t b = 0; b < blocks; ++b) {
        const block_q6_K& blk = row_blocks[b];
        const float d = _cvtsh_ss(blk.d);
        __m256i q[8];
        q6_K_quants(blk, q);
        const __m512 offset = _mm512_set1_ps(32.0f);
        for (int v = 0; v < 8; ++v) {  // values 32v.. : their two 16s' scales 2v and 2v + 1
            const __m512 first = _mm512_mul_ps(_mm512_set1_ps(d * blk.scales[2 * v]),
                                               _mm512_sub_ps(bytes_f32(_mm256_castsi256_si128(q[v])), offset));
            const __m512 second = _mm512_mul_ps(_mm512_set1_ps(d * blk.scales[2 * v + 1]),
                                                _mm512_sub_ps(bytes_f32(_mm256_extracti128_si256(q[v], 1)), offset));
            _mm512_storeu_si512(tile_row(w, col, b * 8 + v), bf16x32(first, second));
        }
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

}  // namespace specchat

// 1 where a prompt pass of AMX_ROWS rows or more multiplies through the AMX tiles here (the CPU
// has bf16 tiles and Linux lets the process use them), else 0.
extern "C" int specchat_prompt_tiles() {
    return specchat::takes_tiles(1 << 10, 1 << 10);
}
