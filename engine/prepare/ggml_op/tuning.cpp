// The op's choice of candidate per pass shape (tuning.h), and the C calls engine.ggml reads and
// sets it through.
#include "tuning.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <vector>

#include "instructions.h"

namespace specchat::tuning {

namespace {

struct Shape {
    std::array<std::vector<double>, CANDIDATES> seconds;
    std::array<int, CANDIDATES> calls{};
    int chosen = -1;
};

std::mutex guard;
std::map<std::string, Shape> shapes;  // (ordered: the choices read out in a stable order)
std::atomic<int> forced{-1};
std::atomic<int64_t> untimed{0};  // passes of a shape not chosen yet, ever (specchat_timing_calls)

}  // namespace

bool timed_here(int candidate) {
#ifdef VNNI_512
    return candidate >= 0;
#else
    return kernel_of(candidate) != Kernel::Narrow;
#endif
}

Pick pick(const std::string& key) {
    const int force = forced.load(std::memory_order_relaxed);
    if (force >= 0)
        return {force, false};
    std::lock_guard<std::mutex> lock(guard);
    Shape& shape = shapes[key];
    if (shape.chosen >= 0)
        return {shape.chosen, false};
    untimed.fetch_add(1, std::memory_order_relaxed);
    // The candidate called least so far: they take turns, so a drift of the machine's speed
    // weighs on each alike.
    int candidate = -1;
    for (int c = 0; c < CANDIDATES; ++c)
        if (timed_here(c) && (candidate < 0 || shape.calls[c] < shape.calls[candidate]))
            candidate = c;
    return {candidate, shape.calls[candidate]++ > 0};  // (a candidate's first call sets up its scratch: not timed)
}

void record(const std::string& key, int candidate, double seconds) {
    std::lock_guard<std::mutex> lock(guard);
    Shape& shape = shapes[key];
    if (shape.chosen >= 0)
        return;
    shape.seconds[candidate].push_back(seconds);
    std::vector<double> all;  // (a candidate not timed here: never chosen)
    for (int c = 0; c < CANDIDATES; ++c) {
        const auto& timed = shape.seconds[c];
        if (!timed_here(c)) {
            all.insert(all.end(), SAMPLES, std::numeric_limits<double>::infinity());
            continue;
        }
        if (timed.size() < SAMPLES)
            return;
        all.insert(all.end(), timed.begin(), timed.begin() + SAMPLES);
    }
    shape.chosen = choose(all.data(), CANDIDATES, SAMPLES);
}

int choose(const double* seconds, int candidates, int samples) {
    int best = 0;
    double best_median = 0;
    std::vector<double> timed(static_cast<size_t>(samples));
    for (int c = 0; c < candidates; ++c) {
        std::copy(seconds + c * samples, seconds + (c + 1) * samples, timed.begin());
        std::nth_element(timed.begin(), timed.begin() + samples / 2, timed.end());
        const double median = timed[static_cast<size_t>(samples / 2)];
        if (c == 0 || median < best_median) {
            best = c;
            best_median = median;
        }
    }
    return best;
}

}  // namespace specchat::tuning

using namespace specchat::tuning;

// The index of the candidate whose median of `samples` seconds is the lowest (the op's own rule).
extern "C" int specchat_choose(const double* seconds, int candidates, int samples) {
    return choose(seconds, candidates, samples);
}

// The choices made so far, a line "key<TAB>candidate" each, into out (at most size bytes with the
// closing NUL); returns the length they take (without it), to call again with more room.
extern "C" int specchat_choices(char* out, int size) {
    std::string text;
    {
        std::lock_guard<std::mutex> lock(guard);
        for (const auto& [key, shape] : shapes)
            if (shape.chosen >= 0)
                text += key + "\t" + std::to_string(shape.chosen) + "\n";
    }
    if (out != nullptr && size > 0) {
        const size_t n = std::min(text.size(), static_cast<size_t>(size - 1));
        std::memcpy(out, text.data(), n);
        out[n] = '\0';
    }
    return static_cast<int>(text.size());
}

// Passes of `key` take `candidate` from now on (a choice read back from an earlier start).
extern "C" void specchat_set_choice(const char* key, int candidate) {
    if (candidate < 0 || candidate >= CANDIDATES)
        return;
    std::lock_guard<std::mutex> lock(guard);
    shapes[key].chosen = candidate;
}

// Every pass takes `candidate` (-1: each shape its own choice): for tests and probes.
extern "C" void specchat_force(int candidate) {
    forced.store(candidate >= 0 && candidate < CANDIDATES ? candidate : -1);
}

// How many calls so far took a candidate in turn, their shape not chosen yet: a pass after which
// it has not grown met only shapes already chosen.
extern "C" int64_t specchat_timing_calls() {
    return untimed.load(std::memory_order_relaxed);
}

// Forget every choice and timing: each shape is timed again (--remeasure).
extern "C" void specchat_forget() {
    std::lock_guard<std::mutex> lock(guard);
    shapes.clear();
}
