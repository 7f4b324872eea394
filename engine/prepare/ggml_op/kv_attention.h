// KvAttention: a layer's attention over a KV cache the op keeps itself, so that a rollback is a
// shorter length and no state is copied (docs/design.md, "An attention of our own").
//
// Inputs: q, f32 [B, H, T, D]; k and v, f32 [B, Hkv, T, D]: the pass's T new entries of each row;
// caches, i64 [B]: the cache each row reads and writes (its id, any number a process chooses);
// pasts, i64 [B]: the entries of that cache the row keeps before this pass; and, where RoPE is
// left to the node (one node a layer where the plugin ran two more), its cos and sin, f32 [B, 1,
// T, D]: q and k are turned by them first (else they come turned). The pass writes its entries
// at [past, past + T) of its row's cache for this layer, dropping whatever the cache held from
// past on, and each query t attends causally to the entries [0, past + t]. Attribute layer: which
// of a cache's layers this node reads and writes; scale: what q . k is multiplied by before the
// softmax.
// Output: f32 [B, H, T, D].
//
// Each query row is computed alike whatever the pass's width and its place in the pass: its dot
// products in a fixed order of lanes over D, its softmax's sum over the entries in order. So a
// verify pass's rows are single steps' bit for bit.
#pragma once

#include <cstdint>

#include "openvino/op/op.hpp"

namespace specchat {

class KvAttention : public ov::op::Op {
public:
    OPENVINO_OP("KvAttention", "specchat");

    KvAttention() = default;

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool has_evaluate() const override {
        return true;
    }
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;

    int64_t m_layer = 0;
    float m_scale = 1.0f;
};

}  // namespace specchat
