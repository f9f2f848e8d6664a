"""A tokenizer.json (Hugging Face `tokenizers`) rebuilt from a GGUF's tokenizer metadata.

- `gpt2` (byte-level BPE): the vocabulary and merges as they are; the pre-tokenizer regex that
  llama.cpp uses for the file's `tokenizer.ggml.pre` (the originals from the models' own
  tokenizer.json); byte-level decoding.
- `llama` (SentencePiece BPE): merges recovered from the vocabulary scores (a pair merges into a
  token with the rank of that token's score, as SentencePiece's BPE does), spaces as "▁", a leading
  "▁" added, byte fallback through the <0xNN> tokens.
Control and user-defined tokens become added (special) tokens. The chat template, BOS/EOS and the
stop tokens go to tokenizer_config.json and moepass.json.

Tokenization is checked against llama.cpp's own tokenizer on the same file in the tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moepass.gguf_reader import GGUFModel

# tokenizer.ggml.pre -> the pre-tokenizer regex (from the model's original tokenizer.json, as quoted in llama.cpp)
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZERS = {"qwen2": _QWEN2, "stablelm2": _QWEN2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "gpt-2": _GPT2, "gpt2": _GPT2, "olmo": _GPT2, "mpt": _GPT2}
IGNORE_MERGES = {"llama-bpe", "llama3"}  # llama 3's tokenizer takes whole words found in the vocabulary

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass
class TokenizerFiles:
    """What convert writes for text in / text out, or why it cannot."""

    tokenizer: Any | None            # tokenizers.Tokenizer
    config: dict[str, Any]           # tokenizer_config.json
    info: dict[str, Any]             # goes into moepass.json["tokenizer"]

    def write(self, folder: Path, tokenizer_file: str, config_file: str) -> None:
        if self.tokenizer is None:
            return
        self.tokenizer.save(str(folder / tokenizer_file))
        (folder / config_file).write_text(json.dumps(self.config, indent=1, sort_keys=True) + "\n")


def _token(tokens: list[str], index: Any) -> str | None:
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def tokenizer_from_gguf(gguf: GGUFModel) -> TokenizerFiles:
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    info: dict[str, Any] = {"model": kind, "pre": gguf.get("tokenizer.ggml.pre")}
    if not kind or not tokens:
        info["reason"] = "the GGUF has no tokenizer metadata"
        return TokenizerFiles(None, {}, info)
    types = list(gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    stop_ids = sorted({int(gguf.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                    "tokenizer.ggml.eom_token_id") if gguf.get(k) is not None})
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    info.update(bos_token_id=bos, stop_token_ids=stop_ids,
                add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(gguf, tokens, info)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(gguf, tokens, types)
    else:
        tokenizer = None
        info["reason"] = f"tokenizer model {kind!r} is not rebuilt yet (gpt2 and llama are)"
    if tokenizer is None:
        return TokenizerFiles(None, {}, info)
    _add_special_tokens(tokenizer, tokens, types)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(tokens, bos),
        "eos_token": _token(tokens, gguf.get("tokenizer.ggml.eos_token_id")),
        "add_bos_token": info["add_bos"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.get(f"{gguf.architecture}.context_length", 0) or 0),
    }
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    info["reason"] = None
    return TokenizerFiles(tokenizer, config, info)


def _byte_level_bpe(gguf: GGUFModel, tokens: list[str], info: dict[str, Any]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(gguf.get("tokenizer.ggml.pre", "gpt2"))
    if pre not in PRE_TOKENIZERS:
        info["reason"] = f"pre-tokenizer {pre!r} is not known to moepass yet ({', '.join(sorted(PRE_TOKENIZERS))} are)"
        return None
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(gguf: GGUFModel, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = [i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED) and len(t) > 1]
    # a pair (a, b) merges with the rank of the token a+b: higher score first, then lower id
    merges = []
    for i in sorted(mergeable, key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    if added:
        tokenizer.add_tokens(added)
