"""moepass profile: routing counts against the numpy reference, the file format, merging, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import moepass
from moepass.cli import main
from moepass.pipeline.popularity import Popularity
from moepass.profile import profile, read_prompts
from support.reference_forward import Qwen3MoeReference

PROMPTS = [[5, 77, 200, 13, 99, 150, 7, 260], [31, 42, 318, 1, 64], [128, 3, 17, 250, 64, 9, 300, 120, 45]]


def test_counts_match_the_reference_routing(make_gguf, converted):
    result = profile(converted("f32"), PROMPTS)
    ref = Qwen3MoeReference(make_gguf("f32"))
    expected = {f"blk.{i}.moe": np.zeros(8, np.int64) for i in range(2)}
    for prompt in PROMPTS:
        for layer, chosen in enumerate(ref.forward(prompt)[1]):
            expected[f"blk.{layer}.moe"] += np.bincount(chosen.ravel(), minlength=8)
    tokens = sum(len(p) for p in PROMPTS)
    assert result.tokens == tokens and result.prompts == len(PROMPTS)
    for node, counts in expected.items():
        np.testing.assert_array_equal(result.selected[node], counts)
        assert result.selected[node].sum() == tokens * 2
        assert result.weight[node].sum() == pytest.approx(tokens)    # qwen3moe renormalizes over the top-k
        assert result.mass(node).sum() == pytest.approx(1.0)


def test_file_round_trip_and_merge(tmp_path, converted):
    a = profile(converted("q4_0"), PROMPTS[:2])
    b = profile(converted("q4_0"), PROMPTS[2:])
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    data = json.loads((tmp_path / "a.json").read_text())
    assert data["format"] == "moepass-popularity" and data["version"] == 1
    assert [n["node"] for n in data["model"]["moe_nodes"]] == ["blk.0.moe", "blk.1.moe"]
    merged = Popularity.load(tmp_path / "a.json").merge(Popularity.load(tmp_path / "b.json"))
    whole = profile(converted("q4_0"), PROMPTS)
    assert merged.tokens == whole.tokens and merged.prompts == 3
    for node in whole.selected:
        np.testing.assert_array_equal(merged.selected[node], whole.selected[node])
        np.testing.assert_allclose(merged.weight[node], whole.weight[node], rtol=1e-12)
    with pytest.raises(moepass.MoepassError, match="already exists"):
        a.save(tmp_path / "a.json")


def test_profiles_of_different_models_do_not_mix(make_gguf, converted, tmp_path):
    import make_fixtures

    ours = profile(converted("q4_0"), PROMPTS[:1])
    other_dir = tmp_path / "demo"
    moepass.convert(make_fixtures.DEMO_FIXTURE, other_dir)
    theirs = profile(other_dir, PROMPTS[:1])
    theirs.save(tmp_path / "theirs.json")
    with pytest.raises(moepass.MoepassError, match="different models cannot be merged"):
        ours.merge(theirs, "theirs.json")
    # the same model in another quantization shares the fingerprint
    assert profile(converted("q8_0"), PROMPTS[:1]).fingerprint == ours.fingerprint


def test_cli_profile_and_merge(tmp_path, converted):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# calibration\n5, 77, 200\n\n31 42 318 1\n")
    runner = CliRunner()
    result = runner.invoke(main, ["profile", str(converted("q4_0")), "--prompts", str(prompts), "--prompts-format",
                                  "ids", "-o", str(tmp_path / "p1.json"), "-q"])
    assert result.exit_code == 0, result.output
    assert "profiled 7 tokens (2 prompts)" in result.stdout and "experts never selected in" in result.stdout
    result = runner.invoke(main, ["profile", str(converted("q4_0")), "--prompt-ids", "1,2,3", "-o",
                                  str(tmp_path / "p2.json"), "-q"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["merge-profiles", str(tmp_path / "p1.json"), str(tmp_path / "p2.json"),
                                  "-o", str(tmp_path / "all.json")])
    assert result.exit_code == 0 and Popularity.load(tmp_path / "all.json").tokens == 10


def test_cli_profile_takes_a_gguf_through_run_s_cache(tmp_path, make_gguf, converted):
    """`moepass profile F.gguf` as llama-imatrix takes it: converted once into the cache run uses (said
    in one line), the popularity that of the converted folder, and the same entry used by run."""
    runner = CliRunner()
    cache = tmp_path / "cache"
    result = runner.invoke(main, ["profile", str(make_gguf("q4_0")), "--prompt-ids", "1,2,3", "-o",
                                  str(tmp_path / "p.json"), "--cache-dir", str(cache), "-q"])
    assert result.exit_code == 0, result.output
    assert "converted with the defaults" in result.stderr, result.stderr
    from_gguf = Popularity.load(tmp_path / "p.json")
    from_folder = profile(converted("q4_0"), [[1, 2, 3]])
    assert from_gguf.fingerprint == from_folder.fingerprint and from_gguf.tokens == 3
    assert {k: v.tolist() for k, v in from_gguf.selected.items()} == {
        k: v.tolist() for k, v in from_folder.selected.items()}
    result = runner.invoke(main, ["run", str(make_gguf("q4_0")), "--prompt-ids", "1,2", "-n", "1",
                                  "--cache-dir", str(cache)])
    assert result.exit_code == 0 and "converted with the defaults" not in result.stderr, result.output


@pytest.mark.parametrize("content,message", [
    ("1,2,x\n", "prompts.txt:1: expected token ids"),
    ("# nothing\n\n", "no prompts in the file"),
])
def test_bad_prompts_files(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    path.write_text(content)
    with pytest.raises(moepass.MoepassError, match=message):
        read_prompts(path, "ids")


def test_text_prompts_are_the_default(tmp_path, converted):
    """Prompts are text by default, one per line, tokenized as `run` does; JSONL takes text or ids;
    --chat wraps each in the chat template; the summary says which experts no prompt reached."""
    from moepass.runtime import load

    decoder = load(converted("q4_0"))
    lines = ["the other one", "", "she is here, there and then"]
    path = tmp_path / "calib.txt"
    path.write_text("\n".join(lines) + "\n")
    assert read_prompts(path) == ["the other one", "she is here, there and then"]
    ids = [decoder.encode(t) for t in read_prompts(path)]
    as_text, as_ids = profile(converted("q4_0"), read_prompts(path)), profile(converted("q4_0"), ids)
    assert as_text.tokens == sum(map(len, ids)) and as_text.to_json() == as_ids.to_json()
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text('"the other one"\n{"text": "she is here, there and then"}\n{"ids": [5, 77]}\n[1, 2]\n')
    assert read_prompts(jsonl, "jsonl") == ["the other one", "she is here, there and then", [5, 77], [1, 2]]
    chat = profile(converted("q4_0"), ["the other one"], chat=True)
    assert chat.tokens == len(decoder.encode(decoder.apply_chat_template("the other one")))
    runner = CliRunner()
    result = runner.invoke(main, ["profile", str(converted("q4_0")), "--prompts", str(path), "-o",
                                  str(tmp_path / "p.json"), "-q"])
    assert result.exit_code == 0, result.output
    assert f"profiled {as_text.tokens} tokens (2 prompts)" in result.stdout
    assert as_text.coverage_line() in result.stdout
    with pytest.raises(moepass.MoepassError, match="a list of prompts"):
        profile(converted("q4_0"), "the other one")
    with pytest.raises(moepass.MoepassError, match="calib.jsonl:1: expected a string"):
        jsonl.write_text('{"tokens": 3}\n')
        read_prompts(jsonl, "jsonl")


def test_coverage_line():
    pop = Popularity.empty({"moe_nodes": []})
    pop.selected = {"blk.0.moe": np.array([3, 0, 1, 0]), "blk.1.moe": np.array([1, 1, 1, 1])}
    assert pop.never_selected() == {"blk.0.moe": 2, "blk.1.moe": 0}
    assert pop.coverage_line().startswith("experts never selected in 1 of 2 MoE layers: blk.0.moe 2 of 4")
    pop.selected["blk.0.moe"][:] = 1
    assert pop.coverage_line() == "every expert of every MoE layer was selected at least once"


@pytest.mark.parametrize("content,message", [
    ("{not json", "invalid JSON"),
    ('{"format": "something-else"}', "not a popularity file"),
    ('{"format": "moepass-popularity", "version": 99}', "version 99 is not supported"),
    ('{"format": "moepass-popularity", "version": 1, "model": {"moe_nodes": [{"node": "a", "experts": 2}]}, '
     '"nodes": {"a": {"selected": [1], "weight": [1.0]}}, "tokens": 1}', "malformed popularity file"),
])
def test_bad_popularity_files(tmp_path, content, message):
    path = tmp_path / "pop.json"
    path.write_text(content)
    with pytest.raises(moepass.MoepassError, match=message):
        Popularity.load(path)


def test_cli_profile_errors(tmp_path, converted):
    runner = CliRunner()
    out = tmp_path / "p.json"
    result = runner.invoke(main, ["profile", str(converted("q4_0")), "-o", str(out)])
    assert result.exit_code == 2 and "exactly one of --prompts FILE or --prompt-ids" in result.stderr
    result = runner.invoke(main, ["profile", str(converted("q4_0")), "--prompt-ids", "1,5000", "-o", str(out), "-q"])
    assert result.exit_code == 2 and "token id 5000 is outside the vocabulary" in result.stderr
    result = runner.invoke(main, ["profile", str(tmp_path), "--prompt-ids", "1", "-o", str(out), "-q"])
    assert result.exit_code == 2 and "not a converted model (no model.onnx in it" in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".p.json.tmp-*"))
