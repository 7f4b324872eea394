// The op's own attention and the KV caches it keeps (kv_attention.h), and the C calls the engine
// reads, sets and frees a cache through (engine.core.kv_cache).
#include "kv_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <immintrin.h>

#include "openvino/core/parallel.hpp"
#include "vec.h"  // (ggml-cpu's: llama.cpp's softmax)

namespace specchat {

namespace {

// One layer's keys and values of one cache, in blocks of BLOCK entries (per KV head, `dim` values
// each): growing adds a block and copies nothing; the first `length` entries are held.
constexpr int64_t BLOCK = 256;
struct LayerCache {
    int64_t heads = 0, dim = 0, length = 0;
    std::vector<std::unique_ptr<float[]>> k, v;  // (a block: [heads][BLOCK][dim])

    int64_t capacity() const {
        return static_cast<int64_t>(k.size()) * BLOCK;
    }
    float* at(std::vector<std::unique_ptr<float[]>>& blocks, int64_t head, int64_t entry) {
        return blocks[static_cast<size_t>(entry / BLOCK)].get() + (head * BLOCK + entry % BLOCK) * dim;
    }
    // Room for `need` entries.
    void reserve(int64_t need) {
        while (capacity() < need)
            for (auto* blocks : {&k, &v})
                blocks->emplace_back(new float[static_cast<size_t>(heads * BLOCK * dim)]);
    }
    // Blocks past the first `keep` entries' given back.
    void shrink(int64_t keep) {
        const size_t blocks = static_cast<size_t>((keep + BLOCK - 1) / BLOCK);
        k.resize(std::min(k.size(), blocks));
        v.resize(std::min(v.size(), blocks));
    }
    // Entries [first, first + count) of KV head `head` set from `values` [count, dim].
    void put(std::vector<std::unique_ptr<float[]>>& blocks, int64_t head, int64_t first, int64_t count,
             const float* values) {
        runs(first, count, [&](int64_t done, int64_t run) {
            std::memcpy(at(blocks, head, first + done), values + done * dim, bytes(run));
        });
    }
    // Entries [first, first + count) of KV head `head` into `out` [count, dim].
    void get(std::vector<std::unique_ptr<float[]>>& blocks, int64_t head, int64_t first, int64_t count, float* out) {
        runs(first, count, [&](int64_t done, int64_t run) {
            std::memcpy(out + done * dim, at(blocks, head, first + done), bytes(run));
        });
    }

private:
    size_t bytes(int64_t entries) const {
        return static_cast<size_t>(entries * dim) * sizeof(float);
    }
    // fn(done, run) for each run of [first, first + count) within one block, `done` entries in.
    template <class F>
    static void runs(int64_t first, int64_t count, F fn) {
        for (int64_t done = 0; done < count;) {
            const int64_t run = std::min(count - done, BLOCK - (first + done) % BLOCK);
            fn(done, run);
            done += run;
        }
    }
};

struct Cache {
    std::vector<LayerCache> layers;
};

std::mutex guard;  // (the map only: a cache is read and written by one request at a time)
std::unordered_map<int64_t, std::unique_ptr<Cache>> caches;

// Layer `layer` of cache `id`, made for `heads` KV heads of `dim` values where it is new.
LayerCache& layer_of(int64_t id, int64_t layer, int64_t heads, int64_t dim) {
    std::lock_guard<std::mutex> lock(guard);
    auto& cache = caches[id];
    if (!cache)
        cache = std::make_unique<Cache>();
    if (static_cast<int64_t>(cache->layers.size()) <= layer)
        cache->layers.resize(static_cast<size_t>(layer + 1));
    LayerCache& entry = cache->layers[static_cast<size_t>(layer)];
    if (entry.k.empty()) {
        entry.heads = heads;
        entry.dim = dim;
    }
    return entry;
}

// a . b over n values, summed in LANES lanes (value i in lane i % LANES), then the lanes pairwise
// (lane l + lane l + 8, then + 4, + 2, + 1): one order whatever the caller. The lanes stay in two
// registers throughout (summed through memory, they stalled on store forwarding: with the values
// below added through memory too, a decode step's attention node took 1.8 times as long).
constexpr int LANES = 16;
inline float dot(const float* a, const float* b, int64_t n) {
    __m256 low = _mm256_setzero_ps(), high = low;  // (lanes 0-7 and 8-15)
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    if (i < n) {
        alignas(32) float acc[LANES];
        _mm256_store_ps(acc, low);
        _mm256_store_ps(acc + 8, high);
        for (; i < n; ++i)
            acc[i % LANES] += a[i] * b[i];
        low = _mm256_load_ps(acc);
        high = _mm256_load_ps(acc + 8);
    }
    const __m256 eight = _mm256_add_ps(low, high);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// add_weighted's values from d on, 8 * C of out's at a time held in registers over every entry;
// where the chunks stop.
template <int C>
inline int64_t add_chunks(float* out, int64_t d, int64_t dim, const float* weights, const float* values,
                          int64_t count) {
    for (; d + 8 * C <= dim; d += 8 * C) {
        __m256 y[C];
        for (int c = 0; c < C; ++c)
            y[c] = _mm256_loadu_ps(out + d + 8 * c);
        for (int64_t j = 0; j < count; ++j) {
            const __m256 w = _mm256_set1_ps(weights[j]);
            const float* v = values + j * dim + d;
            for (int c = 0; c < C; ++c)
                y[c] = _mm256_add_ps(y[c], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * c)));
        }
        for (int c = 0; c < C; ++c)
            _mm256_storeu_ps(out + d + 8 * c, y[c]);
    }
    return d;
}

// out[d] += weights[j] * values[j * dim + d] for each of the `count` entries j in turn (so each
// out[d] sums in the entries' order, as one row at a time would): 64 outputs at a time, then 32
// (with 32 at a time alone, each add waited on the one before: a decode step's attention after
// 1,000 tokens took 1.2 times as long, after 700 in the draft 1.4 times).
inline void add_weighted(float* out, int64_t dim, const float* weights, const float* values, int64_t count) {
    int64_t d = add_chunks<4>(out, add_chunks<8>(out, 0, dim, weights, values, count), dim, weights, values, count);
    for (; d < dim; ++d)
        for (int64_t j = 0; j < count; ++j)
            out[d] += weights[j] * values[j * dim + d];
}

// Query rows a pass attends with at once: each key and value is read from memory once for them
// all (the query heads a KV head serves, at up to TILE positions).
constexpr int64_t TILE = 16;
// Entries whose values are added to every row of a tile before the next span's (64 entries of 128
// values: 32 KB).
constexpr int64_t VALUE_SPAN = 64;
static_assert(BLOCK % VALUE_SPAN == 0, "a span's values lie in one block, one after another");

// One query row: where its query is, where its output goes, and how many entries it attends to.
struct QueryRow {
    const float* q;
    float* out;
    int64_t n;
};

// The attention of `rows` over the entries of `cache`'s KV head `head`: each row's scores over its
// first n entries, their softmax (ggml's, in double) and the values weighed by it, key by key. A
// row's result depends on nothing but its query and its entries, whatever rows it is computed
// beside.
void attend(const std::vector<QueryRow>& rows, LayerCache& cache, int64_t head, float scale) {
    thread_local std::vector<float> scores;
    int64_t longest = 0;
    for (const auto& row : rows)
        longest = std::max(longest, row.n);
    scores.resize(static_cast<size_t>(rows.size() * longest));
    const int64_t dim = cache.dim;
    std::vector<float> most(rows.size(), -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < longest; ++j) {
        const float* key = cache.at(cache.k, head, j);
        for (size_t r = 0; r < rows.size(); ++r) {
            if (j >= rows[r].n)
                continue;
            const float s = dot(rows[r].q, key, dim) * scale;
            scores[r * longest + j] = s;
            most[r] = std::max(most[r], s);
        }
    }
    std::vector<float> sums(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
        float* row = scores.data() + r * longest;
        sums[r] = static_cast<float>(ggml_vec_soft_max_f32(static_cast<int>(rows[r].n), row, row, most[r]));
        std::fill(rows[r].out, rows[r].out + dim, 0.0f);
    }
    // The values a span of entries at a time, for every row (a span's values stay in cache for the
    // rows after the first).
    for (int64_t first = 0; first < longest; first += VALUE_SPAN)
        for (size_t r = 0; r < rows.size(); ++r) {
            const int64_t count = std::min(rows[r].n, first + VALUE_SPAN) - first;
            const float* weights = scores.data() + r * longest + first;
            if (count > 0)
                add_weighted(rows[r].out, dim, weights, cache.at(cache.v, head, first), count);
        }
    for (size_t r = 0; r < rows.size(); ++r) {
        const float inverse = 1.0f / sums[r];
        for (int64_t d = 0; d < dim; ++d)
            rows[r].out[d] *= inverse;
    }
}

// An i64 or i32 input's values.
// RoPE: each of the `count` rows [width, dim] of x (row r at x + r * width * dim) turned by its
// position's angles, cos and sin [width, dim] (the rows' own batch row's), into out, as the graph
// the export writes computes it: x * cos + rotate_half(x) * sin, rotate_half(x) the second half
// negated, then the first.
void rotate(const float* x, const float* cos, const float* sin, int64_t count, int64_t width, int64_t dim, float* out) {
    const int64_t half = dim / 2;
    for (int64_t row = 0; row < count * width; ++row) {
        const float *in = x + row * dim, *c = cos + row % width * dim, *s = sin + row % width * dim;
        float* o = out + row * dim;
        for (int64_t i = 0; i < half; ++i)
            o[i] = in[i] * c[i] + -in[i + half] * s[i];
        for (int64_t i = half; i < dim; ++i)
            o[i] = in[i] * c[i] + in[i - half] * s[i];
    }
}

std::vector<int64_t> integers(const ov::Tensor& input) {
    std::vector<int64_t> values(input.get_size());
    for (size_t i = 0; i < values.size(); ++i)
        values[i] = input.get_element_type() == ov::element::i64 ? input.data<const int64_t>()[i]
                                                                  : input.data<const int32_t>()[i];
    return values;
}

}  // namespace

