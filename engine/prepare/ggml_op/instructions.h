// Which of the op's kernel families this build has, from the instructions it is compiled for
// (-march=native: the CPU the library is built on, engine/prepare/kernels.py). Every family's
// code sits behind these guards, and the table of kernels per weight type (weight_types.cpp)
// names a family's kernels only where it is built.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The multi-row kernels' 512-bit paths: AVX-512 VNNI on byte and word lanes.
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_512 1
#endif

// Prompt passes on AMX tiles (amx_tiles.h): built wherever GCC builds AVX2 (the tile
// instructions are compiled per function), taken where the CPU has them.
#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__)
#define AMX_TILES 1
#endif
