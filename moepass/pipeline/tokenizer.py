"""A tokenizer.json (Hugging Face `tokenizers`) rebuilt from a GGUF's tokenizer metadata.

- `gpt2` (byte-level BPE): the vocabulary and merges as they are; the pre-tokenizer regex that
  llama.cpp uses for the file's `tokenizer.ggml.pre` (the originals from the models' own
  tokenizer.json); byte-level decoding.
- `llama` (SentencePiece BPE): merges recovered from the vocabulary scores (a pair merges into a
  token with the rank of that token's score, as SentencePiece's BPE does), spaces as "▁", a leading
  "▁" added, byte fallback through the <0xNN> tokens.
Control and user-defined tokens become added (special) tokens. The chat template, BOS/EOS and the
stop tokens (the end-of-generation tokens as llama.cpp finds them: eog_token_ids) go to
tokenizer_config.json and moepass.json.

Tokenization is checked against llama.cpp's own tokenizer on the same file in the tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from moepass.core.errors import MoepassError, first_line
from moepass.core.gguf_reader import GGUFModel

log = logging.getLogger("moepass")

# tokenizer.ggml.pre -> the pre-tokenizer regex (from the model's original tokenizer.json, as quoted in llama.cpp)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZERS = {
    "qwen2": _QWEN2,
    "stablelm2": _QWEN2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "olmo": _GPT2,
    "mpt": _GPT2,
}
LLAMA3_PRE = {"llama-bpe", "llama3"}
IGNORE_MERGES = LLAMA3_PRE  # llama 3's tokenizer takes whole words found in the vocabulary

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# End of generation as llama.cpp decides it from the vocabulary (src/llama-vocab.cpp, the vocabulary
# loader, llama.cpp b7800 as vendored by llama-cpp-python 0.3.36): every token whose text is one of
# EOG_TEXTS; the tokens metadata names for eos (else the tokenizer model's default), eot and eom; the
# fill-in-the-middle pad, repo and file-separator tokens (metadata, else the first of FIM_EOG_TEXTS'
# texts in the vocabulary); then two exceptions (eog_token_ids).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
FIM_EOG_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# tokenizer.ggml.model -> the eos id llama.cpp assumes when the file names none (within the vocabulary)
DEFAULT_EOS = {"llama": 2, "gpt2": 11, "t5": 1, "plamo2": 2}
# gpt-oss's (and solar-open's) <|end|> closes a message, not the generation, where these are there too
_END_IS_NOT_EOG: tuple[set[str], ...] = (
    {"<|return|>", "<|call|>"}, {"<|return|>", "<|calls|>"}, {"<|call|>", "<|flush|>"}, {"<|calls|>", "<|flush|>"},
)  # fmt: skip
# where one of these is an EOG token, </s> is an ordinary token (gemma4, plamo)
_S_IS_NORMAL = ("<|tool_response>", "<|plamo:eos|>")


def eog_token_ids(tokens: list[str], kind: str | None, named: dict[str, int | None]) -> list[int]:
    """The end-of-generation tokens llama.cpp stops at, for a vocabulary `tokens` of tokenizer
    model `kind`; `named`: the ids the metadata gives (tokenizer.ggml.eos_token_id, eot_, eom_ and
    the fim_ keys), None where absent or outside the vocabulary."""
    index = {t: i for i, t in enumerate(tokens)}
    eog = {i for t, i in index.items() if t in EOG_TEXTS}
    eos = named.get("tokenizer.ggml.eos_token_id")
    if eos is None and DEFAULT_EOS.get(kind or "", len(tokens)) < len(tokens):
        eos = DEFAULT_EOS[kind or ""]
    found = [eos, named.get("tokenizer.ggml.eot_token_id"), named.get("tokenizer.ggml.eom_token_id")]
    for key, candidates in FIM_EOG_TEXTS.items():
        given = named.get(key)
        found.append(given if given is not None else next((index[t] for t in candidates if t in index), None))
    eog |= {i for i in found if i is not None}
    texts = {tokens[i] for i in eog}
    if "<|end|>" in texts and any(pair <= texts for pair in _END_IS_NOT_EOG):
        eog.discard(index["<|end|>"])
    if "</s>" in texts and any(t in texts for t in _S_IS_NORMAL):
        eog.discard(index["</s>"])
    return sorted(eog)


@dataclasses.dataclass
class TokenizerFiles:
    """What convert writes for text in / text out, or why it cannot."""

    tokenizer: Any | None  # tokenizers.Tokenizer
    config: dict[str, Any]  # tokenizer_config.json
    info: dict[str, Any]  # goes into moepass.json["tokenizer"]

    def write(self, folder: Path, tokenizer_file: str, config_file: str) -> None:
        if self.tokenizer is None:
            return
        self.tokenizer.save(str(folder / tokenizer_file), pretty=False)  # a fifth smaller than indented
        (folder / config_file).write_text(json.dumps(self.config, indent=1, sort_keys=True) + "\n")


def _token(tokens: list[str], index: int | None) -> str | None:
    return tokens[index] if index is not None else None


class _Unusable(Exception):
    """The tokenizer metadata cannot be rebuilt; the weights still convert."""


def tokenizer_from_gguf(gguf: GGUFModel) -> TokenizerFiles:
    """The tokenizer files for a GGUF, repairing what llama.cpp itself accepts (merges it can never
    apply, stop ids outside the vocabulary, keys of the wrong type) and skipping the tokenizer,
    with one warning, when it cannot be rebuilt: the weights are the product and always convert."""
    repairs: list[str] = []
    try:
        files = _tokenizer_files(gguf, repairs)
    except (_Unusable, MoepassError) as e:
        files = _skipped(gguf, str(e))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception/TypeError for bad vocabularies
        files = _skipped(gguf, f"tokenizers refused it ({first_line(e)})")
    if repairs:
        files.info["repairs"] = repairs
        log.warning(f"{gguf.path}: tokenizer repaired as llama.cpp reads it: {'; '.join(repairs)}")
    return files


def _skipped(gguf: GGUFModel, reason: str) -> TokenizerFiles:
    reason = reason.replace(f"{gguf.path}: ", "")
    log.warning(f"{gguf.path}: tokenizer skipped ({reason}); the weights are converted, run the model with token ids")
    return TokenizerFiles(None, {}, {"model": None, "reason": f"skipped: {reason}"})


def _string_list(gguf: GGUFModel, key: str) -> list[str] | None:
    values = gguf.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise _Unusable(f"metadata key '{key}' is not an array of strings")
    return values


def _optional(gguf: GGUFModel, key: str, kind: type, default: Any, repairs: list[str]) -> Any:
    """A scalar tokenizer key; one of the wrong type is ignored (llama.cpp falls back to its default too)."""
    try:
        return gguf.typed(key, kind, default)
    except MoepassError as e:
        repairs.append(f"{str(e).replace(f'{gguf.path}: ', '')}, ignored")
        return default


def _tokenizer_files(gguf: GGUFModel, repairs: list[str]) -> TokenizerFiles:
    kind = gguf.typed("tokenizer.ggml.model", str, None)
    tokens = _string_list(gguf, "tokenizer.ggml.tokens")
    info: dict[str, Any] = {"model": kind, "pre": gguf.typed("tokenizer.ggml.pre", str, None)}
    if not kind or not tokens:
        info["reason"] = "the GGUF has no tokenizer metadata"
        return TokenizerFiles(None, {}, info)
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        twice = next((seen[t], i) for i, t in enumerate(tokens) if seen.setdefault(t, i) != i)
        raise _Unusable(f"tokenizer.ggml.tokens repeats token {tokens[twice[1]]!r} (ids {twice[0]} and {twice[1]})")
    types = gguf.get("tokenizer.ggml.token_type")
    if types is not None and (
        not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types)
    ):
        repairs.append(f"tokenizer.ggml.token_type does not give one integer per token ({len(tokens)}), ignored")
        types = None
    types = list(types or [NORMAL] * len(tokens))

    def token_id(key: str) -> int | None:
        value = _optional(gguf, key, int, None, repairs)
        if value is not None and not 0 <= value < len(tokens):
            repairs.append(f"{key} {value} is outside the vocabulary ({len(tokens)} tokens), ignored")
            return None
        return value

    named = {k: token_id(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id", *FIM_EOG_TEXTS)}  # fmt: skip
    stop_ids = eog_token_ids(tokens, kind, named)
    bos, eos = token_id("tokenizer.ggml.bos_token_id"), named["tokenizer.ggml.eos_token_id"]
    info.update(
        bos_token_id=bos,
        stop_token_ids=stop_ids,
        add_bos=_optional(gguf, "tokenizer.ggml.add_bos_token", bool, _adds_bos(kind, info["pre"]), repairs),
        add_eos=_optional(gguf, "tokenizer.ggml.add_eos_token", bool, False, repairs),
    )
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(gguf, tokens, info, repairs)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(gguf, tokens, types, repairs)
    else:
        tokenizer = None
        info["reason"] = f"tokenizer model {kind!r} is not rebuilt yet (gpt2 and llama are)"
    if tokenizer is None:
        log.warning(f"{gguf.path}: tokenizer not rebuilt ({info['reason']}); run the model with token ids")
        return TokenizerFiles(None, {}, info)
    _add_special_tokens(tokenizer, tokens, types)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(tokens, bos),
        "eos_token": _token(tokens, eos),
        "add_bos_token": info["add_bos"] and bos is not None,
        "add_eos_token": info["add_eos"] and eos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": gguf.typed(f"{gguf.architecture}.context_length", int, 0),
    }
    template = _optional(gguf, "tokenizer.chat_template", str, None, repairs)
    if template:
        config["chat_template"] = template
    info["reason"] = None
    return TokenizerFiles(tokenizer, config, info)


def _adds_bos(kind: str, pre: str | None) -> bool:
    """llama.cpp's default where the GGUF has no tokenizer.ggml.add_bos_token: SentencePiece
    vocabularies add the BOS, byte-level BPE ones only for llama 3's pre-tokenizer."""
    return kind == "llama" or (kind == "gpt2" and pre in LLAMA3_PRE)


