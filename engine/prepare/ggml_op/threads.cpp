// The threads' shares of a node's columns (threads.h).
#include "threads.h"

#include <algorithm>
#include <atomic>

#include "openvino/core/parallel.hpp"

namespace specchat {

namespace {

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

}  // namespace

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

}  // namespace specchat
