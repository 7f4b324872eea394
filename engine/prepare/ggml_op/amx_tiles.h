// Prompt passes on AMX: activations and weights in bf16, multiplied by the CPU's tile unit
// (`tdpbf16ps`) with f32 sums. A weight is dequantized once per pass to the f32 values ggml's
// to_float gives (Q4_K and Q6_K here in registers, other types by to_float itself), and its bf16
// copy multiplied by every row of the pass: in a prompt pass of 256 rows the integer kernels
// (row_kernels.h) spend most of their time on instructions other than the multiply-adds, which the
// tile unit does 16 by 16 by 32 at a time. The rows round like the plugin's bf16 reader's (bf16
// inputs, f32 sums), not like llama.cpp's Q8_K activations; only prompt passes take it.
#pragma once

#include <cstdint>

#include "instructions.h"

namespace specchat {

struct Product;
struct TiledActivations;  // the activations in bf16 as the tiles take them

// Whether a prompt pass of m rows of k values goes through the AMX tiles here.
bool takes_tiles(int64_t m, int64_t k);
// x (m rows of k values) in bf16 tiles, kept per calling thread.
const TiledActivations* tile(const float* x, int64_t m, int64_t k);

#ifdef AMX_TILES
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

// Columns [first, last) of p, every row, through the tiles (p.tiles).
AMX_TARGET void multiply_columns_by_tiles(const Product& p, int64_t m, int64_t k, int64_t first, int64_t last);
// The table's TilePackers (weight_types.h): a group of 8 interleaved Q4_K rows, one Q6_K row.
AMX_TARGET void q4_K_tiles(const uint8_t* group, int64_t blocks, int64_t col, uint16_t* w);
AMX_TARGET void q6_K_tiles(const uint8_t* row, int64_t blocks, int64_t col, uint16_t* w);
#endif

}  // namespace specchat
