// Which way a decode or verify pass multiplies, chosen by timing the candidates where the op runs
// (docs/design.md, "Kernels chosen where they run"), as FFTW's planner measures its plans: no
// constant tuned on another CPU decides it.
//
// Every candidate gives each row the bits ggml's one-row kernel gives it (its gemv on interleaved
// rows, its vec_dot on rows as stored), whatever the pass width: they differ in speed only. A
// node's passes of one shape (its weights, K, the rows and the threads: a key) take the candidates
// in turn until each has been timed SAMPLES times after a first call, then the one with the
// lowest median for good. The choices are read out and put back by the engine (engine.ggml), so
// a later start on the same CPU and build times nothing.
#pragma once

#include <cstdint>
#include <string>

namespace specchat::tuning {

// Whose kernels multiply a pass's rows: the op's own multi-row kernels (each weight block
// unpacked once for every row, the blocks it reads next prefetched into L2), ggml's one-row
// kernels, called row by row, the op's own on 256-bit registers alone (a candidate only where the
// CPU has 512-bit VNNI too: Narrow where it does not would time the op's own kernels twice), the
// op's own reading nothing ahead (where the hardware's prefetchers do better alone), or reading
// ahead into L1 (ReadAhead, weight_types.h).
enum class Kernel { Own = 0, Ggml = 1, Narrow = 2, OwnNear = 3, OwnL1 = 4 };
constexpr int KERNELS = 5;
// How the threads share a node's columns: one contiguous range of weight bytes each (a long
// stream for the hardware prefetchers), or that range in chunks, a thread done with its own
// taking the others' last ones (one woken late by the pool, or slowed, takes fewer).
enum class Split { Static = 0, Stealing = 1 };

constexpr int CANDIDATES = 2 * KERNELS;
constexpr int SAMPLES = 5;  // timed calls per candidate before a choice
// Passes wider than this are not tuned: they take the op's own kernels and the static split.
constexpr int64_t WIDEST_TUNED = 64;

constexpr Kernel kernel_of(int candidate) {
    return static_cast<Kernel>(candidate % KERNELS);
}
constexpr Split split_of(int candidate) {
    return static_cast<Split>(candidate / KERNELS);
}
// Whether this build times `candidate` (forced, any candidate runs: Narrow as Own where the CPU
// has one width).
bool timed_here(int candidate);

// The candidate a pass of `key` takes, and whether its time is to be recorded.
struct Pick {
    int candidate;
    bool timed;
};
Pick pick(const std::string& key);
// A timed pass's seconds; once every candidate has its samples, the key's choice is made.
void record(const std::string& key, int candidate, double seconds);
// The candidate whose median of `samples` seconds (seconds[c * samples + i]) is the lowest; the
// first of equals.
int choose(const double* seconds, int candidates, int samples);

}  // namespace specchat::tuning
