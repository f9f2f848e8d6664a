"""moepass.json: one schema (docs/design.md) for both inputs, read through one loader that refuses
what it cannot read."""

import json
import re

import pytest

import moepass
from moepass.core.files import OPTIONS_FILE, PLAN_FILE, REPORT_FILE
from moepass.core.formats import (
    PLAN_VERSION,
    REPORT_SCHEMA,
    ModelReport,
    PlanReport,
    SessionOptionsFile,
    read_plan,
    read_report,
    typed_from_json,
    write_report,
)


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


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_moepass_json_is_its_class_written_out(kind, converted, tmp_path):
    """Both of convert's routes write moepass.json through ModelReport: the file as JSON reads equals
    the read report written out again (nothing written that no field reads, nothing read lost), and
    the round trip gives the same report; a key no field reads is refused when written."""
    folder = converted("q4_0")
    if kind == "onnx":
        folder = moepass.convert(folder / "model.onnx", tmp_path / "again").output_dir
    written = json.loads((folder / REPORT_FILE).read_text())
    report = read_report(folder, required=True)
    assert written == report.to_json() and report.input == kind
    assert ModelReport.from_json(report.to_json(), folder / REPORT_FILE) == report
    assert report.stop_token_ids == tuple(written.get("tokenizer", {}).get("stop_token_ids", ()))
    with pytest.raises(moepass.MoepassError, match="'conversion_note': no field reads it"):
        write_report(tmp_path, {**written, "conversion_note": "x"})
    assert not (tmp_path / REPORT_FILE).exists()  # refused before anything was written


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


@pytest.fixture(scope="module")
def placed(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "placed"
    moepass.partition(converted("q4_0", expert_format="offload"), out, "8G", target="offload", calibrate=False,
                      kv_cache="auto")
    return out


def test_plan_json_reads_back_as_the_plan_partition_returned(converted, placed, tmp_path):
    plan = moepass.read_plan(str(placed))  # the API takes a str path as well
    assert plan == moepass.partition(converted("q4_0", expert_format="offload"), tmp_path / "again", "8G",
                                     target="offload", calibrate=False, kv_cache="auto").plan
    assert plan.version == PLAN_VERSION and plan.target == "offload" and plan.offload_active
    assert plan.kv_cache is not None and plan.kv_cache.type in plan.kv_cache.candidates
    assert sum(n.resident_count for n in plan.nodes) == sum(n.experts for n in plan.nodes) > 0
    assert all(isinstance(n.resident, tuple) for n in plan.nodes)
    assert plan.memory.resident_expert_bytes == sum(n.resident_count * n.bytes_per_expert for n in plan.nodes)
    assert plan.prediction.decode_ms_per_token.cpu_only is None and plan.prediction.cpu is None


def test_plan_json_is_its_class_written_out(placed, tmp_path):
    """plan.json holds exactly the plan's fields, as PlanReport writes them: the file as JSON reads
    (not through the reader) equals the read plan written out again, so no key is written that no
    field reads, and nothing read is lost; the round trip gives the same plan."""
    written = json.loads((placed / PLAN_FILE).read_text())
    plan = read_plan(placed)
    assert written == plan.to_json()
    assert PlanReport.from_json(plan.to_json(), placed / PLAN_FILE) == plan
    assert {"context_words", "shared_data", "lowering", "expert_regions", "active"} <= set(written)
    assert plan.context_words == "the model's" and plan.shared_data is None  # the offload form shares no data
    assert "offload" not in written or written["offload"] is None  # version 2: active and inactive_reason
    # partition's moepass.json (the conversion's, its weights and KV cache as placed) is its class's too
    assert json.loads((placed / REPORT_FILE).read_text()) == read_report(placed).to_json()


def test_onnxruntime_options_json_is_its_class_written_out(placed, tmp_path):
    """onnxruntime_options.json is SessionOptionsFile written out, read back the same; an entry that
    is not a string, or a key no field reads, is refused naming the file and the key."""
    written = json.loads((placed / OPTIONS_FILE).read_text())
    options = SessionOptionsFile.read(placed)
    assert options.placement is not None and options.placement.target == "offload"
    assert options.session_config_entries and written["session_config_entries"] == options.session_config_entries
    options.write(tmp_path)
    assert json.loads((tmp_path / OPTIONS_FILE).read_text()) == written and SessionOptionsFile.read(tmp_path) == options
    (tmp_path / OPTIONS_FILE).write_text(json.dumps({**written, "session_config_entries": {"a": 1}}))
    with pytest.raises(moepass.MoepassError, match=r"'session_config_entries.a' must be a string, found int"):
        SessionOptionsFile.read(tmp_path)
    with pytest.raises(moepass.MoepassError, match="'note': no field reads it"):  # the writer's check
        typed_from_json(SessionOptionsFile, {**written, "note": 1}, tmp_path / OPTIONS_FILE, "", strict=True)
    assert SessionOptionsFile.read(tmp_path / "absent") == SessionOptionsFile()  # no file: no entries


def test_the_plan_writer_refuses_a_key_no_field_reads(placed):
    """A key the writer adds without a field to read it is refused when written (strict), and read
    past where a newer moepass wrote it (a reader ignores what it does not know)."""
    written = json.loads((placed / PLAN_FILE).read_text())
    for extra in ({**written, "context_note": "x"},
                  {**written, "memory": {**written["memory"], "spare_bytes": 1}}):
        with pytest.raises(moepass.MoepassError, match="no field reads it"):
            PlanReport.from_json(extra, placed / PLAN_FILE, strict=True)
        assert PlanReport.from_json(extra, placed / PLAN_FILE) == read_plan(placed)


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(version=PLAN_VERSION + 1), f"plan version {PLAN_VERSION + 1}; this moepass reads versions"),
    (lambda p: p.update(format="other"), "not a moepass plan"),
    (lambda p: p["memory"].update(free_bytes="many"), "'memory.free_bytes' must be an integer, found str"),
    (lambda p: p["nodes"][0].update(resident=7), "'nodes[0].resident' must be a JSON array, found int"),
    (lambda p: p["nodes"][1].update(mass_hit_rate=True), "'nodes[1].mass_hit_rate' must be a number, found bool"),
    (lambda p: p["prediction"].pop("decode_ms_per_token"), "has no 'prediction.decode_ms_per_token'"),
    (lambda p: p["kv_cache"]["candidates"].update(float16=[]), "'kv_cache.candidates.float16' must be a JSON object"),
])
def test_a_bad_plan_field_is_refused_naming_it(placed, tmp_path, change, message):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(placed, bad)
    plan = json.loads((bad / PLAN_FILE).read_text())
    change(plan)
    (bad / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(moepass.MoepassError, match=f"^{bad / PLAN_FILE}: .*{re.escape(message)}"):
        read_plan(bad)
