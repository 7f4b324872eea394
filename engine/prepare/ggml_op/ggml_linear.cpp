// GgmlLinear: y_i = x @ W_i^T for weights kept in their GGUF blocks, computed by ggml's CPU kernels
// inside an OpenVINO graph (docs/design.md, "The GGUF's own kernels").
//
// Inputs: x, f32 [..., K]; flags, i64 (or i32) [1] (a graph input, named ggml_gemm): GEMM to
// multiply by ggml's batched kernels, whose rows round with where they fall in a pass (a prompt's
// passes set it), FINE for activations in 14 bits where the CPU can (activations.h); w_1 .. w_n,
// u8 [N_i, row_bytes_i], each weight's rows in the GGUF's blocks. The weights share their input: a
// layer's q, k and v projections, or its gate and up, are one node, so the activations are
// quantized once and the plugin runs one node instead of three (each node costs it a shape
// inference and a hand-over to its threads on every pass).
// Attributes, one entry per weight: ggml_types, the rows' ggml type (Q4_K, Q6_K, Q8_0, Q5_0, F16,
// ...); interleaved, 1 where the rows are interleaved 8 at a time as ggml's CPU "repack" buffer
// lays them out for its gemm and gemv (specchat_interleave in blocks.cpp writes them), 0 where they
// are as the file stores them; biased, 1 where the weight's product gets a bias (none: no bias).
// Outputs: f32 [..., N_i].
//
// What the node computes around its products (fusion.h), each optional: norm (with eps), x
// RMS-normed and times gamma first; biased, a bias added to those products; swiglu, the one
// output silu(y_1) * y_2 (the two weights' rows alike); residual, an input added to the (first)
// output. Their inputs follow the weights': gamma f32 [K], each bias f32 [N_i], the residual f32
// shaped as the output.
//
// The op's parts: the kernels per weight type (weight_types.h) with their families
// (row_kernels.h, amx_tiles.h), the activations (activations.h), a weight's columns through its
// kernels (product.h) and the threads' shares of them (threads.h).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "activations.h"
#include "amx_tiles.h"
#include "fusion.h"
#include "kv_attention.h"
#include "ggml.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"
#include "product.h"
#include "shared.h"
#include "threads.h"
#include "tuning.h"
#include "weight_types.h"

namespace specchat {

class GgmlLinear : public ov::op::Op {
public:
    OPENVINO_OP("GgmlLinear", "specchat");

    GgmlLinear() = default;  // (built from its attributes: an IR's, or a clone's)

    void validate_and_infer_types() override {
        const size_t weights = m_types.size();
        NODE_VALIDATION_CHECK(this,
                              weights > 0 && m_interleaved.size() == weights &&
                                  (m_biased.empty() || m_biased.size() == weights),
                              "one ggml type, one interleaved flag and (where any is) one bias flag per weight");
        NODE_VALIDATION_CHECK(this,
                              get_input_size() == FIRST_WEIGHT + weights + extra_inputs(),
                              "x, the flags, the weights, then gamma, the biases and the residual where the node "
                              "takes them");
        NODE_VALIDATION_CHECK(this,
                              !m_swiglu || weights == 2,
                              "a SwiGLU node has two weights, the gate's and the up's");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        // (declared i64; the CPU plugin runs its graphs' i64 as i32)
        const auto flag = get_input_element_type(1);
        NODE_VALIDATION_CHECK(this,
                              (flag == ov::element::i64 || flag == ov::element::i32) &&
                                  get_input_partial_shape(1).compatible({1}),
                              "the flags must be i64 [1]");
        for (size_t i = FIRST_WEIGHT + weights; i < get_input_size(); ++i)
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "gamma, biases and residual are f32");
        const auto& x = get_input_partial_shape(0);
        std::vector<ov::PartialShape> shapes;
        for (size_t i = 0; i < weights; ++i)
            shapes.push_back(weight_output(i, x));
        if (m_swiglu)
            NODE_VALIDATION_CHECK(this, shapes[0].compatible(shapes[1]), "SwiGLU's gate and up have as many rows");
        for (size_t i = 0; i < (m_swiglu ? 1 : weights); ++i)
            set_output_type(i, ov::element::f32, shapes[i]);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        auto node = std::make_shared<GgmlLinear>();
        node->set_arguments(args);
        node->m_types = m_types;
        node->m_interleaved = m_interleaved;
        node->m_biased = m_biased;
        node->m_norm = m_norm;
        node->m_eps = m_eps;
        node->m_swiglu = m_swiglu;
        node->m_residual = m_residual;
        node->constructor_validate_and_infer_types();
        return node;
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_types", m_types);
        visitor.on_attribute("interleaved", m_interleaved);
        visitor.on_attribute("biased", m_biased);
        visitor.on_attribute("norm", m_norm);
        visitor.on_attribute("eps", m_eps);
        visitor.on_attribute("swiglu", m_swiglu);
        visitor.on_attribute("residual", m_residual);
        return true;
    }

