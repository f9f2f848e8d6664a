"""ONNX models with per-expert MoE subgraphs, made by the real exporters (torch.onnx.export of
small random Hugging Face Qwen3-MoE and Mixtral models, then ONNX Runtime's MatMulNBits quantizer),
fused into QMoE / MoE nodes by `moepass convert model.onnx`.

The fused model's logits against the unfused model's on ONNX Runtime, on inputs of the exported
length that reach every expert (the export's own limits, see fixtures/make_onnx_fixtures.py):
float experts <= 1e-5; 4-bit blobs (moved bit for bit, checked byte by byte) <= 1e-5; 8-bit blobs
(moved bit for bit too) <= 1 % of the logits' spread: ONNX Runtime's CPU QMoE quantizes the
activations to int8 for 8-bit block-wise experts (measured 5.5e-4 against a spread of 0.16).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import make_onnx_fixtures
import moepass

FAMILIES = make_onnx_fixtures.FAMILIES


def _logits(path, ids):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


def _inputs(n=3):
    rng = np.random.default_rng(1)
    return [rng.integers(0, 320, (1, make_onnx_fixtures.SEQUENCE)) for _ in range(n)]


def _initializers(path):
    model = onnx.load(str(path))
    return model, {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_fused_model_matches_the_export(family, bits, exported, tmp_path):
    source = exported(family, bits=bits)
    result = moepass.convert(source, tmp_path / "fused", activations="float")  # exact arithmetic, as the export
    assert [f["fused"] for f in result.fusion] == [True, True]
    fused = result.output_dir / "model.onnx"
    for ids in _inputs():
        reference = _logits(source, ids)
        bound = 0.01 * reference.std() if bits == 8 else 1e-5
        np.testing.assert_allclose(_logits(fused, ids), reference, rtol=0, atol=bound)
    model, inits = _initializers(fused)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QMoE" if bits else "MoE") == 2 and "NonZero" not in ops and "TopK" not in ops
    used = {i for n in model.graph.node for i in n.input}
    assert set(inits) <= used, f"orphan initializers: {sorted(set(inits) - used)}"
    report = json.loads((result.output_dir / "moepass.json").read_text())
    assert all(all(w["exact"]) for w in report["weights"])
    assert {m["form"] for m in report["moe_layers"]} == {f"int{bits}/b32" if bits else "float32"}


@pytest.mark.parametrize("family", FAMILIES)
def test_blobs_move_bit_for_bit(family, exported, tmp_path):
    """QMoE fc1 rows 2i / 2i+1 are expert e's gate / up MatMulNBits rows i, byte for byte: codes,
    scales and packed zero points (the quantizer is asymmetric by default)."""
    source = exported(family, bits=4)
    out = moepass.convert(source, tmp_path / "fused").output_dir
    src_model, src = _initializers(source)
    _, dst = _initializers(out / "model.onnx")
    prefix = "/inner/model/layers.0/" + ("mlp" if family == "qwen3moe" else "block_sparse_moe")
    gate_name, up_name = ("gate_proj", "up_proj") if family == "qwen3moe" else ("w1", "w3")
    blobs = {n.name: n.input for n in src_model.graph.node if n.op_type == "MatMulNBits"}
    for e in (0, 5):
        gate = blobs[f"{prefix}/experts.{e}/{gate_name}/MatMul_Q4"]
        up = blobs[f"{prefix}/experts.{e}/{up_name}/MatMul_Q4"]
        for part, which in ((0, "weight"), (1, "scales"), (2, "zero_points")):
            stacked = dst[f"moe.0.fc1.{which}"][e]
            n = src[gate[1 + part]].shape[0]
            np.testing.assert_array_equal(stacked[0::2], src[gate[1 + part]].reshape(n, -1))
            np.testing.assert_array_equal(stacked[1::2], src[up[1 + part]].reshape(n, -1))


def test_geometry_that_does_not_fit_is_requantized_with_the_error_reported(exported, tmp_path):
    """Blocks of 128 over K = 64 (MatMulNBits pads the row; QMoE needs the block to divide K): the
    blob values are requantized into int8 block 32 and the error is measured."""
    source = exported("qwen3moe", bits=4, block_size=128)
    result = moepass.convert(source, tmp_path / "fused", activations="float")
    assert {m["form"] for m in result.moe_layers} == {"int8/b32"}
    errors = [e for w in result.weights for e in w["rel_rms_error"]]
    assert not any(any(w["exact"]) for w in result.weights) and 0 < max(errors) < 0.01
    for ids in _inputs(1):
        reference = _logits(source, ids)
        assert np.abs(_logits(result.output_dir / "model.onnx", ids) - reference).max() < 0.05 * reference.std()


def test_export_missing_experts_is_left_untouched_and_reported(tmp_path, capsys):
    """An export whose example input reached only some experts has no branch for the others: not
    fused, the reason says so, the model is written unchanged, and inspect tells the same."""
    import torch

    source = make_onnx_fixtures.export_hf_moe(tmp_path / "short.onnx", "mixtral", experts=16, top_k=1,
                                              example_length=4)
    result = moepass.convert(source, tmp_path / "out")
    assert not any(f["fused"] for f in result.fusion)
    assert all("branches for" in f["reason"] and "of the router's 16 experts" in f["reason"] for f in result.fusion)
    before, after = onnx.load(str(source)), onnx.load(str(result.output_dir / "model.onnx"))
    assert [n.op_type for n in before.graph.node] == [n.op_type for n in after.graph.node]
    info = moepass.inspect(source)
    assert info["fusion_candidates"] and not any(r["fused"] for r in info["fusion_candidates"])
    del torch


def test_model_without_moe_passes_through_unchanged(tmp_path):
    import torch

    dense = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    path = tmp_path / "dense.onnx"
    torch.onnx.export(dense, (torch.zeros(1, 16),), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    result = moepass.convert(path, tmp_path / "out")
    assert result.fusion == [] and result.moe_layers == []
    assert "none found: the model is written unchanged" in "\n".join(result.summary_lines())
    before, after = onnx.load(str(path)), onnx.load(str(result.output_dir / "model.onnx"))
    assert before.graph.node == after.graph.node
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    run = [ort.InferenceSession(str(p)).run(None, {"x": x})[0] for p in (path, result.output_dir / "model.onnx")]
    np.testing.assert_array_equal(run[0], run[1])


@pytest.mark.parametrize("norm_topk", [True, False])
def test_float_moe_nodes_are_quantized_into_qmoe_on_request(norm_topk, exported, tmp_path):
    """com.microsoft::MoE nodes (here: moepass's own float fusion of the export) become QMoE with
    --float-experts int4 / int8, the error measured; with keep they are left as they are. Without
    renormalization (Qwen3-MoE's norm_topk_prob false) the QMoE node gets the softmax as
    router_weights (ONNX Runtime's CPU QMoE renormalizes otherwise)."""
    source = exported("qwen3moe", norm_topk=norm_topk)
    float_moe = moepass.convert(source, tmp_path / "float").output_dir
    kept = moepass.convert(float_moe, tmp_path / "kept")
    assert all("already one float MoE node" in f["reason"] for f in kept.fusion)
    # (bound on the weights' rel. RMS error, on the logits' difference in units of their spread);
    # measured without renormalization: 0.0013 (int8) of the spread, 0.22 when the QMoE node is not
    # given the router weights
    for choice, bound, logit_bound in (("int8", 0.01, 0.02), ("int4", 0.15, 0.1)):
        result = moepass.convert(float_moe, tmp_path / choice, float_experts=choice)
        assert [f["fused"] for f in result.fusion] == [True, True]
        assert {m["form"] for m in result.moe_layers} == {f"{choice}/b32"}
        errors = [e for w in result.weights for e in w["rel_rms_error"]]
        assert 0 < max(errors) < bound
        ids = _inputs(1)[0]
        reference = _logits(source, ids)
        assert np.abs(_logits(result.output_dir / "model.onnx", ids) - reference).max() < logit_bound * reference.std()
    float_logits = _logits(float_moe / "model.onnx", _inputs(1)[0])
    np.testing.assert_allclose(float_logits, _logits(source, _inputs(1)[0]), rtol=0, atol=1e-5)


def test_in_memory_models_and_external_data(exported, tmp_path):
    """The API takes onnx.ModelProto, onnx-ir models and onnx-graphsurgeon graphs; a model whose
    weights are external data is read lazily and gives the same fused files."""
    import onnx_graphsurgeon as gs

    source = exported("mixtral", bits=4)
    proto = onnx.load(str(source))
    external = tmp_path / "external" / "model.onnx"
    external.parent.mkdir()
    onnx.save(onnx.load(str(source)), str(external), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    outputs = [moepass.convert(m, tmp_path / f"out{i}", activations="float").output_dir
               for i, m in enumerate([proto, gs.import_onnx(proto), external])]
    ids = _inputs(1)[0]
    reference = _logits(source, ids)
    for out in outputs:
        np.testing.assert_allclose(_logits(out / "model.onnx", ids), reference, rtol=0, atol=1e-5)


def test_unreadable_onnx_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(moepass.MoepassError, match="bad.onnx: not a readable ONNX model"):
        moepass.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_scaled_routing_weights_are_not_mistaken_for_the_pattern(exported, tmp_path):
    """A model that scales the top-k weights (a routed scaling factor, edited into the export) is not
    what the rule fuses: left as it is, with the reason."""
    import onnx_ir as ir

    model = ir.load(str(exported("qwen3moe")))
    div = next(n for n in model.graph if n.op_type == "Div" and n.name.endswith("layers.0/mlp/Div"))
    weights = div.outputs[0]
    users = [(use.node, use.idx) for use in weights.uses()]
    scale = ir.node("Mul", [weights, ir.Value(name="routed_scaling_factor",
                                               const_value=ir.tensor(np.array(2.5, np.float32)))], name="scale")
    model.graph.register_initializer(scale.inputs[1])
    model.graph.insert_after(div, scale)
    for node, index in users:
        node.replace_input_with(index, scale.outputs[0])
    result = moepass.convert(model, tmp_path / "out")
    assert [f["fused"] for f in result.fusion] == [False, True]
    assert "not by the router's top-k weights" in result.fusion[0]["reason"]


ODD = {"layers": 3, "hidden": 80, "experts": 10, "top_k": 4, "ffn": 24}   # K = 24 < every block, 80 % 32 != 0
MIXED = {"exclude": tuple(f"/inner/model/layers.0/mlp/experts.3/{p}_proj/MatMul" for p in ("gate", "up", "down"))}


@pytest.mark.parametrize("bits,block_size,symmetric,geometry,form", [
    (4, 16, False, {}, "int4/b16"), (4, 32, True, {}, "int4/b32"), (8, 16, True, {}, "int8/b16"),
    (8, 32, False, {}, "int8/b32"),                                      # moved byte for byte
    (4, 64, False, {}, "int8/b32"), (4, 256, True, {}, "int8/b32"),      # blocks wider than K = 32: requantized
    (4, 32, False, ODD, "int8/row"), (8, 32, True, ODD, "int8/row"),     # no block divides K = 24 and 80:
    (4, 16, True, ODD, "int8/row"), (4, 128, False, ODD, "int8/row"),    # one scale per row
    (4, 32, False, {"accuracy_level": 4}, "int4/b32"),                   # the quantizer's accuracy_level
    (4, 32, True, MIXED, "int8/b32"),                                    # one expert left float by the quantizer
])
def test_every_matmul_nbits_geometry_fuses(bits, block_size, symmetric, geometry, form, exported, tmp_path):
    """What ONNX Runtime's MatMulNBits quantizer writes, at every bit width, block size, symmetry and
    K (padded last blocks included) fuses: byte for byte where QMoE holds the blocks (logits equal to
    the export's within float rounding; 8-bit blocks within 1 % of the logits' spread, ONNX Runtime's
    8-bit kernel quantizing activations: measured 0.3-0.4 %), else requantized into 8 bits (blocks of
    32 or 16 where they divide K, else one scale per row), the error reported; logits within 1 % of
    the spread on average and 25 % at most (measured at most: 0.2-0.6 %, and 11 % for 4-bit blocks
    of 256 and 16 % with one expert left float, each at one position where a layer's routing flips;
    0.11 % on average in that last case)."""
    source = exported("qwen3moe", bits=bits, block_size=block_size, symmetric=symmetric, **geometry)
    candidates = moepass.inspect(source)["fusion_candidates"]   # what inspect says will happen, per layer
    assert candidates and all(f"{bits}-bit blocks of {block_size}" in c["geometry"] for c in candidates)
    assert {c["geometry"].split(" -> ")[1].split(",")[0] for c in candidates} >= {form}
    if geometry is MIXED:
        assert "float" in candidates[0]["geometry"].split(" -> ")[0]
    result = moepass.convert(source, tmp_path / "fused", activations="float")
    assert [f["fused"] for f in result.fusion] == [True] * len(result.fusion) and result.fusion
    forms = [m["form"] for m in result.moe_layers]
    assert forms[0] == form and set(forms) <= {form, f"int{bits}/b{block_size}"}   # MIXED: layer 0 only
    exact = all(all(w["exact"]) for w in result.weights)
    assert exact == (set(forms) == {f"int{bits}/b{block_size}"})
    import torch

    # The export runs only on inputs that reach every expert, and its quantized router may route its
    # own example elsewhere: compare on the candidates the export runs on (the fused model runs on all).
    example = torch.randint(0, 320, (1, make_onnx_fixtures.SEQUENCE), generator=torch.Generator().manual_seed(0))
    compared = 0
    # the quantizer's accuracy_level makes the export itself quantize activations; its blobs are the
    # same as without it, and the fused model (float activations here) is held to that export
    plain = exported("qwen3moe", bits=bits, block_size=block_size, symmetric=symmetric) \
        if "accuracy_level" in geometry else source
    for ids in (example.numpy(), *_inputs(3)):
        try:
            reference = _logits(plain, ids)
        except Exception:  # noqa: BLE001 - the export's own limit, not the fusion's
            continue
        diff = np.abs(_logits(result.output_dir / "model.onnx", ids) - reference)
        spread = float(reference.std())
        if exact:
            assert diff.max() <= (1e-5 if bits == 4 else 0.01 * spread), diff.max()
        else:  # one position's routing may flip under the requantization: a mean bound, and a looser max
            assert diff.mean() <= 0.01 * spread and diff.max() <= 0.25 * spread, (diff.mean(), diff.max(), spread)
        compared += 1
    assert compared >= 1
    if not exact:
        errors = [e for w in result.weights for e in w["rel_rms_error"]]
        assert 0 < max(errors) < 0.02
    assert f"-> {result.moe_layers[0]['node']} ({form})" in "\n".join(result.summary_lines())


def test_print_after_shows_each_step_of_the_onnx_pipeline(exported, tmp_path):
    """ONNX input runs the same run_pipeline as GGUF input: --print-after prints the graph as read
    (per-expert MatMulNBits, no QMoE), after fuse-moe (QMoE) and after quantize-activations
    (accuracy_level on the QMoE node); a GGUF-only step is refused before any work, by name."""
    from click.testing import CliRunner

    from moepass.cli import main

    source = exported("qwen3moe", bits=4)
    shown = {}
    for step in ("read", "fuse-moe", "quantize-activations"):
        result = CliRunner().invoke(main, ["convert", str(source), "-o", str(tmp_path / step), "-q",
                                           "--print-after", step])
        assert result.exit_code == 0, result.output
        shown[step] = result.stdout
    assert "MatMulNBits" in shown["read"] and "QMoE" not in shown["read"]
    assert "QMoE" in shown["fuse-moe"] and "accuracy_level=4" not in shown["fuse-moe"].split("QMoE", 1)[1][:2000]
    assert "accuracy_level=4" in shown["quantize-activations"].split("QMoE", 1)[1][:2000]
    for step, kind in (("lower", "ONNX"), ("fuse-skip-norm", "ONNX")):
        result = CliRunner().invoke(main, ["convert", str(source), "-o", str(tmp_path / "no"), "--print-after", step])
        assert result.exit_code == 2 and f"--print-after {step}: no such step for {kind} input" in result.stderr
        assert not (tmp_path / "no").exists()
