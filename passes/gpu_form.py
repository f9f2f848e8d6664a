"""gpu-form: a converted model lowered for the placement partition plans, in the form the GPU's
execution provider takes (docs/gpu.md, moepass/core/capabilities.py).

- `--target offload` (the CUDA plugin EP's expert offload): every MoE node in OFFLOAD_FORM, int4
  block 32 in the SM80 layout without zero points, gate and up keeping an affine type's codes
  through block-sum features (passes/lower/block_sums.py).
- `--target layers` (whole MoE layers on the in-tree CUDA EP): the MoE nodes of GPU layers in a form
  ONNX Runtime's CUDA QMoE kernel takes (capabilities.cuda_refusal: 4 or 8 bits, blocks of 32-128,
  row-major codes with weights_prepacked=0), the MoE nodes of CPU layers as they were, in their
  fast CPU form and float32. A moepass::MoEPacked node (moepass's own CPU kernels) on the GPU takes
  the CUDA QMoE form packed from its blobs (gpt-oss's biases and SwiGLU with it): what a qmoe
  conversion's layer gets, and what the CPU EP runs too where CUDA turns out missing.

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
from gguf import GGMLQuantizationType
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from moepass.core import keys, row_groups
from moepass.core.architectures import Architecture, HParams
from moepass.core.capabilities import CUDA_KERNELS, cuda_form_refusal, cuda_refusal
from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import GGUFModel
from moepass.core.ir_values import input_at, read_rows, tensor_dims, tensor_of
from moepass.core.moe_nodes import (
    NATIVE_DOMAIN,
    PACKED_ROUTER_WEIGHTS,
    PACKED_SLOTS,
    QMOE_SLOTS,
    ROUTER_WEIGHTS,
    Activation,
    ExpertCodes,
    Experts,
    MoeNode,
    NodeList,
    Router,
    is_native,
    moe_node,
    moe_nodes,
)
from moepass.core.quants import (
    OFFLOAD_FORM,
    BlockForm,
    ExpertForms,
    QuantType,
    expert_form,
    matrix_form,
    parse_form,
    quant_type,
    scales_in_float16,
)
from moepass.passes.activations import QuantizeActivationsPass
from moepass.passes.float16 import FLOAT, HALF, Float16Pass
from moepass.passes.lower.block_sums import measured_levels, narrow, widen
from moepass.passes.lower.experts import expert_tensors
from moepass.passes.weights.packing import PackedGroup, PackOptions
from moepass.passes.weights.report import WeightReport
from moepass.passes.weights.sources import GgufRows, RowSource, StoredRows

TARGETS = ("layers", "offload")


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """A MoE node's experts as RowSources to pack anew: gate and up, down, their GGUF types (None
    where unknown), whether they are the GGUF's own blocks, and where they come from, in words
    (plan.json's lowering.reformed)."""

    fc1: list[RowSource]
    fc2: list[RowSource]
    types: list[QuantType] | None
    own_blocks: bool
    origin: str


class ExpertSources(Protocol):
    """Where a MoE node's experts are packed anew from."""

    def rows(self, moe: MoeNode) -> ExpertRows: ...


@dataclasses.dataclass
class GgufExperts:
    """A layer's gate, up and down from the GGUF file the model was converted from (the layer of a
    node from its moepass.layer metadata)."""

    gguf: GGUFModel
    arch: Architecture
    hp: HParams

    def rows(self, moe: MoeNode) -> ExpertRows:
        layer = moe.node.metadata_props.get(keys.LAYER)
        if layer is None:
            return StoredExperts().rows(moe)
        sources = [self.arch.tensor(self.gguf, r, int(layer), self.hp) for r in ("ffn_gate_exps", "ffn_up_exps")]
        down = self.arch.tensor(self.gguf, "ffn_down_exps", int(layer), self.hp)
        types = [quant_type(s.ggml_type, s.name, s.path) for s in (*sources, down)]
        if any(t.storage == "float" for t in types):  # float experts: from what the model stores
            return StoredExperts().rows(moe)
        rows: list[RowSource] = [GgufRows(s, t) for s, t in zip(sources, types)]
        return ExpertRows(
            rows, [GgufRows(down, types[2])], types, True, f"packed from {self.gguf.path.name}'s own blocks"
        )


class StoredExperts:
    """A node's experts from its own stored codes and scales (zero points included)."""

    def rows(self, moe: MoeNode) -> ExpertRows:
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
        return ExpertRows(list(up_down), [down], None, False, "requantized from the model's own values")


@dataclasses.dataclass(frozen=True)
class BlobTensor:
    """A MoEPacked node's blob (or a MatMulPacked node's matrix) as a GGUF tensor (what GgufRows
    reads): the file's own blocks, [E, rows, row bytes] ([rows, row bytes]), of one GGML type."""

    name: str
    tensor: ir.TensorProtocol
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    path: str = "the model"
    grouped: bool = False  # each expert's rows in row groups (a moepass::MoEPacked blob): read as GGUF rows

    @property
    def row_bytes(self) -> int:
        return tensor_dims(self.tensor)[-1]

    @property
    def nbytes(self) -> int:
        return int(np.prod(tensor_dims(self.tensor)))

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    def read_rows(self, first: int = 0, count: int | None = None) -> np.ndarray:
        dims = tensor_dims(self.tensor)
        rows, row_bytes = dims[-2:]
        count = int(np.prod(dims[:-1])) - first if count is None else count
        # read whole experts of a stack [E, rows, row bytes], whole row groups of a matrix [rows, row bytes]
        unit = rows if len(dims) == 3 else row_groups.ROW_GROUP
        start, stop = first // unit, -(-(first + count) // unit)
        chunk = read_rows(self.tensor, start, stop - start) if len(dims) == 3 else self._matrix_rows(start, stop)
        if self.grouped:
            shape = (-1, rows, row_bytes) if len(dims) == 3 else (-1, row_bytes)
            chunk = row_groups.ungroup(chunk.reshape(shape), quant_type(self.ggml_type, self.name))
        chunk = chunk.reshape(-1, row_bytes)
        return chunk[first - start * unit : first - start * unit + count]

    def _matrix_rows(self, start: int, stop: int) -> np.ndarray:
        """Row groups [start, stop) of a matrix (its rows after the last whole group with the last)."""
        rows = tensor_dims(self.tensor)[0]
        first = start * row_groups.ROW_GROUP
        return read_rows(self.tensor, first, min(stop * row_groups.ROW_GROUP, rows) - first)


def packed_rows(moe: MoeNode) -> ExpertRows:
    """A MoEPacked node's gate, up and down as RowSources over its own blobs (the GGUF's blocks)."""
    node = moe.node
    rows: list[RowSource] = []
    types = []
    for role in ("gate", "up", "down"):
        value = input_at(node, PACKED_SLOTS[role])
        if value is None:
            raise MoepassError(f"{moe.name}: MoEPacked without {role} weights")
        ggml_type = GGMLQuantizationType(node.attributes.get_int(f"{role}_type", node.attributes.get_int("gate_type")))
        qt = quant_type(ggml_type, value.name or role)
        tensor = tensor_of(value)
        e, n, _ = tensor_dims(tensor)
        k = qt.row_elements(tensor_dims(tensor)[-1])
        blob = BlobTensor(value.name or role, tensor, ggml_type, (e, n, k), grouped=is_native(node))
        rows.append(GgufRows(blob, qt))  # type: ignore[arg-type]
        types.append(qt)
    return ExpertRows(
        rows[:2], rows[2:], types, True, "packed from the model's MoEPacked blobs (the GGUF's own blocks)"
    )


def _native_biases(graph: ir.Graph, moe: MoeNode) -> list[ir.Value | None]:
    """A native node's gate, up and down biases (inputs 6-8) as QMoE's fc1 bias (gate and up
    interleaved, as fc1's rows are) and fc2 bias, new initializers; None where it has none."""
    node = moe.node
    slots = [input_at(node, PACKED_ROUTER_WEIGHTS + 1 + i) for i in range(3)]
    if any(value is None for value in slots):
        return [None, None]
    gate, up, down = (read_rows(tensor_of(value)).astype(np.float32) for value in slots if value is not None)
    fc1 = np.stack([gate, up], axis=-1).reshape(len(gate), -1)
    biases: list[ir.Value | None] = []
    for role, values in (("fc1", fc1), ("fc2", down)):
        name = f"{moe.name.removesuffix('.moe')}.ffn_experts.{role}_bias"
        value = ir.Value(name=name, shape=ir.Shape(values.shape), const_value=ir.Tensor(values, name=name))
        value.type = ir.TensorType(ir.DataType.FLOAT)
        graph.register_initializer(value)
        biases.append(value)
    return biases


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
    if moe.node.op_type == "MoE":
        return None  # float experts: the MoE node computes them in float16 as they are
    if is_native(moe.node) and types:  # moepass's CPU op: QMoE's GPU form, packed from its blobs
        return expert_form(types, [moe.hidden, moe.ffn], "offload" if target == "offload" else "cuda")
    if moe.node.op_type == "MoEPacked":  # the GGUF's own blocks: as they are for CUDA, else the offload form
        return expert_form(types, [moe.hidden, moe.ffn], "offload") if target == "offload" and types else None
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
        self.packed_from: dict[str, str] = {}  # MoE node -> where its changed experts were packed from

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
            elif is_native(moe.node):
                continue  # moepass's own CPU kernels run it as it is
            elif moe.node.op_type == "MoEPacked":  # no CPU kernel: a CPU layer takes the conversion's CPU form
                types = packed_rows(moe).types
                assert types is not None  # a MoEPacked node's attributes type every blob
                self._reform(graph, moe, expert_form(types, [moe.hidden, moe.ffn]), cpu=True)
        for node in [n for n in graph if n.domain == NATIVE_DOMAIN and n.op_type == "MatMulPacked"]:
            self._dense_to_nbits(graph, node)  # every non-MoE node runs on the GPU
        for node in [n for n in graph if n.domain == NATIVE_DOMAIN and n.op_type == "GatherPacked"]:
            self._table_to_block_quantized(graph, node)
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
        mode = model.metadata_props.get(keys.ACTIVATIONS)
        if mode is not None:  # the nodes made anew multiply as the conversion's did (accuracy_level)
            QuantizeActivationsPass(mode)(model)
        RemoveUnusedNodesPass()(model)
        return PassResult(model, modified=True)

    def _reform(self, graph: ir.Graph, moe: MoeNode, forms: ExpertForms, cpu: bool = False) -> None:
        """The node rebuilt as a QMoE node in `forms`: its experts packed anew, its input widened by
        block-sum features where fc1 keeps affine codes (and no longer where it does not), its output
        narrowed. `cpu`: a CPU layer's node (a MoEPacked one, which no CPU kernel runs), in its CPU
        form: the conversion's scale types, row-major codes."""
        node, hidden = moe.node, moe.hidden
        rows, types, fc1_form = self._new_experts(moe, forms, cpu)
        scale_dtype = (
            HALF if not cpu or not types or fc1_form.sums or scales_in_float16(types, fc1_form.plain) else FLOAT
        )
        prefix = f"{moe.name.removesuffix('.moe')}.ffn_experts"
        hidden_in, final = _unwidened_input(node), _narrowed_output(node)
        router = input_at(node, 1)
        if router is None:
            raise MoepassError(f"{moe.name}: no router logits")
        weights_slot = PACKED_ROUTER_WEIGHTS if node.op_type == "MoEPacked" else ROUTER_WEIGHTS
        router_weights = input_at(node, weights_slot)
        if node.op_type == "QMoE":
            biases = [input_at(node, QMOE_SLOTS[p][2]) for p in ("fc1", "fc2")]
        else:  # a native node's own (gpt-oss), read before its old experts go
            biases = _native_biases(graph, moe) if is_native(node) else [None, None]
        activation = _activation_of(node)
        _drop_old_experts(graph, moe)
        packing = PackOptions(
            scale_dtype=scale_dtype, prepack=self.target == "offload" and not cpu, workers=self.workers
        )
        tensors = expert_tensors(moe.name, prefix, rows.fc1, rows.fc2, fc1_form, self.report, packing)
        values = [
            _initializer(graph, tensor)
            for tensor in (tensors.fc1.codes, tensors.fc1.scales, tensors.fc2.codes, tensors.fc2.scales)
        ]
        fc2_bias = self._padded_bias(graph, biases[1], hidden, tensors.pad) if biases[1] is not None else None
        ops = NodeList()
        consts = _Consts(graph)
        x = widen(ops.op, consts, hidden_in, hidden, fc1_form, moe.name) if tensors.pad else hidden_in
        old_out = node.outputs[0]
        name, old_out.name = old_out.name, f"{old_out.name}.replaced"
        out = moe_node(
            ops.op,
            moe.name,
            x,
            Router(router, moe.top_k, moe.normalize, router_weights),
            Experts(values[0], values[1], bias=biases[0]),
            Experts(values[2], values[3], bias=fc2_bias),
            activation=activation,
            codes=ExpertCodes(fc1_form.bits, fc1_form.block_size, tensors.prepacked),
        )
        rebuilt = ops.nodes[-1]
        rebuilt.metadata_props.update(node.metadata_props)
        rebuilt.metadata_props[keys.EXPERT_FORM] = str(fc1_form)
        out.name = name
        if old_out.dtype is not None:
            out.dtype = old_out.dtype
        out.shape = ir.Shape(["tokens", hidden + tensors.pad])
        result = narrow(ops.op, consts, out, hidden, moe.name) if tensors.pad else out
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

    def _new_experts(
        self, moe: MoeNode, forms: ExpertForms, cpu: bool
    ) -> tuple[ExpertRows, list[QuantType] | None, BlockForm]:
        """Where a node's experts are packed anew from (recorded in `packed_from`), their GGUF types,
        and fc1's form: the stored one where the node keeps its codes (another layout or scale type),
        else `forms` with the block-sum features' levels measured on the file's own blocks."""
        node = moe.node
        stored = stored_form(moe)
        types = _types_of(moe)
        # the same codes (and features' levels) in another layout or scale type: from what it stores
        same_codes = node.op_type != "MoEPacked" and forms.node == stored.plain and forms.sums == bool(stored.sums)
        if node.op_type == "MoEPacked":  # the GGUF's own blocks are in the model: no file needed
            rows = packed_rows(moe)
            types = rows.types
        elif same_codes:
            rows = dataclasses.replace(StoredExperts().rows(moe), origin="its own codes, laid out anew")
        else:
            rows = self.experts.rows(moe)
        self.packed_from[moe.name] = rows.origin
        if same_codes:
            return rows, types, stored
        if not rows.own_blocks:  # a model's stored values hold no affine codes: no block-sum features
            forms = ExpertForms(forms.node)
        half = not cpu or not types or forms.sums or scales_in_float16(types, forms.node)
        levels = 0
        if forms.sums:
            sources = [(r.src, r.qt) for r in rows.fc1 if isinstance(r, GgufRows)]
            levels = measured_levels(sources, forms.node, half_scales=half, exact=self.exact)
        return rows, types, forms.fc1(levels)

    def _dense_to_nbits(self, graph: ir.Graph, node: ir.Node) -> None:
        """A moepass::MatMulPacked node (a matrix of a native conversion, which only the CPU runs) as
        the com.microsoft::MatMulNBits convert writes for its type (quants.matrix_form: the exact form
        where it has one, with the product of the input's block sums and the block offsets added for
        an affine type's, else 8 bits), packed from the blob's rows out of their groups."""
        x = input_at(node, 0)
        if x is None:
            raise MoepassError(f"{node.name}: MatMulPacked without its input")
        qt, blob = _blob_matrix(node, input_at(node, 1), grouped=True)
        (n, k), name = blob.shape, blob.name
        form = matrix_form(qt, k)
        assert form is not None  # a type the kernels take is a block type
        packing = PackOptions(blob_layout=True, scale_dtype=HALF, workers=self.workers)
        group = PackedGroup([GgufRows(blob, qt)], form, name, self.report, packing)  # type: ignore[arg-type]
        inputs: list[ir.Value | None] = [x, _initializer(graph, group.codes), _initializer(graph, group.scales)]
        old = node.outputs[0]
        bias_add = _bias_add(old, n)
        if bias_add is not None:  # the matrix's bias taken into the product, as convert's MatMulNBits has it
            inputs += [None, None, bias_add.inputs[1]]
            old = bias_add.outputs[0]
        attributes = {"K": k, "N": n, "bits": form.bits, "block_size": form.block_size}
        nbits = ir.node("MatMulNBits", inputs, attributes=attributes, domain="com.microsoft", name=node.name)
        made, result = [nbits], nbits.outputs[0]
        if group.offsets is not None:  # y + block_sums(x) @ offsets, as convert's linear computes it
            block = form.block_size
            ones = np.kron(np.eye(k // block, dtype=np.float32), np.ones((block, 1), np.float32))
            sums = ir.node("MatMul", [x, _constant(graph, f"const.block_sums.{k}.{block}", ones)], name=f"{name}.sums")
            shifts = ir.node("MatMul", [sums.outputs[0], _initializer(graph, group.offsets)], name=f"{name}.offsets")
            add = ir.node("Add", [result, shifts.outputs[0]], name=f"{name}.with_offsets")
            made, result = [nbits, sums, shifts, add], add.outputs[0]
        _replace(graph, [node] if bias_add is None else [node, bias_add], made, old, result)

    def _table_to_block_quantized(self, graph: ir.Graph, node: ir.Node) -> None:
        """A moepass::GatherPacked node (a native conversion's token embedding) as the
        com.microsoft::GatherBlockQuantized convert writes for its type (quants.matrix_form without
        block offsets), packed from the table's blocks."""
        ids = input_at(node, 1)
        if ids is None:
            raise MoepassError(f"{node.name}: GatherPacked without its indices")
        qt, blob = _blob_matrix(node, input_at(node, 0), grouped=False)
        form = matrix_form(qt, blob.shape[1], offsets=False)
        assert form is not None  # a type the kernels take is a block type
        narrow = qt.keeps_codes(form) and scales_in_float16([qt], form)  # as convert stores a table's scales
        packing = PackOptions(scale_dtype=HALF if narrow else FLOAT, workers=self.workers)
        group = PackedGroup([GgufRows(blob, qt)], form, blob.name, self.report, packing)  # type: ignore[arg-type]
        attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": form.block_size, "bits": form.bits}
        inputs = [_initializer(graph, group.codes), ids, _initializer(graph, group.scales)]
        gather = ir.node("GatherBlockQuantized", inputs, attributes=attributes, domain="com.microsoft", name=node.name)
        _replace(graph, [node], [gather], node.outputs[0], gather.outputs[0])

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


def _blob_matrix(node: ir.Node, value: ir.Value | None, grouped: bool) -> tuple[QuantType, BlobTensor]:
    """The blocks [N, row bytes] of `packed_type` a moepass::MatMulPacked or GatherPacked node reads
    (`grouped`: in row groups), as the GGUF matrix [N, K] they hold, and its type."""
    if value is None:
        raise MoepassError(f"{node.name}: {node.op_type} without its blocks")
    ggml_type = GGMLQuantizationType(node.attributes.get_int("packed_type"))
    name = (value.name or node.name or node.op_type).removesuffix(".blocks")
    qt = quant_type(ggml_type, name)
    tensor = tensor_of(value)
    n, row_bytes = tensor_dims(tensor)
    return qt, BlobTensor(name, tensor, ggml_type, (n, qt.row_elements(row_bytes)), grouped=grouped)


def _replace(graph: ir.Graph, nodes: list[ir.Node], made: list[ir.Node], old: ir.Value, result: ir.Value) -> None:
    """`made` (ending in `result`) in place of `nodes` (the first the op; after it, the bias Add whose
    output is `old`): `result` takes over `old`'s name, type, shape and every use."""
    result.name, old.name = old.name, f"{old.name}.replaced"
    result.type, result.shape = old.type, old.shape
    graph.insert_before(nodes[0], made)
    old.replace_all_uses_with(result, replace_graph_outputs=True)
    for gone in reversed(nodes):  # the readers first: a node is removed once nothing reads it
        graph.remove(gone, safe=True)


def _bias_add(y: ir.Value, n: int) -> ir.Node | None:
    """The Add of a constant bias [n] that alone reads a matrix product's output y (the lowering's
    `linear` adds a native matrix's bias so), None where there is none."""
    uses = list(y.uses())
    if len(uses) != 1 or y.is_graph_output():
        return None
    add = uses[0].node
    bias = add.inputs[1] if len(add.inputs) == 2 and add.inputs[0] is y else None
    if add.op_type != "Add" or add.domain != "" or bias is None or not bias.is_initializer():
        return None
    return add if bias.shape is not None and tuple(bias.shape) == (n,) else None


def _constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """An initializer holding `array`, shared by every node that asks for the same name."""
    if name in graph.initializers:
        return graph.initializers[name]
    return _initializer(graph, ir.Tensor(array, name=name))


def _initializer(graph: ir.Graph, tensor: ir.TensorProtocol) -> ir.Value:
    """A tensor as a new initializer of the graph."""
    value = ir.Value(
        name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor_dims(tensor)), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def _no_kernel(node: ir.Node) -> bool:
    """Whether the CUDA EP registers no kernel at all for the node's op (MoEGroupRouter)."""
    return (node.domain or "", node.op_type) in CUDA_KERNELS and CUDA_KERNELS[(node.domain or "", node.op_type)] is None


def _activation_of(node: ir.Node) -> Activation:
    """The SwiGLU a MoE node computes, from its attributes."""
    attrs = node.attributes
    return Activation(
        attrs.get_float("activation_alpha", 1.0),
        attrs.get_float("activation_beta", 0.0),
        attrs.get_float("swiglu_limit") if "swiglu_limit" in attrs else None,
    )


def _drop_old_experts(graph: ir.Graph, moe: MoeNode) -> None:
    """The node's inputs cut; its old experts' initializers that nothing else reads go, so that the new
    group takes their names."""
    node = moe.node
    for value in list(node.inputs)[2:]:
        if value is not None and value.is_initializer() and value in moe.expert_values and len(value.uses()) == 1:
            graph.initializers.pop(value.name or "")
    for slot in range(len(node.inputs)):
        node.replace_input_with(slot, None)


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
