// GgmlLinear: y = x @ W^T for a weight kept in its GGUF blocks, computed by ggml's CPU kernels
// inside an OpenVINO graph (docs/design.md, "The GGUF's own kernels").
//
// Inputs: x, f32 [..., K]; w, u8 [N, row_bytes], the N rows of the weight exactly as the GGUF file
// stores them. Attribute ggml_type: the rows' ggml type (Q4_K, Q6_K, Q8_0, Q5_0, F16, ...).
// Output: f32 [..., N].
//
// Each activation row is quantized once to the type's vec_dot type (Q8_K for the K-quants, Q8_0
// for the legacy ones), as llama.cpp does, then every weight row is multiplied with every
// activation row by the type's vec_dot: a weight row is read once per call whatever the number of
// rows, and a row's result never depends on the other rows (bit for bit at any pass width). The
// output rows are split across the plugin's own threads (the TBB arena the inference runs in), so
// the op adds no thread of its own.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"

namespace specchat {

namespace {

// Output rows a thread takes at a time: enough to amortize the loop, few enough to balance threads.
constexpr int64_t ROWS_PER_TASK = 16;

const ggml_type_traits_cpu* traits(int64_t type) {
    static std::once_flag initialized;
    std::call_once(initialized, ggml_cpu_init);
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return nullptr;
    const auto* found = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    return found != nullptr && found->vec_dot != nullptr ? found : nullptr;
}

}  // namespace

class GgmlLinear : public ov::op::Op {
public:
    OPENVINO_OP("GgmlLinear", "specchat");

    GgmlLinear() = default;

    GgmlLinear(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& w, int64_t type)
        : Op({x, w}),
          m_type(type) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const auto* tr = traits(m_type);
        NODE_VALIDATION_CHECK(this, tr != nullptr, "ggml has no CPU dot product for type ", m_type);
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8, "w must be u8 blocks");
        const auto& x = get_input_partial_shape(0);
        const auto& w = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, w.rank().is_static() && w.rank().get_length() == 2, "w must be [N, row_bytes]");
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
        return std::make_shared<GgmlLinear>(args.at(0), args.at(1), m_type);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_type", m_type);
        return true;
    }

    bool has_evaluate() const override {
        return true;
    }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto* tr = traits(m_type);
        if (tr == nullptr)
            return false;
        const auto* tq = ggml_get_type_traits_cpu(tr->vec_dot_type);
        const ov::Tensor& x = inputs[0];
        const ov::Tensor& w = inputs[1];
        const auto x_shape = x.get_shape();
        const int64_t k = static_cast<int64_t>(x_shape.back());
        const int64_t n = static_cast<int64_t>(w.get_shape()[0]);
        const size_t w_row = w.get_shape()[1];
        const int64_t m = k ? static_cast<int64_t>(x.get_size()) / k : 0;
        auto y_shape = x_shape;
        y_shape.back() = static_cast<size_t>(n);
        if (outputs[0].get_shape() != y_shape)
            outputs[0].set_shape(y_shape);

        // The activations in the vec_dot type, each row once (scratch kept per calling thread).
        const size_t x_row = ggml_row_size(tr->vec_dot_type, k);
        thread_local std::vector<uint8_t> quantized;
        quantized.resize(x_row * static_cast<size_t>(m));
        const float* xs = x.data<const float>();
        uint8_t* xq = quantized.data();
        ov::parallel_nt_static(m > 1 ? 0 : 1, [&](int thread, int threads) {
            int64_t start = 0, stop = 0;
            ov::splitter(m, threads, thread, start, stop);
            for (int64_t row = start; row < stop; ++row) {
                if (tq->from_float != nullptr)
                    tq->from_float(xs + row * k, xq + row * x_row, k);
                else  // (an f32 vec_dot type)
                    std::memcpy(xq + row * x_row, xs + row * k, x_row);
            }
        });

        const uint8_t* ws = w.data<const uint8_t>();
        float* ys = outputs[0].data<float>();
        const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        ov::parallel_nt_static(0, [&](int thread, int threads) {
            int64_t start = 0, stop = 0;
            ov::splitter(tasks, threads, thread, start, stop);
            const int64_t first = start * ROWS_PER_TASK, last = std::min(n, stop * ROWS_PER_TASK);
            for (int64_t out = first; out < last; ++out)
                for (int64_t row = 0; row < m; ++row)
                    tr->vec_dot(static_cast<int>(k), ys + row * n + out, 0, ws + out * w_row, 0, xq + row * x_row, 0, 1);
        });
        return true;
    }

private:
    int64_t m_type = 0;
};

}  // namespace specchat

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<specchat::GgmlLinear>>()}));
