"""gpu-form: a converted model lowered for the placement partition plans, in the form the GPU's
execution provider takes (docs/gpu.md, moepass/core/capabilities.py).

- `--target offload` (the CUDA plugin EP's expert offload): every MoE node in OFFLOAD_FORM, int4
  block 32 in the SM80 layout without zero points, gate and up keeping an affine type's codes
  through block-sum features (passes/lower/block_sums.py).
- `--target layers` (whole MoE layers on the in-tree CUDA EP): the MoE nodes of GPU layers in a form
  ONNX Runtime's CUDA QMoE kernel takes (capabilities.cuda_refusal: 4 or 8 bits, blocks of 32-128,
  row-major codes with weights_prepacked=0), the MoE nodes of CPU layers as they were, in their
  fast CPU form and float32.

Everything on the GPU computes in float16 (passes/float16.py): attention, norms, router, matrices,
the LM head and the KV cache, with a Cast where a value crosses to or from a CPU layer's node.

Where a node's experts change form they are packed anew from the GGUF file the model came from
(`GgufExperts`: the file's own blocks, so that no requantization stacks on another), else from the
model's own stored values (`StoredExperts`: an ONNX model fuse-moe made, or a GGUF that moved; the
error measured against those values). A node whose form holds as it is keeps its codes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from moepass.core import keys
from moepass.core.architectures import Architecture, HParams
from moepass.core.capabilities import CUDA_KERNELS, cuda_form_refusal, cuda_refusal
from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import GGUFModel
from moepass.core.ir_values import input_at, read_rows, tensor_dims, tensor_of
from moepass.core.moe_nodes import QMOE_SLOTS, MoeNode, NodeList, moe_nodes
from moepass.core.quants import OFFLOAD_FORM, BlockForm, ExpertForms, QuantType, expert_form, parse_form, quant_type
from moepass.passes.float16 import HALF, Float16Pass
from moepass.passes.lower.block_sums import measured_levels, narrow, widen
from moepass.passes.lower.experts import expert_tensors
from moepass.passes.weights import GgufRows, RowSource, StoredRows, WeightReport

TARGETS = ("layers", "offload")


class ExpertSources(Protocol):
    """Where a MoE node's experts are packed anew from: (gate and up rows, down rows, their GGUF
    types or None, and whether the rows are the GGUF's own blocks)."""

    def rows(self, moe: MoeNode) -> tuple[list[RowSource], list[RowSource], list[QuantType] | None, bool]: ...


@dataclasses.dataclass
class GgufExperts:
    """A layer's gate, up and down from the GGUF file the model was converted from (the layer of a
    node from its moepass.layer metadata)."""

    gguf: GGUFModel
    arch: Architecture
    hp: HParams

    def rows(self, moe: MoeNode) -> tuple[list[RowSource], list[RowSource], list[QuantType] | None, bool]:
        layer = moe.node.metadata_props.get(keys.LAYER)
        if layer is None:
            return StoredExperts().rows(moe)
        sources = [self.arch.tensor(self.gguf, r, int(layer), self.hp) for r in ("ffn_gate_exps", "ffn_up_exps")]
        down = self.arch.tensor(self.gguf, "ffn_down_exps", int(layer), self.hp)
        types = [quant_type(s.ggml_type, s.name, s.path) for s in (*sources, down)]
        if any(t.storage == "float" for t in types):  # float experts: from what the model stores
            return StoredExperts().rows(moe)
        rows: list[RowSource] = [GgufRows(s, t) for s, t in zip(sources, types)]
        return rows, [GgufRows(down, types[2])], types, True


