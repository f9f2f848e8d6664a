"""GraphBuilder: the onnx-ir tape a recipe writes the decoder on, with the GGUF model's weights as
lazy initializers and the building blocks every layer uses (linear, RMSNorm, embedding).

Weights are lazy (`passes/weights/`): nothing is read from the GGUF file until the model is
saved, and then chunk by chunk, so memory does not grow with the size of the model. Each weight's
conversion (source type, target form, measured error) is recorded in a `WeightReport`. The layer
modules (attention, routing, ffn) are functions of a GraphBuilder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir import tape as ir_tape

from moepass.core import row_groups
from moepass.core.architectures import Architecture
from moepass.core.errors import MoepassError
from moepass.core.gguf_reader import GGUFModel, SourceTensor
from moepass.core.moe_nodes import NATIVE_DOMAIN
from moepass.core.quants import BlockForm, QuantType, dequantize, matrix_form, quant_type, scales_in_float16
from moepass.passes.weights.packing import PackedGroup, PackOptions, float_expert_stack, float_tensor
from moepass.passes.weights.report import WeightRecord, WeightReport
from moepass.passes.weights.sources import GgufRows
from moepass.passes.weights.streaming import StreamedTensor, row_chunks


@dataclasses.dataclass(frozen=True)
class LowerOptions:
    """What the user chose. `float_experts`: keep F32/F16/BF16 experts as float (com.microsoft::MoE)
    or quantize them into QMoE int8 / int4. `expert_format`: "auto": every matrix of a type
    moepass.cpu_ops has a kernel for over its own blocks (moepass::MoEPacked, MatMulPacked: a layer
    whose gate, up and down all have one), the rest as "qmoe" (the caller has checked that the kernels
    run here: moepass.pipeline.conversion.expert_format_here); "qmoe": ONNX Runtime's QMoE and
    MatMulNBits (see moepass.core.quants.expert_form), or forced "int4" / "int8" for quantized
    experts; "native": moepass's kernels for every layer, refused where a type has none. "offload":
    what ONNX Runtime's expert offload requires: int4 block 32 experts prepacked in the SM80 layout
    (weights_prepacked=1) and a float16 graph. "packed": the GGUF's own expert blocks in
    com.microsoft::MoEPacked nodes (ONNX Runtime 1.32 runs them on CUDA only) and a float16 graph.
    `exact`: keep every tensor whose blocks move bit-exactly in its exact form, even where a
    requantized one is faster (Q6_K's int8 block 16; see quants.EXACT_MIN_BLOCK)."""

    float_experts: str = "keep"
    expert_format: str = "auto"
    exact: bool = False
    imatrix: dict[str, np.ndarray] | None = dataclasses.field(default=None, compare=False)  # name -> [n_mat, K]
    context: int | None = None  # positions the model is built for (RoPE tables); None: the GGUF's context_length
    threads: int | None = None  # weight conversion threads; None: every core (weights.default_workers)


class GraphBuilder:
    """Emits nodes and lazy initializers on an onnx-ir tape; recipes call its domain-level methods."""

    def __init__(self, gguf: GGUFModel, arch: Architecture, options: LowerOptions):
        self.gguf = gguf
        self.arch = arch
        self.options = options
        self.hp = arch.read_hparams(gguf)
        self.tape = ir_tape.Tape()
        self.report = WeightReport()
        self._consts: dict[tuple, ir.Value] = {}
        self._block_sums: dict[tuple, ir.Value] = {}
        self.moe_layers: list[dict[str, Any]] = []
        self.offload = options.expert_format == "offload"
        # activations, float weights and scales: float16 for the GPU's formats (offload, packed), else float32
        # (native: the GGUF's own blocks on the CPU, float32 activations)
        half = options.expert_format in ("offload", "packed")
        self.act = ir.DataType.FLOAT16 if half else ir.DataType.FLOAT
        self.np_act = np.float16 if half else np.float32

    # ---- initializers -------------------------------------------------------------------------
    def lazy_initializer(
        self, name: str, dtype: ir.DataType, shape: tuple[int, ...], make: Callable[[], np.ndarray]
    ) -> ir.Value:
        def materialize() -> ir.TensorProtocol:
            array = make()
            if dtype == ir.DataType.FLOAT16:
                array = array.astype(np.float16)
            if tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{name}: built shape {array.shape}, declared {shape}")
            return ir.Tensor(np.ascontiguousarray(array), name=name)

        tensor = ir.LazyTensor(materialize, dtype=dtype, shape=ir.Shape(shape), name=name)
        return self.tape.initializer(tensor, name=name)

    def const(self, key: str, array: np.ndarray) -> ir.Value:
        """A small constant initializer, shared by every node that needs the same value."""
        cache_key = (key, array.dtype.str, array.shape, array.tobytes())
        if cache_key not in self._consts:
            self._consts[cache_key] = self.tape.initializer(ir.Tensor(array, name=key), name=key)
        return self._consts[cache_key]

    def ints(self, *values: int) -> ir.Value:
        name = "const.i64." + "_".join(str(v).replace("-", "m") for v in values)
        return self.const(name, np.array(values, dtype=np.int64))

    def tensor(self, role: str, layer: int | None = None) -> SourceTensor:
        return self.arch.tensor(self.gguf, role, layer, self.hp)

    def optional(self, role: str, layer: int | None = None) -> SourceTensor | None:
        """The tensor of `role` if the file has it (biases, shared experts, an untied LM head)."""
        return self.tensor(role, layer) if self.arch.has_tensor(self.gguf, role, layer) else None

    def scale(self, x: ir.Value, factor: float, name: str) -> ir.Value:
        """x * factor (a float32 constant), for architecture multipliers."""
        value = self.const(f"const.{self.act.name.lower()}.{factor!r}", np.array(factor, dtype=self.np_act))
        return self.tape.op("Mul", [x, value], name=name)

    def float_weight(self, name: str, src: SourceTensor, transpose: bool = False) -> ir.Value:
        """A GGUF tensor as float32 (its values exactly as the gguf package dequantizes them)."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        return self.tape.initializer(float_tensor(src, qt, name, self.report, transpose, self.act), name=name)

    def packed_weights(
        self,
        name: str,
        sources: list[SourceTensor],
        form: BlockForm,
        blob_layout: bool = False,
        prepack: bool = False,
        scale_dtype: ir.DataType | None = None,
        pad_rows: int = 0,
    ) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        """Codes, scales (in `scale_dtype`, default the activation type) and, for a form with
        offsets, block offsets initializers of GGUF matrices in `form` (see weights.PackedGroup;
        `pad_rows` zero rows after each matrix's own)."""
        rows = self.gguf_rows(sources)
        packing = PackOptions(
            blob_layout,
            scale_dtype=scale_dtype or self.act,
            prepack=prepack,
            workers=self.options.threads,
            pad_rows=pad_rows,
            offsets_dtype=self.act,
        )
        group = PackedGroup(rows, form, name, self.report, packing)
        offsets = self.tape.initializer(group.offsets, name=group.offsets.name) if group.offsets is not None else None
        return (
            self.tape.initializer(group.codes, name=group.codes.name),
            self.tape.initializer(group.scales, name=group.scales.name),
            offsets,
        )

    def gguf_rows(self, sources: list[SourceTensor]) -> list[GgufRows]:
        """GGUF tensors as RowSources, each with its importance matrix entry (checked against its
        columns) where the conversion has one."""
        types = [quant_type(s.ggml_type, s.name, s.path) for s in sources]
        if self.options.imatrix is not None:
            for s in sources:
                imp = self.options.imatrix.get(s.name)
                k, n_mat = s.shape[-1], (s.shape[0] if len(s.shape) == 3 else 1)
                if imp is not None and imp.size not in (k, n_mat * k):
                    per = f"one matrix or {n_mat} (one per expert)" if n_mat > 1 else "one matrix"
                    raise MoepassError(
                        f"importance matrix entry '{s.name}' has {imp.size} values, not {k} columns for {per}"
                    )
        importance = self.options.imatrix or {}
        return [GgufRows(s, t, importance.get(s.name)) for s, t in zip(sources, types)]

    def gguf_blob(self, name: str, src: SourceTensor, grouped: bool = False, native: bool = False) -> ir.Value:
        """A GGUF tensor's own blocks as a uint8 initializer [..., rows, row bytes] (MoEPacked's
        blob), streamed as read: exact, the file's size. `grouped`: each matrix's rows in the row
        groups moepass's CPU kernels take (moepass.core.row_groups), the same bytes reordered;
        `native`: read by moepass's kernels in the GGUF's order (GatherPacked's table)."""
        shape = (*src.shape[:-1], src.row_bytes)
        qt = quant_type(src.ggml_type, src.name, src.path)
        self.report.add(
            WeightRecord(
                name,
                [src.name],
                [qt.name],
                f"{'native' if grouped or native else 'packed'} {qt.name}",
                src.nbytes,
                qt.bits_per_weight,
                [True],
                [0.0],
            )
        )
        # a chunk: whole experts of a stack, whole row groups of one matrix (its last holds the rows left)
        rows = shape[-2] if len(shape) == 3 else row_groups.ROW_GROUP

        def chunks():
            if not grouped:
                return (raw for _, raw in row_chunks(src))
            if len(shape) == 2:
                return (row_groups.group(raw, qt) for _, raw in row_chunks(src, rows))
            return (row_groups.group(raw.reshape(-1, rows, src.row_bytes), qt) for _, raw in row_chunks(src, rows))

        return self.tape.initializer(StreamedTensor(chunks, ir.DataType.UINT8, shape, name), name=name)

    def group_initializers(self, group: PackedGroup) -> tuple[ir.Value, ir.Value]:
        """A packed group's codes and scales as initializers of the graph."""
        return (
            self.tape.initializer(group.codes, name=group.codes.name),
            self.tape.initializer(group.scales, name=group.scales.name),
        )

    def matrix_weights(
        self, name: str, src: SourceTensor, form: BlockForm, blob_layout: bool = False
    ) -> tuple[ir.Value, ir.Value, ir.Value | None]:
        """packed_weights of one non-expert matrix, its scales stored in float16 where
        quants.scales_in_float16 says (blocks of 128 whose scales float16 holds) and widened to the
        activation type by a Cast of the initializer, which ONNX Runtime folds when the session
        loads: MatMulNBits and GatherBlockQuantized take scales of the activation type only. At
        smaller blocks the scales are stored as float32: the folded Cast's float32 copy would sit on
        the heap beside the mapped file (int4/b32 q_proj-sized matrices: 10.3 bytes a block held
        against 1.6). A requantized matrix keeps float32 scales: scales chosen among float16 values
        add error that the trained models' Q6_K file shows (markov, trained on an AVX2 EPYC: mean
        KLD 1.44x llama.cpp's, 90 % interval [1.01, 2.05]; with float32 scales within the tests'
        bound), for 1/8 bit a weight at block 128."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        narrow = self.act == ir.DataType.FLOAT and qt.keeps_codes(form) and scales_in_float16([qt], form)
        codes, scales, offsets = self.packed_weights(
            name, [src], form, blob_layout, scale_dtype=ir.DataType.FLOAT16 if narrow else None
        )
        if narrow:
            scales = self.tape.op("Cast", [scales], {"to": self.act}, name=f"{name}.scales.widen")
        return codes, scales, offsets

    # ---- layers ---------------------------------------------------------------------------------
    def linear(
        self,
        x: ir.Value,
        src: SourceTensor,
        name: str,
        weight_name: str | None = None,
        bias: SourceTensor | None = None,
    ) -> ir.Value:
        """y = x @ W^T (+ b) for a GGUF matrix W [N, K]: MatMulNBits for quantized W (quants.matrix_form),
        plus the block offsets' product with the input's block sums for a form with offsets; float32
        MatMul (+ Add) for float W.

        The weight initializers are named after the GGUF tensor unless `weight_name` says otherwise
        (a tied LM head shares its GGUF tensor with the embedding table)."""
        n, k = src.shape
        weight_name = weight_name or src.name
        b = self.float_weight(bias.name, bias) if bias is not None else None
        if self.native_matrix(src):
            blob = self.gguf_blob(f"{weight_name}.blocks", src, grouped=True)
            attributes = {"packed_type": int(src.ggml_type), "row_group": row_groups.ROW_GROUP}
            y = self.tape.op("MatMulPacked", [x, blob], attributes, domain=NATIVE_DOMAIN, name=name)
            return y if b is None else self.tape.op("Add", [y, b], name=f"{name}.bias")
        form = self.matrix_form(src)
        if form is None:
            w = self.float_weight(f"{weight_name}.T", src, transpose=True)
            y = self.tape.op("MatMul", [x, w], name=name)
            return y if b is None else self.tape.op("Add", [y, b], name=f"{name}.bias")
        codes, scales, offsets = self.matrix_weights(weight_name, src, form, blob_layout=True)
        inputs = [x, codes, scales] + ([None, None, b] if b is not None else [])
        y = self.tape.op(
            "MatMulNBits",
            inputs,
            {"K": k, "N": n, "bits": form.bits, "block_size": form.block_size},
            domain="com.microsoft",
            name=name,
        )
        if offsets is None:
            return y
        sums = self.block_sums(x, k, form.block_size, f"{name}.block_sums")
        shifts = self.tape.op("MatMul", [sums, offsets], name=f"{name}.offsets")
        return self.tape.op("Add", [y, shifts], name=f"{name}.with_offsets")

    def block_sums(self, x: ir.Value, k: int, block: int, name: str) -> ir.Value:
        """x's sums over each block of `block` inputs, [..., K / block], by a product with a 0/1 matrix
        in the activation type (any rank of x), computed once per input value (q, k and v share theirs)."""
        key = (id(x), k, block)
        if key not in self._block_sums:
            ones = np.kron(np.eye(k // block, dtype=self.np_act), np.ones((block, 1), self.np_act))  # [K, K/block]
            name_const = f"const.block_sums.{self.act.name.lower()}.{k}.{block}"
            self._block_sums[key] = self.tape.op("MatMul", [x, self.const(name_const, ones)], name=name)
        return self._block_sums[key]

    def native(self, types: Sequence[QuantType]) -> bool:
        """Whether matrices of these types are moepass's own ops over their blocks: --expert-format
        native, or auto where moepass.cpu_ops has a kernel for every one of them (a float32 graph)."""
        choice = self.options.expert_format
        every = all(qt.cpu_kernel for qt in types)
        return self.act == ir.DataType.FLOAT and (choice == "native" or (choice == "auto" and every))

    def native_matrix(self, src: SourceTensor) -> bool:
        """Whether a matrix is moepass::MatMulPacked over its own blocks (self.native: a type
        moepass's CPU kernels take)."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        return qt.cpu_kernel and self.native([qt])

    def matrix_form(self, src: SourceTensor, offsets: bool = True) -> BlockForm | None:
        """The block form of a non-expert matrix (quants.matrix_form); None for float."""
        qt = quant_type(src.ggml_type, src.name, src.path)
        return matrix_form(qt, src.shape[-1], self.options.exact, offsets)

    def rms_norm(self, x: ir.Value, src: SourceTensor, name: str, bias: SourceTensor | None = None) -> ir.Value:
        """RMSNorm(x) * gamma (+ beta: phimoe's norms add a bias after normalizing, as llama.cpp does)."""
        gamma = self.float_weight(src.name, src)
        y = self.tape.op(
            "SimplifiedLayerNormalization",
            [x, gamma],
            {"axis": -1, "epsilon": self.hp.rms_eps, "stash_type": 1},
            name=name,
        )
        if bias is None:
            return y
        return self.tape.op("Add", [y, self.float_weight(bias.name, bias)], name=f"{name}.bias")

    def per_head_rms_norm(self, x: ir.Value, src: SourceTensor, n_heads: int, name: str) -> ir.Value:
        d = self.hp.head_dim
        heads = self.tape.op("Reshape", [x, self.ints(0, 0, n_heads, d)], name=f"{name}.split_heads")
        normed = self.rms_norm(heads, src, name)
        return self.tape.op("Reshape", [normed, self.ints(0, 0, n_heads * d)], name=f"{name}.merge_heads")

    def embedding(self, input_ids: ir.Value) -> ir.Value:
        """Rows of the token embedding table. A quantized table stays quantized: exact where its
        blocks move exactly, else requantized to 8 bits (com.microsoft::GatherBlockQuantized
        dequantizes only the rows it gathers, codes laid out as QMoE's rows): a float32 copy of a
        151,936-token table would take 1.2 GB where llama.cpp keeps its blocks. Measured on both
        trained models: a Q4_K table at 8 bits keeps llama.cpp's fidelity, at 4 bits it does not (1.8x
        its KLD). Beside moepass's own kernels (self.native) the table is the GGUF's own blocks in
        moepass::GatherPacked, which dequantizes the rows it gathers as ggml does: the rest of such a
        model computes what llama.cpp does, and a requantized table was then its largest difference
        (the trained models' Q6_K: KLD 1.045x and 1.049x llama.cpp's with int8/b128, 1.000x exact; a
        Q5_K table's int8/b32 moved the markov model's routing at a few positions). A table the LM
        head shares (tied) keeps one copy, the head's row groups: there it takes its exact form where
        the type has one, as --exact does."""
        src = self.tensor("token_embd")
        native = self.native_matrix(src)
        if native and self.arch.has_tensor(self.gguf, "output"):
            table = self.gguf_blob(f"{src.name}.blocks", src, native=True)
            attributes = {"packed_type": int(src.ggml_type)}
            op = self.tape.op
            return op("GatherPacked", [table, input_ids], attributes, domain=NATIVE_DOMAIN, name="embed_tokens")
        qt = quant_type(src.ggml_type, src.name, src.path)
        form = matrix_form(qt, src.shape[-1], self.options.exact or native, offsets=False)  # no block offsets
        if form is None:
            table = self.float_weight(self.arch.tensor_name("token_embd"), src)
            return self.tape.op("Gather", [table, input_ids], {"axis": 0}, name="embed_tokens")
        codes, scales, _ = self.matrix_weights(src.name, src, form)
        return self.tape.op(
            "GatherBlockQuantized",
            [codes, input_ids, scales],
            {"gather_axis": 0, "quantize_axis": 1, "block_size": form.block_size, "bits": form.bits},
            domain="com.microsoft",
            name="embed_tokens",
        )

    def expert_bias(self, name: str, sources: list[SourceTensor], pad: int = 0) -> ir.Value:
        """Per-expert biases [E, N] of one or two sources as [E, N * len(sources)] (gate and up
        interleaved, as the fc1 rows are), in the activation type; `pad` zeros after each expert's
        (fc2's rows for block-sum features)."""
        e, n = sources[0].shape

        def make() -> np.ndarray:
            values = [dequantize(s.read_rows(), s.ggml_type).reshape(e, n) for s in sources]
            stacked = np.stack(values, axis=-1).reshape(e, n * len(sources))
            return np.concatenate([stacked, np.zeros((e, pad), np.float32)], axis=1)

        return self.lazy_initializer(name, self.act, (e, n * len(sources) + pad), make)

    def float_experts(self, name: str, sources: list[SourceTensor]) -> ir.Value:
        rows = [GgufRows(s, quant_type(s.ggml_type, s.name, s.path)) for s in sources]
        stack = float_expert_stack(rows, name, self.report, self.act, self.options.threads)
        return self.tape.initializer(stack, name=name)
