// GgmlLinear: y = x @ W^T for a weight kept in its GGUF blocks, computed by ggml's CPU kernels
// inside an OpenVINO graph (docs/design.md, "The GGUF's own kernels").
//
// Inputs: x, f32 [..., K]; w, u8 [N, row_bytes], the N rows of the weight in the GGUF's blocks.
// Attributes: ggml_type, the rows' ggml type (Q4_K, Q6_K, Q8_0, Q5_0, F16, ...); interleaved, 1
// where the rows are interleaved 8 at a time as ggml's CPU "repack" buffer lays them out for its
// gemm and gemv (specchat_interleave below writes them), 0 where they are as the file stores them;
// gemm, 1 to multiply interleaved rows by fours of activation rows with ggml's gemm.
// Output: f32 [..., N].
//
// Activation rows are quantized once to the type's dot type (Q8_K for the K-quants, Q8_0 for the
// legacy ones), as llama.cpp does. Interleaved weights are multiplied by ggml's gemv one
// activation row at a time, or with `gemm` by its gemm four rows at a time and gemv for the rows
// left over (llama.cpp's own way for a repacked weight: faster for many rows, but a row then
// rounds differently with where it falls, so it is for prompt passes). Rows as stored go through
// the type's vec_dot, one weight row by one activation row. Without gemm, a row's result never
// depends on the other rows, bit for bit. A weight row is read once per tile of activation rows,
// and output columns are split across the plugin's own threads (the TBB arena the inference runs
// in): the op adds no thread of its own.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"
#include "repack.h"  // ggml's interleaved gemm and gemv (ggml/src/ggml-cpu)

namespace specchat {

namespace {

// Output columns a thread takes at a time (a multiple of INTERLEAVE): enough to amortize the loop,
// few enough to keep their weight rows in the core's L2 while a tile of activation rows passes.
constexpr int64_t COLUMNS_PER_BLOCK = 64;
// Activation rows multiplied with a block of weight rows before the next block (a multiple of
// GEMM_ROWS): their quantized copies stay in cache however long the pass (a prompt).
constexpr int64_t ROWS_PER_TILE = 64;
constexpr int64_t INTERLEAVE = 8;  // weight rows interleaved together
constexpr int64_t GEMM_ROWS = 4;   // activation rows a gemm call takes at a time

using Gemx = void (*)(int, float*, size_t, const void*, const void*, int, int);
using Quantize4 = void (*)(const float*, void*, int64_t);

// ggml's kernels for a type whose weight rows are interleaved 8 at a time: on x86 (AVX2 and up)
// the layout ggml's repack buffer chooses for these types.
struct Interleaved {
    ggml_type type;
    Quantize4 quantize4;  // four activation rows into the gemm's interleaved dot-type blocks
    Gemx gemv;
    Gemx gemm;
};

const Interleaved* interleaved_kernels(int64_t type) {
    static const Interleaved kernels[] = {
        {GGML_TYPE_Q4_K, ggml_quantize_mat_q8_K_4x8, ggml_gemv_q4_K_8x8_q8_K, ggml_gemm_q4_K_8x8_q8_K},
        {GGML_TYPE_Q4_0, ggml_quantize_mat_q8_0_4x8, ggml_gemv_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0},
        {GGML_TYPE_IQ4_NL, ggml_quantize_mat_q8_0_4x8, ggml_gemv_iq4_nl_8x8_q8_0, ggml_gemm_iq4_nl_8x8_q8_0},
    };
    for (const auto& found : kernels)
        if (found.type == type)
            return &found;
    return nullptr;
}

// ggml's warnings and errors go to stderr; its notes (one per weight it repacks) are dropped.
void log_warnings(ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR)
        std::fputs(text, stderr);
}

const ggml_type_traits_cpu* traits(int64_t type) {
    static std::once_flag initialized;
    std::call_once(initialized, [] {
        ggml_log_set(log_warnings, nullptr);
        ggml_cpu_init();
    });
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return nullptr;
    const auto* found = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    return found != nullptr && found->vec_dot != nullptr ? found : nullptr;
}

// One call's operands: m activation rows of k values against n weight rows.
struct Problem {
    int64_t m, k, n;
    const uint8_t* w;  // weight rows (w_row bytes each; interleaved: 8 rows per 8 * w_row bytes)
    size_t w_row;
    const uint8_t* xq;  // activations in the dot type (x_row bytes each; interleaved in fours)
    size_t x_row;
    float* y;  // [m, n]
};

// The activations in the dot type: for the gemm (`il`), whole fours of rows in its layout and the
// rest row by row (as llama.cpp quantizes them), else every row by itself.
void quantize(const float* x, uint8_t* xq, const Problem& p, const ggml_type_traits_cpu* tq, const Interleaved* gemm) {
    const int64_t fours = gemm ? p.m / GEMM_ROWS : 0;
    const int64_t singles = p.m - fours * GEMM_ROWS;
    ov::parallel_nt_static(fours + singles > 1 ? 0 : 1, [&](int thread, int threads) {
        int64_t start = 0, stop = 0;
        ov::splitter(fours + singles, threads, thread, start, stop);
        for (int64_t task = start; task < stop; ++task) {
            if (task < fours) {
                gemm->quantize4(x + task * GEMM_ROWS * p.k, xq + task * GEMM_ROWS * p.x_row, p.k);
                continue;
            }
            const int64_t row = fours * GEMM_ROWS + task - fours;
            if (tq->from_float != nullptr)
                tq->from_float(x + row * p.k, xq + row * p.x_row, p.k);
            else  // (an f32 dot type)
                std::memcpy(xq + row * p.x_row, x + row * p.k, p.x_row);
        }
    });
}

// Columns [first, last) of rows [r0, r1) (r0 a multiple of GEMM_ROWS).
void multiply_block(const Problem& p,
                    const ggml_type_traits_cpu* tr,
                    const Interleaved* il,
                    bool gemm,
                    int64_t r0,
                    int64_t r1,
                    int64_t first,
                    int64_t last) {
    if (il == nullptr) {
        for (int64_t col = first; col < last; ++col)
            for (int64_t row = r0; row < r1; ++row)
                tr->vec_dot(static_cast<int>(p.k), p.y + row * p.n + col, 0, p.w + col * p.w_row, 0,
                            p.xq + row * p.x_row, 0, 1);
        return;
    }
    const int k = static_cast<int>(p.k), cols = static_cast<int>(last - first);
    const uint8_t* w = p.w + first * p.w_row;
    const int64_t fours = gemm ? (r1 - r0) / GEMM_ROWS * GEMM_ROWS : 0;
    if (fours > 0)
        il->gemm(k, p.y + r0 * p.n + first, p.n, w, p.xq + r0 * p.x_row, static_cast<int>(fours), cols);
    for (int64_t row = r0 + fours; row < r1; ++row)
        il->gemv(k, p.y + row * p.n + first, p.n, w, p.xq + row * p.x_row, 1, cols);
}

void multiply(const Problem& p, const ggml_type_traits_cpu* tr, const Interleaved* il, bool gemm) {
    // Each thread takes one contiguous range of columns: a long stream of weight rows for the
    // hardware prefetchers (ranges taken block by block from a shared counter, as ggml's own
    // chunks are, made a plain step slower by a quarter).
    const int64_t unit = il ? INTERLEAVE : 1;  // columns stay whole interleaved groups
    ov::parallel_nt_static(0, [&](int thread, int threads) {
        int64_t start = 0, stop = 0;
        ov::splitter(p.n / unit, threads, thread, start, stop);
        for (int64_t r0 = 0; r0 < p.m; r0 += ROWS_PER_TILE)
            for (int64_t c0 = start * unit; c0 < stop * unit; c0 += COLUMNS_PER_BLOCK)
                multiply_block(p, tr, il, gemm, r0, std::min(p.m, r0 + ROWS_PER_TILE), c0,
                               std::min(stop * unit, c0 + COLUMNS_PER_BLOCK));
    });
}

}  // namespace

