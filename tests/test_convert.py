"""convert: output layout, determinism, the conversion report, stored weights bit for bit, inspect, CLI."""

from __future__ import annotations

import filecmp
import importlib
import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import moepass
from moepass.cli import main
from moepass.inspection import format_inspection
from support.bounds import assert_within, float_rounding_bound
from support.stored import stored_matrices

OUTPUT_FILES = ["genai_config.json", "model.onnx", "model.onnx.data", "moepass.json", "tokenizer.json",
                "tokenizer_config.json"]


def test_convert_twice_gives_identical_files(tmp_path, make_gguf):
    """Twice, and on one thread or three: the same bytes (chunks are packed in parallel, and written
    and summed in order)."""
    src = make_gguf("q4_k")
    a, b = moepass.convert(src, tmp_path / "a", threads=1), moepass.convert(src, tmp_path / "b", threads=3)
    names = sorted(p.name for p in a.output_dir.iterdir())
    assert names == OUTPUT_FILES
    match, mismatch, errors = filecmp.cmpfiles(a.output_dir, b.output_dir, names, shallow=False)
    assert match == names, (mismatch, errors)


def test_result_and_report(tmp_path, make_gguf):
    native = moepass.convert(make_gguf("q4_k"), tmp_path / "native")  # the default: the file's own blocks
    assert [m["form"] for m in native.moe_layers] == ["native Q4_K/Q4_K/Q6_K"] * 2
    assert native.output_bytes < 1.1 * native.source_bytes
    result = moepass.convert(make_gguf("q4_k"), tmp_path / "out", expert_format="qmoe")
    assert result.architecture == "qwen3moe" and result.n_layers == 2
    # a Q4_K_M layer is requantized anyway: 8 bits at the largest block dividing its rows
    assert [m["form"] for m in result.moe_layers] == ["int8/b128", "int8/b128"]
    assert result.moe_layers[0]["source_types"] == ["Q4_K", "Q4_K", "Q6_K"]
    report = json.loads((tmp_path / "out" / "moepass.json").read_text())
    weights = {w["onnx_name"]: w for w in report["weights"]}
    fc1, fc2 = weights["blk.0.ffn_experts.fc1"], weights["blk.0.ffn_experts.fc2"]
    assert fc1["exact"] == [False, False] and 0 < max(fc1["rel_rms_error"]) < 0.02   # Q4_K requantized
    assert fc2["exact"] == [False] and 0 < fc2["rel_rms_error"][0] < 0.02            # Q6_K too
    assert weights["output.weight"]["target"] == "int8/b128" and weights["output.weight"]["exact"] == [False]
    attn_q = weights["blk.0.attn_q.weight"]                                # Q4_K matrix: its own codes, exact
    assert attn_q["target"] == "int4/b32+offsets" and attn_q["exact"] == [True]
    exact = moepass.convert(make_gguf("q4_k"), tmp_path / "exact", exact=True, expert_format="qmoe")
    # gate and up: Q4_K's codes with block-sum features (float32 scales); down: Q6_K exact at block 16
    assert {m["form"] for m in exact.moe_layers} == {"int8/b16+sums x2"}  # levels to float16's precision
    exact_fc = {w["onnx_name"]: w for w in exact.weights}
    assert exact_fc["blk.0.ffn_experts.fc2"]["exact"] == [True] and max(exact_fc["blk.0.ffn_experts.fc1"]["rel_rms_error"]) < 1e-3
    output = {w["onnx_name"]: w for w in exact.weights}["output.weight"]
    assert output["target"] == "int8/b16" and output["exact"] == [True]             # Q6_K kept exact
    lines = "\n".join(result.summary_lines())
    assert "2 MoE, 8 experts, top-2" in lines and "requantized" in lines
    assert "x the GGUF" in lines and "expert_format='int4'" in lines   # 8-bit experts: the size and the choice
    assert "x the GGUF" not in "\n".join(moepass.convert(make_gguf("q4_0"), tmp_path / "q4_0").summary_lines())
    assert result.output_bytes == sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    assert "memory" not in lines


