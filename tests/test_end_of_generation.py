"""Generation ends where llama.cpp's ends: at the end-of-generation tokens its vocabulary loader
finds (moepass.tokenizer.eog_token_ids), not only at the ids the file's metadata names.

The vocabularies carry the control tokens of four model families, as their published GGUFs do
(the texts of their tokenizer.json files, the tokens their chat templates in llama.cpp's
models/templates/ use); each is checked against the rule as written and, where llama-cpp-python is
installed, against llama.cpp's own llama_vocab_is_eog on the same file."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from click.testing import CliRunner
from make_fixtures import rewrite_gguf, write_moe_gguf

import moepass
from moepass.cli import main
from moepass.core.gguf_reader import GGUFModel
from moepass.tokenizer import tokenizer_from_gguf

# family -> (control tokens, the eos the metadata names, the texts that end generation)
FAMILIES = {
    "qwen3": (
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|box_start|>",
         "<|vision_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
         "</think>"),
        "<|im_end|>",
        {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"},
    ),
    "gpt-oss": (  # <|end|> closes a message: not an end of generation beside <|return|> and <|call|>
        ("<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|return|>", "<|constrain|>",
         "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
        "<|return|>",
        {"<|endoftext|>", "<|return|>", "<|call|>"},
    ),
    "llama-3": (
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
         "<|eot_id|>", "<|python_tag|>"),
        "<|eot_id|>",
        {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"},
    ),
    "gemma": (
        ("<bos>", "<pad>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
        "<eos>",
        {"<eos>", "<end_of_turn>"},
    ),
    "phi-3": (  # without <|return|> and <|call|>, <|end|> does end generation
        ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"),
        "<|endoftext|>",
        {"<|endoftext|>", "<|end|>"},
    ),
}  # fmt: skip


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


HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_generation_tokens_are_llama_cpps(family, tmp_path):
    path = _family_gguf(tmp_path, family)
    tokens = GGUFModel(path).get("tokenizer.ggml.tokens")
    ours = _ours(path)
    assert {tokens[i] for i in ours} == FAMILIES[family][2]
    if HAVE_LLAMA_CPP:
        assert ours == _llama_cpp_eog(path)


def test_without_an_eos_key_the_tokenizer_models_default_counts(tmp_path):
    """A gpt2 vocabulary whose file names no eos: llama.cpp takes id 11 (its default for the model)."""
    path = write_moe_gguf(tmp_path / "no-eos.gguf", eos_token=None)
    tokens = GGUFModel(path).get("tokenizer.ggml.tokens")
    ours = _ours(path)
    assert 11 in ours and {tokens[i] for i in ours} == {"<|endoftext|>", "<|im_end|>", tokens[11]}
    if HAVE_LLAMA_CPP:
        assert ours == _llama_cpp_eog(path)


def preferring(tmp_path, text: str, prompt_text: str = "the other one"):
    """A float copy of the fixture whose output row for the token `text` is twice the row of the
    token the model picks after `prompt_text` (a positive logit), so that the token comes first:
    (the GGUF, its conversion, the prompt's ids, the token's id)."""
    source = rewrite_gguf(write_moe_gguf(tmp_path / "q.gguf"), tmp_path / "f32.gguf")
    reader = GGUFModel(source)
    token = reader.get("tokenizer.ggml.tokens").index(text)
    runner = CliRunner()
    assert runner.invoke(main, ["convert", str(source), "-o", str(tmp_path / "plain"), "-q"]).exit_code == 0
    plain = moepass.load(tmp_path / "plain")
    prompt = plain.encode(prompt_text)
    logits = plain.forward(np.array([prompt]), plain.empty_cache())[0][0, -1]
    chosen = int(logits.argmax())
    assert logits[chosen] > 0 and chosen != token
    stored = reader.tensor("output.weight")  # F32 in the rewritten file
    output = stored.read_rows().view(np.float32).reshape(stored.shape).copy()
    output[token] = 2.0 * output[chosen]
    boosted = rewrite_gguf(source, tmp_path / "boosted.gguf", {"output.weight": output})
    assert runner.invoke(main, ["convert", str(boosted), "-o", str(tmp_path / "out"), "-q"]).exit_code == 0
    return boosted, tmp_path / "out", prompt, token


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
    if HAVE_LLAMA_CPP:
        import llama_cpp

        llm = llama_cpp.Llama(str(ends), n_ctx=64, n_threads=2, verbose=False)
        try:
            completion = llm.create_completion(prompt, max_tokens=16, temperature=0.0)
        finally:
            llm.close()
        assert completion["choices"][0]["finish_reason"] == "stop"
        assert completion["usage"]["completion_tokens"] == 0