class GgmlLinear : public ov::op::Op {
public:
    OPENVINO_OP("GgmlLinear", "specchat");

    GgmlLinear() = default;

    GgmlLinear(const ov::Output<ov::Node>& x,
               const ov::Output<ov::Node>& w,
               int64_t type,
               int64_t interleaved,
               int64_t gemm)
        : Op({x, w}),
          m_type(type),
          m_interleaved(interleaved),
          m_gemm(gemm) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const auto* tr = traits(m_type);
        NODE_VALIDATION_CHECK(this, tr != nullptr, "ggml has no CPU dot product for type ", m_type);
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved || interleaved_kernels(m_type) != nullptr,
                              "ggml has no interleaved kernels for ",
                              ggml_type_name(static_cast<ggml_type>(m_type)));
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8, "w must be u8 blocks");
        const auto& x = get_input_partial_shape(0);
        const auto& w = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, w.rank().is_static() && w.rank().get_length() == 2, "w must be [N, row_bytes]");
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved || (w[0].is_static() && w[0].get_length() % INTERLEAVE == 0),
                              "interleaved rows come in whole groups of ",
                              INTERLEAVE);
        auto out = x;
        if (x.rank().is_static() && x.rank().get_length() >= 1) {
            const auto& k = x[x.rank().get_length() - 1];
            if (k.is_static() && w[1].is_static()) {
                const auto type = static_cast<ggml_type>(m_type);
                NODE_VALIDATION_CHECK(this,
                                      k.get_length() % ggml_blck_size(type) == 0 &&
                                          static_cast<int64_t>(ggml_row_size(type, k.get_length())) == w[1].get_length(),
                                      "a row of ",
                                      k.get_length(),
                                      " values takes ",
                                      ggml_row_size(type, k.get_length()),
                                      " bytes of ",
                                      ggml_type_name(type),
                                      ", not ",
                                      w[1].get_length());
            }
            out[x.rank().get_length() - 1] = w[0];
        }
        set_output_type(0, ov::element::f32, out);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlLinear>(args.at(0), args.at(1), m_type, m_interleaved, m_gemm);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_type", m_type);
        visitor.on_attribute("interleaved", m_interleaved);
        visitor.on_attribute("gemm", m_gemm);
        return true;
    }

    bool has_evaluate() const override {
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto* tr = traits(m_type);
        const auto* il = m_interleaved ? interleaved_kernels(m_type) : nullptr;
        if (tr == nullptr || (m_interleaved && il == nullptr))
            return false;
        const ov::Tensor& x = inputs[0];
        const ov::Tensor& w = inputs[1];
        const auto x_shape = x.get_shape();
        Problem p{};
        p.k = static_cast<int64_t>(x_shape.back());
        p.n = static_cast<int64_t>(w.get_shape()[0]);
        p.m = p.k ? static_cast<int64_t>(x.get_size()) / p.k : 0;
        p.w = w.data<const uint8_t>();
        p.w_row = w.get_shape()[1];
        p.x_row = ggml_row_size(tr->vec_dot_type, p.k);
        auto y_shape = x_shape;
        y_shape.back() = static_cast<size_t>(p.n);
        if (outputs[0].get_shape() != y_shape)
            outputs[0].set_shape(y_shape);
        p.y = outputs[0].data<float>();

        thread_local std::vector<uint8_t> quantized;  // (scratch kept per calling thread)
        quantized.resize(p.x_row * static_cast<size_t>(p.m));
        p.xq = quantized.data();
        const bool gemm = il != nullptr && m_gemm != 0;
        quantize(x.data<const float>(), quantized.data(), p, ggml_get_type_traits_cpu(tr->vec_dot_type), gemm ? il : nullptr);
        multiply(p, tr, il, gemm);
        return true;
    }

