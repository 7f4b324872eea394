// The threads' shares of a node's columns (threads.h).
#include "threads.h"

#include <algorithm>
#include <atomic>

#include "openvino/core/parallel.hpp"

namespace specchat {

namespace {

// The units (whole interleaved groups) of each product, one after another, in `count` parts of
// about as many weight bytes: each part's (product, first column, last column) ranges, in order,
// part i's from ranges[first[i]] up to ranges[first[i + 1]].
struct Range {
    size_t product;
    int64_t first, last;
};
struct Parts {
    std::vector<Range> ranges;
    std::vector<size_t> first;
};
Parts split_bytes(const std::vector<Product>& products, int count) {
    int64_t bytes = 0;
    for (const auto& p : products)
        bytes += p.n * static_cast<int64_t>(p.w_row);
    Parts out;
    for (int part = 0; part < count; ++part) {
        out.first.push_back(out.ranges.size());
        int64_t start = 0, stop = 0;
        ov::splitter(bytes, count, part, start, stop);
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
                out.ranges.push_back({i, lo * p.unit(), hi * p.unit()});
            offset += units * unit_bytes;
        }
    }
    out.first.push_back(out.ranges.size());
    return out;
}

// Chunks each thread's range is cut into for a Stealing split: a thread that has done its own
// takes the others' last chunks.
constexpr int CHUNKS_PER_THREAD = 8;

// A thread's chunks claimed so far (by it from the front, by the others from the back): apart,
// so that claiming one's own chunk touches no line another thread writes until it steals.
struct alignas(64) Claims {
    std::atomic<int> taken{0};   // chunks claimed, from either end
    std::atomic<int> stolen{0};  // of them, from the back
};

}  // namespace

void multiply(const std::vector<Product>& products, int64_t m, int64_t k, tuning::Split split) {
    // The weights' columns, one after another, split into as many bytes for each thread (a layer's
    // q and k in Q4_K groups of 8 rows and its v in Q6_K rows split by rows instead left one
    // thread twice the other's work): one contiguous range each, or that range in chunks, the
    // others' last chunks taken by a thread that is done with its own (one woken late, or
    // slowed, finishes the node with less).
    const int threads = parallel_get_max_threads();
    const bool stealing = split == tuning::Split::Stealing && threads > 1;
    const int chunks = stealing ? CHUNKS_PER_THREAD : 1;
    const Parts parts = split_bytes(products, threads * chunks);
    const auto run = [&](int part) {
        for (size_t i = parts.first[part]; i < parts.first[part + 1]; ++i) {
            const Range& r = parts.ranges[i];
            multiply_columns(products[r.product], m, k, r.first, r.last);
        }
    };
    std::vector<Claims> claims(stealing ? threads : 0);
    ov::parallel_nt_static(0, [&](int thread, int nthreads) {
        if (!stealing) {
            for (int part = thread; part < threads; part += nthreads)
                run(part);
            return;
        }
        for (int own = 0; thread < threads && claims[thread].taken.fetch_add(1) < chunks; ++own)
            run(thread * chunks + own);
        for (int step = 1; step < threads; ++step) {
            const int other = (thread + step) % threads;
            while (claims[other].taken.fetch_add(1) < chunks)
                run(other * chunks + chunks - 1 - claims[other].stolen.fetch_add(1));
        }
    });
}

}  // namespace specchat