def test_a_model_larger_than_the_machines_memory_is_said(tmp_path, make_gguf, monkeypatch):
    """A 48-layer Q4_K_M model with 8-bit experts (31 GB) on a 24 GiB machine: the summary says
    that decoding there reads from the disk, and which form would fit."""
    convert_module = importlib.import_module("moepass.pipeline.conversion")
    result = moepass.convert(make_gguf("q4_k"), tmp_path / "out", expert_format="qmoe")
    monkeypatch.setattr(convert_module, "physical_memory", lambda: result.output_bytes - 1)
    lines = [line for line in result.summary_lines() if "memory" in line]
    assert len(lines) == 1 and "reads experts from the disk" in lines[0] and "expert_format='int4'" in lines[0]
    exact = moepass.convert(make_gguf("q4_0"), tmp_path / "q4_0")
    monkeypatch.setattr(convert_module, "physical_memory", lambda: exact.output_bytes - 1)
    lines = [line for line in exact.summary_lines() if "memory" in line]
    assert len(lines) == 1 and "expert_format" not in lines[0]  # exact: no smaller form to offer


@pytest.mark.parametrize("preset", ["q8_0", "q4_0", "q6_k", "q4_k"])
def test_stored_weights_are_bit_exact(preset, make_gguf, converted):
    """Every QMoE and MatMulNBits weight the report calls exact, unpacked, equals the gguf package's
    dequantization bit for bit (with exact=True: Q6_K in its int8 block 16 form; Q4_K's attention
    matrices are exact with block offsets, its experts' gate and up kept through block-sum features,
    within their levels' remainder, not bit for bit)."""
    reader = GGUFReader(make_gguf(preset))
    source = {t.name: gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32) for t in reader.tensors}
    model_dir = converted(preset, exact=True)
    report = json.loads((model_dir / "moepass.json").read_text())
    exact = {s for w in report["weights"] for s, e in zip(w["sources"], w["exact"] or []) if e}
    checked = 0
    for ours, name in stored_matrices(model_dir):
        if name in exact:
            np.testing.assert_array_equal(ours.view(np.uint32), source[name].view(np.uint32), err_msg=name)
            checked += 1
    # per layer q, k, v, o (+ 3 experts; Q4_K's: the Q6_K down only); the LM head; the token table
    # (GatherBlockQuantized) where it moves exactly (Q4_K's is requantized)
    assert checked == 2 * (4 + (1 if preset == "q4_k" else 3)) + 1 + (preset != "q4_k")


def test_split_gguf_converts_to_the_same_weights(make_gguf, converted):
    whole, split = converted("f32"), converted("f32", split_max_tensors=8)
    assert filecmp.cmp(whole / "model.onnx.data", split / "model.onnx.data", shallow=False)


def test_float_experts_option(tmp_path, make_gguf):
    kept = moepass.inspect(moepass.convert(make_gguf("f32"), tmp_path / "keep").output_dir)
    assert [(m["op"], m["form"]) for m in kept["moe_nodes"]] == [("MoE", "float32")] * 2
    int4 = moepass.convert(make_gguf("f32"), tmp_path / "int4", float_experts="int4")
    assert [m["form"] for m in int4.moe_layers] == ["int4/b32"] * 2
    assert 0 < int4.max_rel_rms_error < 0.15
    with pytest.raises(moepass.MoepassError, match="float_experts must be one of"):
        moepass.convert(make_gguf("f32"), tmp_path / "bad", float_experts="fp8")