private:
    int64_t m_type = 0;
    int64_t m_interleaved = 0;
    int64_t m_gemm = 0;
};

}  // namespace specchat

// Writes n weight rows of k values of `type` (as the GGUF stores them) interleaved as ggml's CPU
// repack buffer lays them out, into `out` (as many bytes). Returns 1 where that layout is the one
// the op's interleaved kernels read (checked on a row of activations against vec_dot), else 0
// and `out` is left as it was: the rows then stay as stored.
extern "C" int specchat_interleave(int type, const void* rows, void* out, int64_t n, int64_t k) {
    using namespace specchat;
    const auto* tr = traits(type);
    const auto* il = interleaved_kernels(type);
    if (tr == nullptr || il == nullptr || n % INTERLEAVE != 0 || k % ggml_blck_size(static_cast<ggml_type>(type)) != 0)
        return 0;
    ggml_init_params params{ggml_tensor_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* t = ggml_new_tensor_2d(ctx, static_cast<ggml_type>(type), k, n);
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_repack_buffer_type(), ggml_nbytes(t));
    int ok = buffer != nullptr && ggml_backend_tensor_alloc(buffer, t, ggml_backend_buffer_get_base(buffer)) ==
                                      GGML_STATUS_SUCCESS && t->extra != nullptr;  // (no repack for it on this CPU)
    if (ok) {
        ggml_backend_tensor_set(t, rows, 0, ggml_nbytes(t));
        // The layout is the one the kernels read when gemv gives what vec_dot gives on the rows as stored.
        std::vector<float> x(static_cast<size_t>(k)), by_rows(static_cast<size_t>(n)), by_groups(static_cast<size_t>(n));
        for (int64_t i = 0; i < k; ++i)
            x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) + 0.1f;
        const auto* tq = ggml_get_type_traits_cpu(tr->vec_dot_type);
        std::vector<uint8_t> xq(ggml_row_size(tr->vec_dot_type, k));
        tq->from_float(x.data(), xq.data(), k);
        float largest = 0, off = 0;
        for (int64_t col = 0; col < n; ++col) {
            tr->vec_dot(static_cast<int>(k), &by_rows[static_cast<size_t>(col)], 0,
                        static_cast<const uint8_t*>(rows) + col * ggml_row_size(static_cast<ggml_type>(type), k), 0,
                        xq.data(), 0, 1);
            largest = std::max(largest, std::fabs(by_rows[static_cast<size_t>(col)]));
        }
        il->gemv(static_cast<int>(k), by_groups.data(), static_cast<size_t>(n), t->data, xq.data(), 1, static_cast<int>(n));
        for (int64_t col = 0; col < n; ++col)
            off = std::max(off, std::fabs(by_rows[static_cast<size_t>(col)] - by_groups[static_cast<size_t>(col)]));
        ok = off <= 1e-4f * std::max(largest, 1.0f);
        if (ok)
            std::memcpy(out, t->data, ggml_nbytes(t));
    }
    if (buffer != nullptr)
        ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
    return ok;
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<specchat::GgmlLinear>>()}));