def _byte_level_bpe(gguf: GGUFModel, tokens: list[str], info: dict[str, Any], repairs: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = gguf.typed("tokenizer.ggml.pre", str, "gpt2")
    if pre not in PRE_TOKENIZERS:
        info["reason"] = f"pre-tokenizer {pre!r} is not known to moepass yet ({', '.join(sorted(PRE_TOKENIZERS))} are)"
        return None
    vocab = {t: i for i, t in enumerate(tokens)}
    merges, unusable = [], 0
    for merge in _string_list(gguf, "tokenizer.ggml.merges") or []:
        left, space, right = merge.partition(" ")
        if space and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
        else:  # llama.cpp loads these too; they can never produce a token of the vocabulary
            unusable += 1
    if unusable:
        repairs.append(
            f"{unusable} merge(s) of tokenizer.ggml.merges without a space or outside the vocabulary dropped"
        )
    model = models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(gguf: GGUFModel, tokens: list[str], types: list[int], repairs: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = gguf.get("tokenizer.ggml.scores")
    if scores is not None and (
        not isinstance(scores, list)
        or len(scores) != len(tokens)
        or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in scores)
    ):
        repairs.append(f"tokenizer.ggml.scores does not give one finite number per token ({len(tokens)}), ignored")
        scores = None
    scores = list(scores or [0.0] * len(tokens))
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
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    added = [
        AddedToken(t, special=ty == CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, USER_DEFINED)
    ]
    if added:
        tokenizer.add_tokens(added)