def test_graph_shape(converted):
    model = onnx.load(converted("q4_0") / "model.onnx", load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QMoE") == 2 and ops.count("GroupQueryAttention") == 2
    assert ops.count("SkipSimplifiedLayerNormalization") == 4   # residual adds folded into the next norm
    assert "Add" not in ops
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"] + [
        f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")] + ["logits_to_keep"]
    # logits_to_keep is optional: an initializer (0 = every position) that a feed overrides
    assert "logits_to_keep" in {t.name for t in model.graph.initializer}
    assert [o.name for o in model.graph.output] == ["logits"] + [f"present.{i}.{kv}" for i in range(2)
                                                                 for kv in ("key", "value")]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["moepass.architecture"] == "qwen3moe" and meta["moepass.moe_layers"] == "2"


def test_inspect_gguf_and_onnx(make_gguf, converted):
    g = moepass.inspect(make_gguf("q4_k"))
    assert g["architecture"] == "qwen3moe" and g["moe_layers"] == 2
    assert set(g["bytes_by_group"]["experts"]) == {"Q4_K", "Q6_K"}
    o = moepass.inspect(converted("q4_0"))
    assert [m["form"] for m in o["moe_nodes"]] == ["int4/b32"] * 2
    expert_bytes = sum(m["bytes"] for m in o["moe_nodes"])
    assert o["bytes_by_group"]["experts"] == expert_bytes > 0
    hp = json.loads((converted("q4_0") / "moepass.json").read_text())["hparams"]
    per_position = 2 * hp["n_layers"] * hp["n_kv_heads"] * hp["head_dim"] * 4  # float32 keys and values
    assert o["kv_cache"] == {"type": "float32", "bytes_per_position": per_position, "context": hp["context_length"]}
    (line,) = [line for line in format_inspection(o) if line.startswith("KV cache")]
    assert line.endswith(f"at the model's {hp['context_length']:,} positions")


def test_inspect_names_a_cache_it_cannot_size(tmp_path):
    """An export's cache with a symbolic head axis: inspect gives its type and no bytes, and fails
    nothing."""
    past = onnx.helper.make_tensor_value_info("past_key_values.0.key", onnx.TensorProto.FLOAT, ["b", "heads", "s", 64])
    out = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", [past.name], ["y"])], "g", [past], [out])
    onnx.save(onnx.helper.make_model(graph), tmp_path / "model.onnx")
    info = moepass.inspect(tmp_path / "model.onnx")
    assert info["kv_cache"] == {"type": "float32", "bytes_per_position": 0, "context": None}
    assert "KV cache      float32" in format_inspection(info)


def test_inspect_accepts_graphsurgeon_graphs(converted):
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(onnx.load(converted("q4_0") / "model.onnx", load_external_data=False))
    info = moepass.inspect(graph)
    assert [m["node"] for m in info["moe_nodes"]] == ["blk.0.moe", "blk.1.moe"]


def test_cli_demo_flow(tmp_path, make_gguf):
    runner = CliRunner()
    out = tmp_path / "demo"
    result = runner.invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 MoE, 8 experts, top-2" in result.stdout and "native Q4_0/Q4_0/Q4_0 in 2 layers" in result.stdout
    result = runner.invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0 and "blk.0.moe" in result.stdout
    result = runner.invoke(main, ["inspect", str(make_gguf("q4_0")), "--json"])
    assert json.loads(result.stdout)["architecture"] == "qwen3moe"
    result = runner.invoke(main, ["run", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output
    ids = [int(t) for t in result.stdout.strip().split(",")]
    assert len(ids) == 5 and ids == list(moepass.load(out).generate([1, 2, 3], 5))


def test_print_after(tmp_path, make_gguf):
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "o"), "-q",
                                       "--print-after", "lower"])
    assert result.exit_code == 0
    assert "SimplifiedLayerNormalization" in result.stdout and "SkipSimplifiedLayerNormalization" not in result.stdout
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "p"), "-q",
                                       "--print-after", "fuse-skip-norm"])
    assert "SkipSimplifiedLayerNormalization" in result.stdout
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "q"),
                                       "--print-after", "nope"])
    assert result.exit_code == 2 and not (tmp_path / "q").exists()


@pytest.mark.parametrize("preset", ["q4_k", "f32"])
def test_chunked_conversion_gives_the_same_bytes(preset, tmp_path, make_gguf, converted, monkeypatch):
    """Weights are read and packed a few rows at a time (and requantized a few rows of a chunk at a
    time); the chunking must not show in the output."""
    from moepass.core import quants
    from moepass.passes.weights import streaming

    monkeypatch.setattr(streaming, "CHUNK_BYTES", 3000)
    monkeypatch.setattr(quants, "REQUANTIZE_SLICE", 1000)
    moepass.convert(make_gguf(preset), tmp_path / "chunked", expert_format="qmoe")
    assert filecmp.cmp(tmp_path / "chunked" / "model.onnx.data", converted(preset) / "model.onnx.data", shallow=False)
    chunked = json.loads((tmp_path / "chunked" / "moepass.json").read_text())["weights"]
    whole = json.loads((converted(preset) / "moepass.json").read_text())["weights"]
    for a, b in zip(chunked, whole, strict=True):
        assert a["rel_rms_error"] == pytest.approx(b["rel_rms_error"], rel=1e-9)  # sums in another order
        assert {k: v for k, v in a.items() if k != "rel_rms_error"} == {k: v for k, v in b.items() if k != "rel_rms_error"}


def test_shipped_fixture_is_what_the_generator_writes(tmp_path):
    import make_fixtures

    fresh = make_fixtures.write_moe_gguf(tmp_path / "demo.gguf", "q4_0", make_fixtures.DEMO_DIMS, seed=0)
    assert filecmp.cmp(fresh, make_fixtures.DEMO_FIXTURE, shallow=False)
    assert make_fixtures.DEMO_FIXTURE.stat().st_size < 2 << 20


