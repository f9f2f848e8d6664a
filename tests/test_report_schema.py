"""moepass.json: one schema (docs/design.md) for both inputs, read through one loader that refuses
what it cannot read."""

import json

import pytest

import moepass
from moepass.core.files import REPORT_FILE, REPORT_SCHEMA, read_report


def test_both_inputs_write_the_same_schema(converted, tmp_path):
    gguf_dir = converted("q4_0")
    onnx_dir = moepass.convert(gguf_dir / "model.onnx", tmp_path / "again").output_dir
    gguf_report, onnx_report = read_report(gguf_dir, required=True), read_report(onnx_dir, required=True)
    common = {"schema", "moepass_version", "input", "source", "activations", "moe_layers", "weights"}
    assert common <= set(gguf_report.document) and common <= set(onnx_report.document)
    assert (gguf_report.schema, gguf_report.input) == (REPORT_SCHEMA, "gguf")
    assert (onnx_report.schema, onnx_report.input) == (REPORT_SCHEMA, "onnx")
    # carried over from moepass's own conversion
    assert onnx_report.document["hparams"] == gguf_report.document["hparams"]
    assert onnx_report.context_length == gguf_report.context_length == gguf_report.document["hparams"]["context_length"]
    assert onnx_report.stop_token_ids == gguf_report.stop_token_ids
    assert gguf_report.activations == onnx_report.activations == "int8"
    assert len(gguf_report.weights) == len(gguf_report.document["weights"]) > 0


def _copy_with_report(source, target, change):
    import shutil

    shutil.copytree(source, target)
    report = json.loads((target / REPORT_FILE).read_text())
    change(report)
    (target / REPORT_FILE).write_text(json.dumps(report))
    return target


def test_a_newer_schema_is_refused_by_every_reader(converted, tmp_path):
    newer = _copy_with_report(converted("q4_0"), tmp_path / "newer", lambda r: r.update(schema=REPORT_SCHEMA + 1))
    message = f"schema {REPORT_SCHEMA + 1}; this moepass reads schemas 0 to {REPORT_SCHEMA}"
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.load(newer)
    with pytest.raises(moepass.MoepassError, match=message):
        moepass.partition(newer, tmp_path / "placed", "1G")


def test_a_report_written_before_the_schema_field_still_loads(converted, tmp_path):
    older = _copy_with_report(converted("q4_0"), tmp_path / "older", lambda r: r.pop("schema"))
    assert list(moepass.load(older).generate([1, 2, 3], 3)) == list(moepass.load(converted("q4_0")).generate([1, 2, 3], 3))


def test_another_tools_report_is_not_moepass_s(tmp_path):
    (tmp_path / REPORT_FILE).write_text(json.dumps({"name": "not ours"}))
    with pytest.raises(moepass.MoepassError, match="not moepass's"):
        read_report(tmp_path)


@pytest.mark.parametrize("change,message", [
    (lambda r: r["hparams"].update(context_length=-1), "hparams.context_length must be a positive integer"),
    (lambda r: r["tokenizer"].update(stop_token_ids=["2"]), "tokenizer.stop_token_ids must be integers"),
    (lambda r: r.update(weights={"a": 1}), "'weights' must be a JSON array"),
    (lambda r: r.update(activations="int4"), "activations 'int4' is not int8 or float"),
])
def test_a_bad_field_is_refused_by_every_reader_naming_it(converted, tmp_path, change, message):
    bad = _copy_with_report(converted("q4_0"), tmp_path / "bad", change)
    for read in (lambda: moepass.load(bad), lambda: moepass.partition(bad, tmp_path / "placed", "1G"),
                 lambda: moepass.inspect(bad)):
        with pytest.raises(moepass.MoepassError, match=f"{REPORT_FILE}: .*{message}"):
            read()
