"""What a converted model stores, read back independently of moepass's writer: every QMoE and
MatMulNBits weight and a quantized token embedding table (GatherBlockQuantized) unpacked into
float32 values under its GGUF tensor's name (experts [E, N, K], matrices [N, K]), block offsets
and float16 scales (stored so, or widened by a Cast) and block-sum features' corrections included."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from moepass.core.quants import BlockForm, parse_form, unpack_values


def stored_matrices(model_dir: Path) -> Iterator[tuple[np.ndarray, str]]:
    """(values, GGUF tensor name) of every quantized weight of the saved model in `model_dir`."""
    model_dir = Path(model_dir)
    model = onnx.load(model_dir / "model.onnx")
    init = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(model_dir)) for t in model.graph.initializer}
    init |= {n.output[0]: init[n.input[0]] for n in model.graph.node  # float16 scales, widened as the session loads
             if n.op_type == "Cast" and n.input[0] in init}
    offsets = {n.name.removesuffix(".offsets"): init[n.input[1]] for n in model.graph.node
               if n.op_type == "MatMul" and n.name.endswith(".offsets")}
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "QMoE":
            form = BlockForm(attrs["expert_weight_bits"], attrs.get("block_size", 0))
            layer = node.name.split(".")[1]
            recorded = parse_form({p.key: p.value for p in node.metadata_props}.get("moepass.expert_form", ""))
            fc1 = unpack_values(init[node.input[2]], init[node.input[3]], form)
            fc2 = unpack_values(init[node.input[5]], init[node.input[6]], form)
            if recorded is not None and recorded.sums:
                fc1, fc2 = with_block_sums(fc1, recorded), fc2[:, : recorded.unwidened(fc2.shape[1])]
            yield fc1[:, 0::2], f"blk.{layer}.ffn_gate_exps.weight"
            yield fc1[:, 1::2], f"blk.{layer}.ffn_up_exps.weight"
            yield fc2, f"blk.{layer}.ffn_down_exps.weight"
        elif node.op_type == "MatMulNBits":
            form = BlockForm(attrs["bits"], attrs["block_size"], node.name in offsets)
            blob = init[node.input[1]]
            shift = offsets[node.name].T if node.name in offsets else None
            yield (unpack_values(blob.reshape(blob.shape[0], -1), init[node.input[2]], form, offsets=shift),
                   node.input[1].removesuffix(".q"))
        elif node.op_type == "GatherBlockQuantized":  # codes laid out as QMoE's rows, [vocab, hidden]
            yield (unpack_values(init[node.input[0]], init[node.input[2]], BlockForm(attrs["bits"], attrs["block_size"])),
                   node.input[0].removesuffix(".q"))


def with_block_sums(values: np.ndarray, form: BlockForm) -> np.ndarray:
    """The weights a widened fc1 applies to the model's K inputs, from its values [..., width]: the
    first K columns, plus on every element of block b the correction columns of b (one per level),
    which multiply the block's input sum (passes/lower/block_sums.py)."""
    k = form.unwidened(values.shape[-1])
    stride, blocks = form.feature_stride(k), k // form.block_size
    corrections = sum(values[..., k + level * stride: k + level * stride + blocks] for level in range(form.sums))
    return values[..., :k] + np.repeat(corrections, form.block_size, axis=-1)