def test_the_fixture_writer_writes_a_larger_model_as_docs_usage_says(tmp_path):
    """docs/usage.md's way to a larger model to try: --dims and --layers, checked before writing."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = str(root / "fixtures" / "make_fixtures.py")
    assert "make_fixtures.py --preset q4_k_m --dims qwen3-30b --layers 2" in (root / "docs" / "usage.md").read_text()
    out = tmp_path / "big.gguf"
    done = subprocess.run([sys.executable, script, "--preset", "q4_k", "--dims", "long", "--layers", "3", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "3 layers of 512 wide" in done.stdout, done.stderr
    reader = GGUFReader(out)
    assert int(reader.fields["qwen3moe.block_count"].parts[-1][0]) == 3
    assert int(reader.fields["qwen3moe.context_length"].parts[-1][0]) == 2048
    refused = subprocess.run([sys.executable, script, "--preset", "q4_0", "--layers", "0"], capture_output=True,
                             text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode == 2 and "--layers 0: at least 1" in refused.stderr and not list(tmp_path.glob("*-test-*"))


@pytest.mark.parametrize("preset,fmt,form,errors", [("q4_0", "qmoe", "int4/b32", (0, 0)), ("q8_0", "qmoe", "int8/b32", (0, 0)),
                                                    ("q4_k", "auto", "native Q4_K/Q4_K/Q6_K", (0, 0)),
                                                    ("q4_0", "int8", "int8/b32", (0, 0)),
                                                    ("q8_0", "int4", "int4/b32", (0.03, 0.1)),
                                                    ("q4_k", "int4", "int4/b32+sums x3", (0.03, 0.1)),
                                                    ("q4_k", "qmoe", "int8/b128", (0.001, 0.02))])
def test_expert_format(preset, fmt, form, errors, tmp_path, make_gguf):
    result = moepass.convert(make_gguf(preset), tmp_path / "out", expert_format=fmt)
    assert [m["form"] for m in result.moe_layers] == [form, form]
    experts = [w for w in result.weights if ".ffn_experts." in w["onnx_name"]]
    largest = max(e for w in experts for e in w["rel_rms_error"])
    assert all(all(w["exact"]) for w in experts) == (errors == (0, 0))
    assert largest == 0 if errors == (0, 0) else errors[0] < largest < errors[1]
    logits, _ = moepass.load(tmp_path / "out").forward(np.array([[1, 2, 3]]), moepass.load(tmp_path / "out").empty_cache())
    assert np.isfinite(logits).all()


def test_expert_format_option_errors(tmp_path, make_gguf):
    with pytest.raises(moepass.MoepassError, match="expert_format must be one of auto, qmoe, int4, int8"):
        moepass.convert(make_gguf("q4_0"), tmp_path / "out", expert_format="int3")
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q8_0")), "-o", str(tmp_path / "cli"), "-q",
                                       "--expert-format", "int4"])
    assert result.exit_code == 0 and "int4/b32 in 2 layers" in result.stdout


@pytest.mark.parametrize("fmt", ["qmoe", "int4"])
def test_requantized_weights_stored_as_reported(fmt, tmp_path, make_gguf):
    """Requantized experts and matrices, unpacked from the saved model (float16 expert scales
    included), give exactly the error the report states."""
    source = make_gguf("q4_k")
    result = moepass.convert(source, tmp_path / "out", expert_format=fmt)
    reader = GGUFReader(source)
    values = {t.name: gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64) for t in reader.tensors}
    reported = {s: e for w in result.weights for s, e in zip(w["sources"], w["rel_rms_error"] or [])}
    checked = 0
    for ours, name in stored_matrices(tmp_path / "out"):
        error = np.linalg.norm(ours - values[name]) / np.linalg.norm(values[name])
        assert reported[name] == pytest.approx(error, rel=1e-4, abs=1e-12), name
        checked += error > 0
    assert checked == 2 * (3 + 1) + 2   # per layer gate, up, down and the Q6_K attn_v; the LM head, the token table


def test_activation_modes(tmp_path, make_gguf, converted):
    """Default: accuracy_level 4 (int8 activations) on every quantized matmul; --activations float: none.
    The mode is in the graph metadata, moepass.json and the summary; the weights are the same bytes."""
    fast = converted("q8_0")
    exact = moepass.convert(make_gguf("q8_0"), tmp_path / "exact", activations="float")
    for folder, level, mode in ((fast, 4, "int8"), (exact.output_dir, None, "float")):
        model = onnx.load(folder / "model.onnx", load_external_data=False)
        quantized = [n for n in model.graph.node if n.op_type in ("QMoE", "MatMulNBits")]
        assert quantized and all({a.name: a.i for a in n.attribute}.get("accuracy_level") == level for n in quantized)
        assert {p.key: p.value for p in model.metadata_props}["moepass.activations"] == mode
        assert json.loads((folder / "moepass.json").read_text())["activations"] == mode
    assert (fast / "model.onnx.data").read_bytes() == (exact.output_dir / "model.onnx.data").read_bytes()
    assert any(line.startswith("  activations   float") for line in exact.summary_lines())
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q8_0")), "-o", str(tmp_path / "bad"), "-q",
                                       "--activations", "fp8"])
    assert result.exit_code == 2 and not (tmp_path / "bad").exists()


def test_logits_to_keep(converted):
    """logits_to_keep = 0 (the default) returns every position; 1 only the last, with the same values:
    the LM head's input row is the same bits either way, so its int8 codes are too, and only the
    order in which the kernel adds the blocks' products may differ between one row and four
    (float32 rounding)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(converted("q4_0") / "model.onnx"))
    ids = np.array([[5, 77, 200, 31]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    every = session.run(["logits"], feeds)[0]
    last = session.run(["logits"], {**feeds, "logits_to_keep": np.array([1])})[0]
    assert every.shape[1] == 4 and last.shape[1] == 1
    assert_within(last[:, 0], every[:, -1], float_rounding_bound(every, stages=1), "the last position")


def test_deepened_fixture_repeats_layers_by_llamas_layer_rule(tmp_path):
    """make_fixtures.deepen_gguf (benchmarks' full-size files): layer i holds a source layer's rows,
    of the attn_v / ffn_down types llama.cpp's Q4_K_M rule gives layer i of the new depth, rotated
    by how often that source layer was used before (experts and router rows alike), so no two layers
    hold the same bytes; and the file converts."""
    import dataclasses

    import make_fixtures
    from gguf import GGMLQuantizationType as GT

    source = make_fixtures.write_moe_gguf(tmp_path / "three.gguf", "q4_k_m",
                                          dataclasses.replace(make_fixtures.TEST_DIMS, n_layers=3), seed=0)
    deep = make_fixtures.deepen_gguf(source, tmp_path / "deep.gguf", 16)
    src, out = GGUFReader(str(source)), GGUFReader(str(deep))
    assert int(out.fields["qwen3moe.block_count"].contents()) == 16
    src_tensors = {t.name: t for t in src.tensors}
    out_tensors = {t.name: t for t in out.tensors}
    assert len(out_tensors) == len(src_tensors) + 13 * sum(n.startswith("blk.0.") for n in src_tensors)
    uses = {0: 0, 1: 0, 2: 0}
    seen: dict[str, list[bytes]] = {}
    for layer in range(16):
        down = out_tensors[f"blk.{layer}.ffn_down_exps.weight"]
        assert down.tensor_type == (GT.Q6_K if make_fixtures.use_more_bits(layer, 16) else GT.Q4_K)
        source_layer = 2 if make_fixtures.use_more_bits(layer, 16) else layer % 2
        for suffix in ("attn_q.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight",
                       "attn_v.weight"):
            a, b = out_tensors[f"blk.{layer}.{suffix}"], src_tensors[f"blk.{source_layer}.{suffix}"]
            assert a.tensor_type == b.tensor_type
            assert np.array_equal(a.data, np.roll(b.data, uses[source_layer], axis=0)), (layer, suffix)
            assert a.data.tobytes() not in seen.setdefault(suffix, []), (layer, suffix)
            seen[suffix].append(a.data.tobytes())
        uses[source_layer] += 1
    assert np.array_equal(out_tensors["token_embd.weight"].data, src_tensors["token_embd.weight"].data)
    result = moepass.convert(deep, tmp_path / "out", echo=lambda _: None)
    assert result.n_layers == 16 and len(result.moe_layers) == 16


def test_an_unknown_convert_option_is_refused_naming_the_nearest(make_gguf, tmp_path):
    """convert's keywords are ConvertOptions' fields: a misspelt one is one line naming the field
    meant, before any work; an options object and keywords combine, the keywords winning."""
    from moepass.convert import convert
    from moepass.pipeline.conversion import ConvertOptions

    with pytest.raises(moepass.MoepassError, match=r"convert: no option 'expert_fromat' \(did you mean expert_format\?\)"):
        convert(make_gguf("q4_0"), tmp_path / "out", expert_fromat="int8")
    assert not (tmp_path / "out").exists()
    with pytest.raises(moepass.MoepassError, match="kv_calibration applies to kv_cache='int8'"):
        ConvertOptions(kv_calibration="text.txt")
    result = convert(make_gguf("q4_0"), tmp_path / "out", ConvertOptions(kv_cache="int8"), kv_cache="float16")
    assert result.kv_cache["type"] == "float16"
