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
    assert common <= set(gguf_report) and common <= set(onnx_report)
    assert (gguf_report["schema"], gguf_report["input"]) == (REPORT_SCHEMA, "gguf")
    assert (onnx_report["schema"], onnx_report["input"]) == (REPORT_SCHEMA, "onnx")
    assert onnx_report["hparams"] == gguf_report["hparams"]  # carried over from moepass's own conversion


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
