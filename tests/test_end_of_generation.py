"""Generation ends where llama.cpp's ends: at the end-of-generation tokens its vocabulary loader
finds (moepass.pipeline.tokenizer.eog_token_ids), not only at the ids the file's metadata names.

The vocabularies (tests/support/vocabularies.py) carry the control tokens of five model families,
as their published GGUFs do (the texts of their tokenizer.json files, the tokens their chat
templates in llama.cpp's models/templates/ use); each is checked against the rule as written and,
where llama-cpp-python is installed, against llama.cpp's own llama_vocab_is_eog on the same file."""

from __future__ import annotations


import pytest
from click.testing import CliRunner
from make_fixtures import write_moe_gguf
from support.vocabularies import FAMILIES, preferring

import moepass
from moepass.cli import main
from moepass.core.gguf_reader import GGUFModel
from moepass.pipeline.tokenizer import tokenizer_from_gguf


def _family_gguf(tmp_path, family: str):
    specials, eos, _ = FAMILIES[family]
    return write_moe_gguf(tmp_path / f"{family}.gguf", special_tokens=specials, eos_token=eos)


def _ours(path) -> list[int]:
    return tokenizer_from_gguf(GGUFModel(path)).info["stop_token_ids"]


def _llama_cpp_eog(path) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        return [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    finally:
        llm.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_generation_tokens_are_the_familys_own(family, tmp_path):
    path = _family_gguf(tmp_path, family)
    tokens = GGUFModel(path).get("tokenizer.ggml.tokens")
    assert {tokens[i] for i in _ours(path)} == FAMILIES[family][2]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_generation_tokens_are_llama_cpps(family, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    path = _family_gguf(tmp_path, family)
    assert _ours(path) == _llama_cpp_eog(path)


def test_without_an_eos_key_the_tokenizer_models_default_counts(tmp_path):
    """A gpt2 vocabulary whose file names no eos: llama.cpp takes id 11 (its default for the model)."""
    path = write_moe_gguf(tmp_path / "no-eos.gguf", eos_token=None)
    tokens = GGUFModel(path).get("tokenizer.ggml.tokens")
    ours = _ours(path)
    assert 11 in ours and {tokens[i] for i in ours} == {"<|endoftext|>", "<|im_end|>", tokens[11]}


def test_without_an_eos_key_the_tokens_are_llama_cpps(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    path = write_moe_gguf(tmp_path / "no-eos.gguf", eos_token=None)
    assert _ours(path) == _llama_cpp_eog(path)


def test_generation_stops_at_endoftext_as_in_llama_cpp(tmp_path):
    """The fixture's metadata names <|im_end|> as eos; made to prefer <|endoftext|>, llama.cpp
    stops at once, and so do the API and `run`."""
    ends, out, prompt, end = preferring(tmp_path, "<|endoftext|>")
    assert end != GGUFModel(ends).get("tokenizer.ggml.eos_token_id")
    decoder = moepass.load(out)
    assert end in decoder.stop_ids
    assert list(decoder.generate(prompt, 16)) == [end]  # the stop token is the last one given
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", "the other one", "-n", "16"])
    assert result.exit_code == 0 and "ended by the stop token" in result.stderr, result.output


def test_llama_cpp_stops_at_once_at_the_preferred_endoftext(tmp_path):
    """The oracle of the test above: llama.cpp on the same file ends the same prompt at once."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the oracle) is not installed")
    ends, _, prompt, _ = preferring(tmp_path, "<|endoftext|>")
    llm = llama_cpp.Llama(str(ends), n_ctx=64, n_threads=2, verbose=False)
    try:
        completion = llm.create_completion(prompt, max_tokens=16, temperature=0.0)
    finally:
        llm.close()
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert completion["usage"]["completion_tokens"] == 0