    bool has_evaluate() const override {
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Tensor& x = inputs[0];
        const auto x_shape = x.get_shape();
        const int64_t k = static_cast<int64_t>(x_shape.back());
        const int64_t m = k ? static_cast<int64_t>(x.get_size()) / k : 0;
        const int64_t flags = inputs[1].get_element_type() == ov::element::i64 ? inputs[1].data<const int64_t>()[0]
                                                                              : inputs[1].data<const int32_t>()[0];
        const bool gemm = (flags & GEMM) != 0, fine = !gemm && (flags & FINE) != 0;
        thread_local std::vector<Quantized> quantized;  // (scratch kept per calling thread)
        thread_local std::vector<float> normed, halves;  // x RMS-normed; SwiGLU's two products
        const float* xs = x.data<const float>();
        if (m_norm) {
            normed.resize(static_cast<size_t>(m * k));
            rms_norm(xs, inputs[gamma_input()].data<const float>(), m_eps, m, k, normed.data());
            xs = normed.data();
        }
        size_t kinds = 0;
        std::vector<Product> products(m_types.size());
        std::vector<size_t> inputs_of(m_types.size());  // which of `quantized` each weight reads
        // A prompt pass through the AMX tiles where the CPU has them (its weights' types dequantized).
        const bool tiled = gemm && takes_tiles(m, k);
        const TiledActivations* tiles = nullptr;
        for (size_t i = 0; i < m_types.size(); ++i) {
            Product& p = products[i];
            if (!bind(i, inputs, gemm, m, p))
                return false;
            p.y = m_swiglu ? halves_of(halves, m, p.n, i) : output(outputs[i], x_shape, p.n);
            if (tiled && (p.il == nullptr || p.il->deinterleave != nullptr) &&
                ggml_get_type_traits(p.type)->to_float != nullptr) {
                p.tiles = tiles != nullptr ? tiles : (tiles = tile(xs, m, k));
                continue;
            }
            inputs_of[i] = activations(p, fine && p.takes_fine(), xs, m, k, quantized, kinds);
        }
        // A decode or verify pass takes the candidate chosen for its shape where it runs (tuning.h);
        // a prompt pass, or a wider one, the op's own kernels and the static split.
        const bool tuned = !gemm && m <= tuning::WIDEST_TUNED;
        const std::string key = tuned ? shape_key(products, m, k, fine) : std::string();
        const tuning::Pick pick = tuned ? tuning::pick(key) : tuning::Pick{0, false};
        const tuning::Kernel kernel = tuning::kernel_of(pick.candidate);
        for (size_t i = 0; i < products.size(); ++i) {  // (once the scratch stopped growing)
            Product& p = products[i];
            if (p.tiles != nullptr)
                continue;
            p.x = &quantized[inputs_of[i]];
            // (ggml's kernels take no 14-bit activations)
            p.own = p.has_rows_kernel() && (kernel != tuning::Kernel::Ggml || p.x->fine);
            p.narrow = kernel == tuning::Kernel::Narrow;
            p.read_ahead = kernel != tuning::Kernel::OwnNear;
            p.into_l1 = kernel == tuning::Kernel::OwnL1;
        }
        const auto start = std::chrono::steady_clock::now();
        multiply(products, m, k, tuning::split_of(pick.candidate));
        if (pick.timed)
            tuning::record(key, pick.candidate,
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        finish(products, inputs, outputs, x_shape, m);
        return true;
    }

private:
    // The inputs after the weights: gamma, the biases, the residual, where the node takes them.
    size_t extra_inputs() const {
        size_t biases = 0;
        for (const auto b : m_biased)
            biases += b != 0;
        return (m_norm != 0) + biases + (m_residual != 0);
    }
    size_t gamma_input() const {
        return FIRST_WEIGHT + m_types.size();
    }
    size_t residual_input() const {
        return get_input_size() - 1;
    }

    // Output `out` shaped as x with n columns; its data.
    static float* output(ov::Tensor& out, const ov::Shape& x_shape, int64_t n) {
        auto y_shape = x_shape;
        y_shape.back() = static_cast<size_t>(n);
        if (out.get_shape() != y_shape)
            out.set_shape(y_shape);
        return out.data<float>();
    }

    // Where SwiGLU's product i (0: the gate's, 1: the up's) of [m, n] goes.
    static float* halves_of(std::vector<float>& halves, int64_t m, int64_t n, size_t i) {
        if (halves.size() < static_cast<size_t>(2 * m * n))
            halves.resize(static_cast<size_t>(2 * m * n));
        return halves.data() + i * static_cast<size_t>(m * n);
    }

    // The products' biases, SwiGLU and the residual (fusion.h), in that order.
    void finish(const std::vector<Product>& products, const ov::TensorVector& inputs, ov::TensorVector& outputs,
                const ov::Shape& x_shape, int64_t m) const {
        size_t next = gamma_input() + (m_norm != 0);
        for (size_t i = 0; i < m_biased.size(); ++i)
            if (m_biased[i])
                add_bias(products[i].y, inputs[next++].data<const float>(), m, products[i].n);
        float* y = products[0].y;
        if (m_swiglu) {
            y = output(outputs[0], x_shape, products[0].n);
            swiglu(products[0].y, products[1].y, m, products[0].n, y);
        }
        if (m_residual)
            add_residual(y, inputs[residual_input()].data<const float>(), m * products[0].n);
    }

    // Weight i's part of a pass: its kernels (its type's row of the table, for the pass's flags
    // and rows) and its rows; false where ggml has no kernels for its type here.
    bool bind(size_t i, const ov::TensorVector& inputs, bool gemm, int64_t m, Product& p) const {
        const WeightType* entry = weight_type(m_types[i]);
        if (entry == nullptr || (m_interleaved[i] && entry->interleaved() == nullptr))
            return false;
        p.type = static_cast<ggml_type>(m_types[i]);
        p.tr = entry->ggml;
        p.il = m_interleaved[i] ? entry->interleaved() : nullptr;
        p.own_kernels = &entry->own(p.il != nullptr);
        p.by_ggml = gemm && (p.il == nullptr || (p.il->deinterleave != nullptr && m >= TILED_ROWS));
        p.gemm = gemm && p.il != nullptr && !p.by_ggml && !p.has_rows_kernel();
        const ov::Tensor& w = inputs[i + FIRST_WEIGHT];
        p.w = w.data<const uint8_t>();
        p.w_row = w.get_shape()[1];
        p.n = static_cast<int64_t>(w.get_shape()[0]);
        return true;
    }

    // Which of `quantized` (its first `kinds` made in this call) holds the activations x in p's dot
    // type and layout (in 14 bits where `fine`): each kind is quantized once per call, when a
    // weight first reads it.
    static size_t activations(const Product& p, bool fine, const float* x, int64_t m, int64_t k,
                              std::vector<Quantized>& quantized, size_t& kinds) {
        const Interleaved* layout = p.gemm ? p.il : nullptr;
        size_t found = 0;
        while (found < kinds && (quantized[found].type != p.tr->vec_dot_type || quantized[found].gemm != layout ||
                                 quantized[found].fine != fine))
            ++found;
        if (found == kinds) {
            if (quantized.size() <= kinds)
                quantized.resize(kinds + 1);
            quantized[kinds].type = p.tr->vec_dot_type;
            quantized[kinds].gemm = layout;
            quantized[kinds].fine = fine;
            quantize(x, m, k, quantized[kinds++]);
        }
        return found;
    }

    // What the tuning tells a node's passes apart by: its weights (type, interleaved, rows), K, the
    // pass's rows, the threads and, where any weight takes them, 14-bit activations (their kernels
    // and their time differ), e.g. "q4_Kx8:1536 q6_K:256 k1536 m1 t2" or "... m1 t2 a14".
    static std::string shape_key(const std::vector<Product>& products, int64_t m, int64_t k, bool fine) {
        std::string key;
        bool takes_fine = false;
        for (const auto& p : products) {
            key += std::string(ggml_type_name(p.type)) + (p.il ? "x8:" : ":") + std::to_string(p.n) + " ";
            takes_fine = takes_fine || (fine && p.takes_fine());
        }
        return key + "k" + std::to_string(k) + " m" + std::to_string(m) + " t" +
               std::to_string(parallel_get_max_threads()) + (takes_fine ? " a14" : "");
    }

    // Weight i's output shape for x's, checking its type and rows.
    ov::PartialShape weight_output(size_t i, const ov::PartialShape& x) {
        const int64_t type = m_types[i];
        const WeightType* entry = weight_type(type);
        NODE_VALIDATION_CHECK(this, entry != nullptr, "ggml has no CPU dot product for type ", type);
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved[i] || entry->interleaved() != nullptr,
                              "ggml has no interleaved kernels for ",
                              ggml_type_name(static_cast<ggml_type>(type)));
        NODE_VALIDATION_CHECK(this, get_input_element_type(i + FIRST_WEIGHT) == ov::element::u8, "w must be u8 blocks");
        const auto& w = get_input_partial_shape(i + FIRST_WEIGHT);
        NODE_VALIDATION_CHECK(this, w.rank().is_static() && w.rank().get_length() == 2, "w must be [N, row_bytes]");
        NODE_VALIDATION_CHECK(this,
                              !m_interleaved[i] || (w[0].is_static() && w[0].get_length() % INTERLEAVE == 0),
                              "interleaved rows come in whole groups of ",
                              INTERLEAVE);
        auto out = x;
        if (x.rank().is_static() && x.rank().get_length() >= 1) {
            const auto& k = x[x.rank().get_length() - 1];
            if (k.is_static() && w[1].is_static()) {
                const auto t = static_cast<ggml_type>(type);
                NODE_VALIDATION_CHECK(this,
                                      k.get_length() % ggml_blck_size(t) == 0 &&
                                          static_cast<int64_t>(ggml_row_size(t, k.get_length())) == w[1].get_length(),
                                      "a row of ",
                                      k.get_length(),
                                      " values takes ",
                                      ggml_row_size(t, k.get_length()),
                                      " bytes of ",
                                      ggml_type_name(t),
                                      ", not ",
                                      w[1].get_length());
            }
            out[x.rank().get_length() - 1] = w[0];
        }
        return out;
    }

    std::vector<int64_t> m_types;
    std::vector<int64_t> m_interleaved;
    std::vector<int64_t> m_biased;  // (empty: no bias)
    int64_t m_norm = 0;
    float m_eps = 0.0f;
    int64_t m_swiglu = 0;
    int64_t m_residual = 0;
};

}  // namespace specchat

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<specchat::GgmlLinear>>(),
                                                           std::make_shared<ov::OpExtension<specchat::KvAttention>>()}));
