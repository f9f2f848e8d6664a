"""Hostile input: one clear error line naming what is wrong, exit code 2, nothing at the output path."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as GT, GGUFReader

import make_fixtures
from moepass.cli import main

OUTPUT_FILES = ["genai_config.json", "model.onnx", "model.onnx.data", "moepass.json", "tokenizer.json",
                "tokenizer_config.json"]


def _convert_fails(gguf: Path, out: Path, *must_contain: str) -> str:
    result = CliRunner().invoke(main, ["convert", str(gguf), "-o", str(out), "-q"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moepass: error: "), result.stderr
    print(lines[0])
    for text in must_contain:
        assert text in lines[0], lines[0]
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "temporary output left behind"
    return lines[0]


def _copy(src: Path, dst: Path, truncate_to: int | None = None) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data if truncate_to is None else data[:truncate_to])
    return dst


def _offset_in_file(reader: GGUFReader, part: np.ndarray) -> int:
    return int(part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0])


def test_wrong_magic(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    _convert_fails(bad, tmp_path / "out", str(bad), "not a GGUF file")


def test_not_a_file(tmp_path):
    _convert_fails(tmp_path / "missing.gguf", tmp_path / "out", "missing.gguf")


def test_truncated_header(tmp_path, make_gguf):
    bad = _copy(make_gguf("q4_0"), tmp_path / "cut.gguf", truncate_to=200)
    _convert_fails(bad, tmp_path / "out", "cut.gguf", "truncated or malformed GGUF")


def test_tensor_data_past_end_of_file(tmp_path, make_gguf):
    src = make_gguf("q4_0")
    bad = _copy(src, tmp_path / "short.gguf", truncate_to=src.stat().st_size - 100)
    _convert_fails(bad, tmp_path / "out", "short.gguf", "tensor 'output.weight'", "past the end of the file")


def test_truncated_in_the_middle(tmp_path, make_gguf):
    src = make_gguf("q4_0")
    bad = _copy(src, tmp_path / "half.gguf", truncate_to=src.stat().st_size // 2)
    _convert_fails(bad, tmp_path / "out", "half.gguf", "past the end of the file")


def test_absurd_dimensions(tmp_path, make_gguf):
    bad = _copy(make_gguf("q4_0"), tmp_path / "huge.gguf")
    reader = GGUFReader(bad)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    dims = tensor.field.parts[3]
    offset = _offset_in_file(reader, dims)
    del reader
    data = bytearray(bad.read_bytes())
    data[offset + 16: offset + 24] = np.uint64(1 << 45).tobytes()  # the expert-count dimension
    bad.write_bytes(bytes(data))
    _convert_fails(bad, tmp_path / "out", "tensor 'blk.0.ffn_up_exps.weight'", "absurd dimensions")


def test_unknown_architecture(tmp_path, make_gguf):
    bad = make_gguf("q4_0", arch_label="llama9moe")
    _convert_fails(bad, tmp_path / "out", "unknown architecture 'llama9moe'", "qwen3moe")


def test_unsupported_quant_type(tmp_path, make_gguf):
    bad = make_gguf("q4_0", types={"gate_up": GT.TQ2_0})
    _convert_fails(bad, tmp_path / "out", "tensor 'blk.0.ffn_gate_exps.weight'", "type TQ2_0")


def test_missing_metadata_key(tmp_path, make_gguf):
    bad = make_gguf("q4_0", omit_keys=("qwen3moe.attention.layer_norm_rms_epsilon",))
    _convert_fails(bad, tmp_path / "out", "missing metadata key 'qwen3moe.attention.layer_norm_rms_epsilon'")


def test_missing_tensor(tmp_path, make_gguf):
    bad = make_gguf("q4_0", omit_tensors=("blk.1.attn_k_norm.weight",))
    _convert_fails(bad, tmp_path / "out", "missing tensor 'blk.1.attn_k_norm.weight'")


def test_mixed_float_and_quantized_experts(tmp_path, make_gguf):
    bad = make_gguf("q4_0", types={"down": GT.F16})
    _convert_fails(bad, tmp_path / "out", "'blk.0.ffn_down_exps.weight' is F16", "--float-experts")


def test_unwritable_output_path(tmp_path, make_gguf):
    _convert_fails(make_gguf("q4_0"), Path("/proc/moepass-out"), "/proc/moepass-out", "cannot write")


def test_existing_output_is_not_overwritten(tmp_path, make_gguf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q"])
    assert result.exit_code == 2 and "already exists; pass --force" in result.stderr
    assert (out / "mine.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1
    # --force replaces only what moepass wrote: a folder holding the user's file stays as it is
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q", "--force"])
    assert result.exit_code == 2 and "it holds 'mine.txt', which moepass does not write" in result.stderr
    assert (out / "mine.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1
    (out / "mine.txt").unlink()
    for _ in range(2):  # into the empty folder, then over moepass's own output
        result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q", "--force"])
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in out.iterdir()) == OUTPUT_FILES
    assert not list(tmp_path.glob(".out.*"))


def test_the_api_names_its_keyword_and_the_cli_its_flag(tmp_path, make_gguf, converted, monkeypatch):
    """An output in the way: the Python API says `overwrite=True` (its keyword), the CLI --force and
    -o (its flags) as it always has; check_destination takes the wording its caller gives."""
    import moepass
    from moepass.pipeline.atomic import atomic_file, check_destination
    from moepass.core.errors import API_WORDING, CLI_WORDING, MoepassError

    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    gguf = make_gguf("q4_0")
    calls = [(lambda: moepass.convert(gguf, out), "already exists; pass overwrite=True to replace it"),
             (lambda: moepass.convert(gguf, out, overwrite=True), "overwrite=True replaces only a folder that"),
             (lambda: moepass.partition(converted("q4_0"), out, "8G"), "pass overwrite=True to replace it"),
             (lambda: check_destination(out / "mine.txt", False, is_dir=True), "name another output path"),
             (lambda: atomic_file(out / "mine.txt").__enter__(), "pass overwrite=True to replace it")]
    for call, says in calls:
        with pytest.raises(MoepassError) as refused:
            call()
        assert says in str(refused.value) and "--force" not in str(refused.value), str(refused.value)
    with pytest.raises(MoepassError, match="already exists; pass --force to replace it$"):
        check_destination(out, False, is_dir=True, words=CLI_WORDING)
    with pytest.raises(MoepassError, match="name another -o$"):
        check_destination(out / "mine.txt", False, is_dir=True, words=CLI_WORDING)
    said = CliRunner().invoke(main, ["convert", str(gguf), "-o", str(out), "-q"]).stderr
    assert said.strip() == f"moepass: error: {out}: already exists; pass --force to replace it", said
    forced = CliRunner().invoke(main, ["convert", str(gguf), "-o", str(out), "-q", "--force"]).stderr
    assert "--force replaces only a folder that moepass wrote" in forced and "overwrite=True" not in forced
    with pytest.raises(MoepassError, match="pass overwrite=True"):  # the CLI's wording ended with its run
        check_destination(out, False, is_dir=True)
    assert (out / "mine.txt").read_text() == "keep me" and API_WORDING.overwrite == "overwrite=True"


def test_failure_while_writing_leaves_nothing(tmp_path, make_gguf):
    """A tensor that turns out unreadable only when its bytes are read (file shrunk after indexing)."""
    from moepass import convert
    from moepass.core.errors import MoepassError
    from moepass.core.gguf_reader import GGUFModel

    src = _copy(make_gguf("q4_0"), tmp_path / "shrinks.gguf")
    original_init = GGUFModel.__init__

    def init_then_shrink(self, path, **kwargs):
        original_init(self, path, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(Path(path).stat().st_size // 2)

    out = tmp_path / "out"
    GGUFModel.__init__ = init_then_shrink
    try:
        with pytest.raises(MoepassError, match="past the end of the file"):
            convert(src, out)
    finally:
        GGUFModel.__init__ = original_init
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_run_errors(tmp_path, converted):
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(tmp_path / "nothing"), "--prompt-ids", "1,2"])
    assert result.exit_code == 2 and "nothing: no such file or directory" in result.stderr
    for bad in ("1,x", "1;2", "-1,2", "1.5", "+3", ",", "\u0663"):  # \u0663: an Arabic-Indic three, int() takes it
        result = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", bad])
        assert result.exit_code == 2 and "--prompt-ids: expected token ids separated by commas or spaces" in \
            result.stderr, (bad, result.stderr)
    # commas and whitespace as in an ids file: "1 2 3" is three tokens, not 123
    spaced = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", "1 2  3", "--max-new-tokens", "3"])
    commas = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", "1, 2,3", "--max-new-tokens", "3"])
    assert spaced.exit_code == commas.exit_code == 0 and spaced.stdout == commas.stdout
    result = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", "1,99999"])
    assert result.exit_code == 2 and "token id 99999 is outside the vocabulary" in result.stderr


def test_inspect_errors(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope.gguf")])
    assert result.exit_code == 2 and "no such file" in result.stderr
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff" * 64)
    result = CliRunner().invoke(main, ["inspect", str(junk)])
    assert result.exit_code == 2 and "not a readable ONNX model" in result.stderr


def test_tensor_shape_disagrees_with_metadata(tmp_path, make_gguf):
    bad = make_gguf("q4_0", dims=dataclasses.replace(make_fixtures.TEST_DIMS, expert_ff=128))
    # the file says expert_feed_forward_length 128 and carries 128-row experts: fine; now lie about it
    patched = tmp_path / "lie.gguf"
    data = bad.read_bytes()
    key = b"qwen3moe.expert_feed_forward_length"
    at = data.index(key) + len(key) + 4  # skip the value type (uint32)
    patched.write_bytes(data[:at] + np.uint32(256).tobytes() + data[at + 4:])
    _convert_fails(patched, tmp_path / "out", "tensor 'blk.0.ffn_gate_exps.weight' has shape [8, 128, 256]",
                   "expected [8, 256, 256]")


def test_outputs_are_checked_before_any_work(converted, make_gguf, tmp_path, monkeypatch):
    """An output that exists (without --force) is refused before the work starts, not after it."""
    import sys

    import moepass.convert  # noqa: F401 - the modules (moepass.convert etc. name the API functions)
    import moepass.partition  # noqa: F401
    import moepass.profile  # noqa: F401

    def no_work(*args, **kwargs):
        raise AssertionError("the work started before the output was checked")

    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    monkeypatch.setattr(sys.modules["moepass.profile"], "profile", no_work)
    monkeypatch.setattr(sys.modules["moepass.partition"], "load_model", no_work)
    monkeypatch.setattr(sys.modules["moepass.pipeline.conversion"], "GGUFModel", no_work)
    model = str(converted("q4_0"))
    runner = CliRunner()
    for args in (["profile", model, "--prompt-ids", "1,2,3", "-o", str(taken)],
                 ["merge-profiles", str(taken), str(taken), "-o", str(taken)],
                 ["partition", model, "--vram", "8G", "-o", str(tmp_path / "taken")],
                 ["partition", model, "--vram", "8G", "-o", str(tmp_path / "new"), "--report", str(taken.with_suffix(".png"))],
                 ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "taken")]):
        if args[-1].endswith(".png"):
            taken.with_suffix(".png").write_bytes(b"picture")
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and "already exists; pass --force" in result.stderr, (args, result.output)
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep"


def test_missing_parent_folders_are_made_and_removed_on_failure(make_gguf, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "a" / "b" / "out"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "b" / "out" / "model.onnx").is_file()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(make_gguf("q4_0").read_bytes()[:4096])
    result = runner.invoke(main, ["convert", str(broken), "-o", str(tmp_path / "c" / "d" / "out"), "-q"])
    assert result.exit_code == 2 and not (tmp_path / "c").exists(), result.output
