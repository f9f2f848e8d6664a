"""Models that convert writes from ONNX input, at run time (issue 27, point 4): one without a KV
cache but with a free sequence axis generates (the whole sequence each step), one with a fixed
input shape (torch's exporter traces one) is refused at load naming the input, as is an input
moepass does not feed; GGUF-only options are refused for ONNX input rather than ignored."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import moepass
from moepass.cli import main

VOCAB, WIDTH = 50, 16


def _tiny_lm(path, sequence="sequence", extra_input=None, mask=True):
    """input_ids [1, S] -> embedding -> one matrix -> logits [1, S, VOCAB]; the last position also
    sees the mean of the earlier ones (cumulative sum / count), so that the prefix matters."""
    rng = np.random.default_rng(0)
    embed = numpy_helper.from_array(rng.normal(size=(VOCAB, WIDTH)).astype(np.float32), "embed")
    head = numpy_helper.from_array(rng.normal(size=(WIDTH, VOCAB)).astype(np.float32), "head")
    axis = numpy_helper.from_array(np.array(1, dtype=np.int64), "axis")
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
             helper.make_node("CumSum", ["x", "axis"], ["running"]),
             helper.make_node("Add", ["x", "running"], ["mixed"]),
             helper.make_node("MatMul", ["mixed", "head"], ["logits"])]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, sequence])]
    if mask:  # an attention mask the graph takes (and ignores, as a mask of ones would be)
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "total"]))
    if extra_input:
        inputs.append(helper.make_tensor_value_info(extra_input, TensorProto.FLOAT, [1]))
    graph = helper.make_graph(nodes, "tiny", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, sequence, VOCAB])],
                              [embed, head, axis])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path, numpy_helper.to_array(embed), numpy_helper.to_array(head)


def _greedy(embed, head, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        x = embed[ids]
        ids.append(int(np.argmax((x[-1] + x.sum(0)) @ head)))
    return ids[len(prompt):]


def test_a_model_without_a_kv_cache_generates(tmp_path):
    source, embed, head = _tiny_lm(tmp_path / "lm.onnx")
    out = moepass.convert(source, tmp_path / "out").output_dir
    decoder = moepass.load(out)
    prompt = [3, 1, 4, 1, 5]
    assert list(decoder.generate(prompt, 8)) == _greedy(embed, head, prompt, 8)
    result = CliRunner().invoke(main, ["run", str(out), "--prompt-ids", "3,1,4,1,5", "-n", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == ",".join(map(str, _greedy(embed, head, prompt, 8)))
    bench = CliRunner().invoke(main, ["bench", str(out), "-p", "8", "-n", "4", "-r", "1"])
    assert bench.exit_code == 0, bench.output
    no_mask, *_ = _tiny_lm(tmp_path / "bare.onnx", mask=False)
    assert list(moepass.load(moepass.convert(no_mask, tmp_path / "bare").output_dir).generate(prompt, 8)) == \
        _greedy(embed, head, prompt, 8)


def test_a_traced_export_is_refused_at_load_naming_its_fixed_input(exported, tmp_path):
    """torch's exporter traces input_ids [1, 64] -> logits (no KV cache): run, bench and profile say
    so at load, instead of failing inside ONNX Runtime on an input moepass would feed it."""
    out = moepass.convert(exported("qwen3moe"), tmp_path / "q3onnx").output_dir
    says = "input_ids has the fixed shape [1, 64] and the model has no KV cache: it computes exactly 64 tokens"
    for command in (["run", str(out), "--prompt-ids", "1,2,3"], ["bench", str(out)],
                    ["profile", str(out), "--prompt-ids", "1,2", "-o", str(tmp_path / "p.json")]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2 and says in result.stderr and "Traceback" not in result.stderr, result.output
    assert moepass.partition(out, tmp_path / "placed", "8G").plan.nodes  # planning needs no session


def test_an_input_moepass_does_not_feed_is_named_at_load(tmp_path):
    source, *_ = _tiny_lm(tmp_path / "lm.onnx", extra_input="temperature")
    out = moepass.convert(source, tmp_path / "out").output_dir
    for command in (["run", str(out), "--prompt-ids", "1,2"], ["bench", str(out)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "the model needs the input 'temperature', which moepass does not feed" in result.stderr


@pytest.mark.parametrize("option", [["--expert-format", "offload"], ["--exact"], ["--context", "64"]])
def test_gguf_options_are_refused_for_onnx_input(option, tmp_path):
    source, *_ = _tiny_lm(tmp_path / "lm.onnx")
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(tmp_path / "out"), *option])
    assert result.exit_code == 2 and f"{option[0]} applies to GGUF input" in result.stderr
    assert not (tmp_path / "out").exists()