class StoredExperts:
    """A node's experts from its own stored codes and scales (zero points included)."""

    def rows(self, moe: MoeNode) -> tuple[list[RowSource], list[RowSource], list[QuantType] | None, bool]:
        node = moe.node
        form = stored_form(moe)
        if node.attributes.get_int("weights_prepacked", 0) == 1:
            raise MoepassError(
                f"{moe.name}: its experts are in the SM80 layout; only the GGUF they came from re-forms them"
            )
        fc1, fc2 = ([input_at(node, i) for i in QMOE_SLOTS[p]] for p in ("fc1", "fc2"))
        if fc1[0] is None or fc2[0] is None:
            raise MoepassError(f"{moe.name}: no expert weights")
        hidden, ffn = moe.hidden, moe.ffn
        shapes = {"fc1": (moe.experts, ffn, hidden), "fc2": (moe.experts, hidden, ffn)}
        zero1 = None if fc1[3] is None else tensor_of(fc1[3])
        zero2 = None if fc2[3] is None else tensor_of(fc2[3])
        up_down = [
            StoredRows(
                f"{fc1[0].name}[{part}]", tensor_of(fc1[0]), tensor_of(fc1[1]), form, shapes["fc1"], part, 2, zero1
            )
            for part in (0, 1)
        ]
        down = StoredRows(
            fc2[0].name or "", tensor_of(fc2[0]), tensor_of(fc2[1]), form.plain, shapes["fc2"], 0, 1, zero2
        )
        return list(up_down), [down], None, False


def stored_form(moe: MoeNode) -> BlockForm:
    """The QMoE form a node stores its experts in (block-sum features' levels as recorded)."""
    attrs = moe.node.attributes
    plain = BlockForm(attrs.get_int("expert_weight_bits", 4), max(0, attrs.get_int("block_size", 0)))
    recorded = moe.form
    return recorded if recorded is not None and recorded.plain == plain else plain


def _types_of(moe: MoeNode) -> list[QuantType] | None:
    from gguf import GGMLQuantizationType as GT

    names = moe.node.metadata_props.get(keys.SOURCE_TYPES, "").split(",")
    try:
        return [quant_type(GT[n], moe.name) for n in names] if len(names) == 3 else None
    except (KeyError, MoepassError):
        return None


def gpu_forms(moe: MoeNode, target: str, types: list[QuantType] | None) -> ExpertForms | None:
    """The forms a GPU node takes, or None where the stored form holds as it is (its float16 scales
    and weights_prepacked aside)."""
    if moe.node.op_type != "QMoE":
        return None  # float experts: the MoE node computes them in float16 as they are
    current = stored_form(moe)
    prepacked = moe.node.attributes.get_int("weights_prepacked", 0) == 1
    ks = [moe.hidden, moe.ffn]
    if target == "offload":
        forms = expert_form(types, ks, "offload") if types else ExpertForms(OFFLOAD_FORM)
        same = current.plain == OFFLOAD_FORM and bool(current.sums) == forms.sums and prepacked
        return None if same else forms
    if _cuda_takes(moe):
        return None
    return expert_form(types, ks, "cuda") if types else ExpertForms(BlockForm(8, 32 if moe.hidden % 32 == 0 else 0))


def _cuda_takes(moe: MoeNode) -> bool:
    """Whether the CUDA QMoE kernel takes the node's form as it is stored (row-major codes, which
    this pass labels weights_prepacked=0; the activation type is made float16 anyway)."""
    node = moe.node
    missing = "weights_prepacked" not in node.attributes
    if missing:
        node.attributes["weights_prepacked"] = ir.AttrInt64("weights_prepacked", 0)
    try:
        return cuda_form_refusal(node) is None
    finally:
        if missing:
            node.attributes.pop("weights_prepacked")


