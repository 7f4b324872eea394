// How a node's weights are shared among the threads. A weight row is read once per tile of
// activation rows, and the weights' columns are split across the plugin's own threads (the TBB
// arena the inference runs in): the op adds no thread of its own (ggml's mul_mat runs on the
// thread that calls it).
#pragma once

#include <cstdint>
#include <vector>

#include "product.h"
#include "tuning.h"

namespace specchat {

// Every product's columns, every row, on the plugin's threads, shared as `split` says.
void multiply(const std::vector<Product>& products, int64_t m, int64_t k, tuning::Split split);

}  // namespace specchat