void KvAttention::validate_and_infer_types() {
    NODE_VALIDATION_CHECK(this, get_input_size() == 5 || get_input_size() == 7,
                          "q, k, v, the caches and their pasts, and RoPE's cos and sin or none");
    for (size_t i : {0, 1, 2, 5, 6})
        NODE_VALIDATION_CHECK(this, i >= get_input_size() || get_input_element_type(i) == ov::element::f32,
                              "q, k, v, cos and sin must be f32");
    for (size_t i = 3; i < 5; ++i)  // (the plugin hands i64 inputs over as i32)
        NODE_VALIDATION_CHECK(this,
                              get_input_element_type(i) == ov::element::i64 || get_input_element_type(i) == ov::element::i32,
                              "caches and pasts must be integers");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
}

std::shared_ptr<ov::Node> KvAttention::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    auto node = std::make_shared<KvAttention>();
    node->set_arguments(args);
    node->m_layer = m_layer;
    node->m_scale = m_scale;
    node->constructor_validate_and_infer_types();
    return node;
}

bool KvAttention::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("layer", m_layer);
    visitor.on_attribute("scale", m_scale);
    return true;
}

bool KvAttention::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto q_shape = inputs[0].get_shape(), kv_shape = inputs[1].get_shape();
    const int64_t rows = static_cast<int64_t>(q_shape[0]), heads = static_cast<int64_t>(q_shape[1]);
    const int64_t width = static_cast<int64_t>(q_shape[2]), dim = static_cast<int64_t>(q_shape[3]);
    const int64_t kv_heads = static_cast<int64_t>(kv_shape[1]);
    const std::vector<int64_t> ids = integers(inputs[3]), pasts = integers(inputs[4]);
    OPENVINO_ASSERT(static_cast<int64_t>(ids.size()) == rows && static_cast<int64_t>(pasts.size()) == rows,
                    "KvAttention: ", rows, " rows, ", ids.size(), " caches and ", pasts.size(), " pasts");
    OPENVINO_ASSERT(kv_heads > 0 && heads % kv_heads == 0 && static_cast<int64_t>(kv_shape[2]) == width &&
                        static_cast<int64_t>(kv_shape[3]) == dim,
                    "KvAttention: q ", q_shape, " and k ", kv_shape, " do not go together");
    const int64_t group = heads / kv_heads;  // (the query heads each KV head serves)
    const float *q = inputs[0].data<const float>(), *k = inputs[1].data<const float>(),
                *v = inputs[2].data<const float>();
    if (inputs.size() == 7) {  // q and k turned by their positions' angles first
        OPENVINO_ASSERT(static_cast<int64_t>(inputs[5].get_size()) == rows * width * dim &&
                            inputs[6].get_size() == inputs[5].get_size(),
                        "KvAttention: cos ", inputs[5].get_shape(), " and sin ", inputs[6].get_shape(), " for q ",
                        q_shape);
        thread_local std::vector<float> turned;  // q's rows, then k's
        turned.resize(static_cast<size_t>(rows * (heads + kv_heads) * width * dim));
        const float *cos = inputs[5].data<const float>(), *sin = inputs[6].data<const float>();
        for (int64_t b = 0; b < rows; ++b) {
            const int64_t angles = b * width * dim;
            rotate(q + b * heads * width * dim, cos + angles, sin + angles, heads, width, dim,
                   turned.data() + b * heads * width * dim);
            rotate(k + b * kv_heads * width * dim, cos + angles, sin + angles, kv_heads, width, dim,
                   turned.data() + (rows * heads + b * kv_heads) * width * dim);
        }
        q = turned.data();
        k = turned.data() + rows * heads * width * dim;
    }
    // The pass's entries into each row's cache, after the entries it keeps.
    std::vector<LayerCache*> layers(static_cast<size_t>(rows));
    for (int64_t b = 0; b < rows; ++b) {
        LayerCache& cache = *(layers[static_cast<size_t>(b)] = &layer_of(ids[b], m_layer, kv_heads, dim));
        const int64_t past = pasts[b];
        OPENVINO_ASSERT(past >= 0 && past <= cache.length, "KvAttention: a pass after ", past,
                        " entries of a cache holding ", cache.length, " (cache ", ids[b], ", layer ", m_layer, ")");
        cache.reserve(past + width);
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t from = (b * kv_heads + h) * width * dim;
            cache.put(cache.k, h, past, width, k + from);
            cache.put(cache.v, h, past, width, v + from);
        }
        cache.length = past + width;
    }
    outputs[0].set_shape(q_shape);
    float* out = outputs[0].data<float>();
    // Each item: up to TILE query positions of one row, for the query heads one KV head serves.
    const int64_t tiles = (width + TILE - 1) / TILE;
    ov::parallel_for(rows * kv_heads * tiles, [&](int64_t item) {
        const int64_t b = item / (kv_heads * tiles), g = item / tiles % kv_heads, first = item % tiles * TILE;
        std::vector<QueryRow> queries;
        for (int64_t t = first; t < std::min(width, first + TILE); ++t)
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                const int64_t at = ((b * heads + h) * width + t) * dim;
                queries.push_back({q + at, out + at, pasts[b] + t + 1});
            }
        attend(queries, *layers[static_cast<size_t>(b)], g, m_scale);
    });
    return true;
}

}  // namespace specchat