class GpuFormPass(InPlacePass):
    """Lower a model for `target` with the MoE nodes `gpu_moe` on the GPU (offload: every node; its
    resident set is the offload EP's business). `experts` says where changed experts are packed
    from; `report` gets the new tensors' records, `rounded` what float16 rounded."""

    def __init__(
        self,
        target: str,
        gpu_moe: frozenset[str],
        experts: ExpertSources,
        report: WeightReport,
        workers: int | None = None,
        exact: bool = False,
    ):
        super().__init__()
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
        self.target, self.gpu_moe, self.experts, self.report = target, gpu_moe, experts, report
        self.workers, self.exact = workers, exact
        self.reformed: dict[str, str] = {}  # node -> the form it takes now, where it changed
        self.rounded: list = []
        self.cpu_refused: dict[str, str] = {}  # non-MoE node -> why no CUDA kernel takes it (it stays on the CPU)

    def on_gpu(self, moe: MoeNode) -> bool:
        return self.target == "offload" or moe.name in self.gpu_moe

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        nodes = moe_nodes(graph)
        unknown = sorted(self.gpu_moe - {m.name for m in nodes})
        if unknown:
            raise MoepassError(f"the plan names MoE node(s) the model does not have: {', '.join(unknown)}")
        for moe in nodes:
            if self.on_gpu(moe):
                forms = gpu_forms(moe, self.target, _types_of(moe))
                if forms is not None:
                    self._reform(graph, moe, forms)
        cpu = {m.node for m in moe_nodes(graph) if not self.on_gpu(m)}
        # what no CUDA kernel takes stays on the CPU (and float32): MoEGroupRouter, say
        refused = {n for n in graph if n not in cpu and _no_kernel(n)}
        self.cpu_refused = {n.name or n.op_type: cuda_refusal(n, HALF) or "" for n in refused}
        half = Float16Pass(lambda n: n in cpu or n in refused)
        half(model)
        self.rounded = half.rounded
        for moe in moe_nodes(graph):  # row-major codes said so: the CUDA EP reads -1 as its own layout
            if moe.node.op_type == "QMoE" and "weights_prepacked" not in moe.node.attributes:
                moe.node.attributes["weights_prepacked"] = ir.AttrInt64("weights_prepacked", 0)
        RemoveUnusedNodesPass()(model)
        return PassResult(model, modified=True)

    def _reform(self, graph: ir.Graph, moe: MoeNode, forms: ExpertForms) -> None:
        """The node rebuilt in `forms`: its experts packed anew, its input widened by block-sum
        features where fc1 keeps affine codes (and no longer where it does not), its output narrowed."""
        node, hidden = moe.node, moe.hidden
        stored = stored_form(moe)
        if forms.node == stored.plain and forms.sums == bool(stored.sums):
            # the same codes (and features' levels), another layout or scale type: from what it stores
            fc1_rows, fc2_rows, _, _ = StoredExperts().rows(moe)
            fc1_form = stored
        else:
            fc1_rows, fc2_rows, _, own_blocks = self.experts.rows(moe)
            if not own_blocks:  # a model's stored values hold no affine codes: no block-sum features
                forms = ExpertForms(forms.node)
            levels = 0
            if forms.sums:
                sources = [(r.src, r.qt) for r in fc1_rows if isinstance(r, GgufRows)]
                levels = measured_levels(sources, forms.node, half_scales=True, exact=self.exact)
            fc1_form = forms.fc1(levels)
        codes = input_at(node, QMOE_SLOTS["fc1"][0])
        prefix = ((codes.name if codes is not None else None) or f"{moe.name}.fc1").rsplit(".fc1", 1)[0]
        hidden_in, final = _unwidened_input(node), _narrowed_output(node)
        for slot in (*QMOE_SLOTS["fc1"][:2], *QMOE_SLOTS["fc2"][:2], QMOE_SLOTS["fc1"][3], QMOE_SLOTS["fc2"][3]):
            old = input_at(node, slot)
            if old is not None and old.is_initializer() and len(old.uses()) == 1:
                node.replace_input_with(slot, None)
                graph.initializers.pop(old.name or "")
        tensors = expert_tensors(
            moe.name,
            prefix,
            fc1_rows,
            fc2_rows,
            fc1_form,
            self.report,
            prepack=self.target == "offload",
            scale_dtype=HALF,
            workers=self.workers,
        )
        values = {}
        for group, slots in ((tensors.fc1, QMOE_SLOTS["fc1"]), (tensors.fc2, QMOE_SLOTS["fc2"])):
            for tensor, slot in ((group.codes, slots[0]), (group.scales, slots[1])):
                value = ir.Value(
                    name=tensor.name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor
                )
                graph.register_initializer(value)
                values[slot] = value
        bias = input_at(node, QMOE_SLOTS["fc2"][2])
        if bias is not None:
            bias = self._padded_bias(graph, bias, hidden, tensors.pad)
        ops = NodeList()
        x = widen(ops.op, _Consts(graph), hidden_in, hidden, fc1_form, moe.name) if tensors.pad else hidden_in
        inputs = list(node.inputs) + [None] * max(0, 15 - len(node.inputs))
        inputs[0] = x
        for slot, value in values.items():
            inputs[slot] = value
        inputs[QMOE_SLOTS["fc1"][3]] = inputs[QMOE_SLOTS["fc2"][3]] = None
        inputs[QMOE_SLOTS["fc2"][2]] = bias
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = {a.name: a for a in node.attributes.values()}
        attributes["expert_weight_bits"] = ir.AttrInt64("expert_weight_bits", fc1_form.bits)
        attributes["weights_prepacked"] = ir.AttrInt64("weights_prepacked", int(tensors.prepacked))
        if fc1_form.block_size:
            attributes["block_size"] = ir.AttrInt64("block_size", fc1_form.block_size)
        else:
            attributes.pop("block_size", None)
        old_out = node.outputs[0]
        name, old_out.name = old_out.name, f"{old_out.name}.replaced"
        rebuilt = ir.Node(
            "com.microsoft", "QMoE", inputs, attributes=list(attributes.values()), name=moe.name, num_outputs=1
        )
        rebuilt.metadata_props.update(node.metadata_props)
        rebuilt.metadata_props[keys.EXPERT_FORM] = str(fc1_form)
        out = rebuilt.outputs[0]
        out.name = name
        if old_out.dtype is not None:
            out.dtype = old_out.dtype
        out.shape = ir.Shape(["tokens", hidden + tensors.pad])
        ops.nodes.append(rebuilt)
        result = narrow(ops.op, _Consts(graph), out, hidden, moe.name) if tensors.pad else out
        if final is not old_out:  # the old Slice's output name and type go to the new one
            slice_name, final.name = final.name, f"{final.name}.replaced"
            result.name = slice_name
        if final.dtype is not None:
            result.dtype = final.dtype
        result.shape = final.shape
        graph.insert_before(node, ops.nodes)
        if final.is_graph_output():
            raise MoepassError(f"{moe.name}: its output is a graph output; partition cannot rebuild it")
        final.replace_all_uses_with(result)
        old_slice = final.producer() if final is not old_out else None
        if old_slice is not None:
            graph.remove(old_slice, safe=True)
        graph.remove(node, safe=True)  # the old widening, now unread, goes with RemoveUnusedNodesPass
        self.reformed[moe.name] = str(fc1_form)

    @staticmethod
    def _padded_bias(graph: ir.Graph, bias: ir.Value, hidden: int, pad: int) -> ir.Value:
        """fc2's bias [E, hidden + pad]: the features' zero rows after the model's own."""
        source = tensor_of(bias)
        if tensor_dims(source)[1] == hidden + pad:
            return bias
        values = read_rows(source)[:, :hidden].astype(source.dtype.numpy())
        padded = np.concatenate([values, np.zeros((len(values), pad), values.dtype)], axis=1)
        name = f"{bias.name}.padded"
        value = ir.Value(
            name=name, type=bias.type, shape=ir.Shape(padded.shape), const_value=ir.Tensor(padded, name=name)
        )
        graph.register_initializer(value)
        return value


