"""Fixture vocabularies with the control tokens of published model families (FAMILIES), and a
fixture model made to prefer one token of its vocabulary (`preferring`): what the tests of end of
generation, of the server's tools and of terminal output run a model on."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner
from make_fixtures import rewrite_gguf, write_moe_gguf

import moepass
from moepass.cli import main
from moepass.core.gguf_reader import GGUFModel

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