using specchat::caches;
using specchat::guard;

namespace {

specchat::LayerCache* find_layer(int64_t id, int64_t layer) {
    std::lock_guard<std::mutex> lock(guard);
    const auto found = caches.find(id);
    if (found == caches.end() || static_cast<int64_t>(found->second->layers.size()) <= layer)
        return nullptr;
    return &found->second->layers[static_cast<size_t>(layer)];
}

}  // namespace

// Cache `id`'s bytes held (every layer's blocks of keys and values).
extern "C" int64_t specchat_kv_bytes(int64_t id) {
    std::lock_guard<std::mutex> lock(guard);
    const auto found = caches.find(id);
    int64_t bytes = 0;
    if (found != caches.end())
        for (const auto& layer : found->second->layers)
            bytes += 2 * layer.heads * layer.capacity() * layer.dim * static_cast<int64_t>(sizeof(float));
    return bytes;
}

// Forget cache `id` and give its memory back.
extern "C" void specchat_kv_free(int64_t id) {
    std::lock_guard<std::mutex> lock(guard);
    caches.erase(id);
}

// Layer `layer`'s first `length` keys (which 0) or values (1) of cache `id` into out [heads, length,
// dim]; false where the cache holds fewer, or other heads or dims.
extern "C" bool specchat_kv_read(int64_t id, int64_t layer, int which, float* out, int64_t heads, int64_t length,
                                 int64_t dim) {
    specchat::LayerCache* cache = find_layer(id, layer);
    if (cache == nullptr || cache->length < length || cache->heads != heads || cache->dim != dim)
        return false;
    for (int64_t h = 0; h < heads; ++h)
        cache->get(which == 0 ? cache->k : cache->v, h, 0, length, out + h * length * dim);
    return true;
}

// Set layer `layer` of cache `id` to hold `length` entries, its keys (which 0) or values (1) from
// in [heads, length, dim]; the blocks past them given back.
extern "C" void specchat_kv_write(int64_t id, int64_t layer, int which, const float* in, int64_t heads,
                                  int64_t length, int64_t dim) {
    specchat::LayerCache& cache = specchat::layer_of(id, layer, heads, dim);
    if (cache.heads != heads || cache.dim != dim)
        cache = specchat::LayerCache{heads, dim};
    cache.shrink(length);
    cache.reserve(length);
    for (int64_t h = 0; h < heads; ++h)
        cache.put(which == 0 ? cache.k : cache.v, h, 0, length, in + h * length * dim);
    cache.length = length;
}