def _no_kernel(node: ir.Node) -> bool:
    """Whether the CUDA EP registers no kernel at all for the node's op (MoEGroupRouter)."""
    return (node.domain or "", node.op_type) in CUDA_KERNELS and CUDA_KERNELS[(node.domain or "", node.op_type)] is None


def _unwidened_input(node: ir.Node) -> ir.Value:
    """The node's hidden state before any block-sum features were concatenated to it."""
    x = input_at(node, 0)
    if x is None:
        raise MoepassError(f"{node.name}: no input")
    producer = x.producer()
    if producer is not None and producer.op_type == "Concat" and (producer.name or "").endswith(".widen"):
        first = producer.inputs[0]
        if first is not None:
            return first
    return x


def _narrowed_output(node: ir.Node) -> ir.Value:
    """What the rest of the model reads of the node: the Slice of a widened output, or the output."""
    out = node.outputs[0]
    uses = list(out.uses())
    if len(uses) == 1 and uses[0].node.op_type == "Slice" and (uses[0].node.name or "").endswith(".narrow"):
        return uses[0].node.outputs[0]
    return out


class _Consts:
    """block_sums' MakeConst for a graph: a constant initializer shared by name."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph

    def __call__(self, name: str, array: np.ndarray) -> ir.Value:
        existing = self.graph.initializers.get(name)
        if existing is not None:
            return existing
        value = ir.Value(
            name=name,
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
            shape=ir.Shape(array.shape),
            const_value=ir.Tensor(array, name=name),
        )
        self.graph.register_initializer(value)
        return value


__all__ = ["GgufExperts", "GpuFormPass", "StoredExperts", "gpu_forms", "parse_form"]
