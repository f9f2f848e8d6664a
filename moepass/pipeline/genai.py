"""genai_config.json: what onnxruntime-genai needs to load a converted model and generate from it.

The decoder's inputs and outputs are named as onnxruntime-genai expects (input_ids,
attention_mask, past_key_values.N.key/value -> logits, present.N.key/value); the KV cache is not
shared between past and present (the model's GroupQueryAttention concatenates), and the session
config entries (partition's expert offload options, when present) go into session_options, where
onnxruntime-genai passes every key it does not know to ONNX Runtime as a session config entry; a
native model's session options name moepass's kernel library (`custom_ops_library`, the path this
install built, where it built: a model moved to another machine needs its path there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnx_ir as ir

from moepass.core import keys
from moepass.core.architectures import ARCHITECTURES, HParams
from moepass.core.errors import MoepassError, wording
from moepass.core.files import GENAI_CONFIG_FILE, MODEL_FILE, read_json_object
from moepass.core.ir_values import dim
from moepass.runtime.providers import native_library


def genai_config(
    hp: HParams, model: ir.Model, tokenizer: dict[str, Any], config_entries: dict[str, str] | None = None
) -> dict[str, Any]:
    arch = model.metadata_props.get(keys.ARCHITECTURE, "")
    stop = list(tokenizer.get("stop_token_ids") or [])
    # the KV cache as the graph holds it (deepseek2: one head of the compressed latent per token)
    cache = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key").shape
    where = "the model's KV cache input past_key_values.0.key"
    session: dict[str, Any] = {"log_id": "moepass", "provider_options": []}
    library = native_library(model, strict=False)
    if library is not None:  # onnxruntime-genai registers it for the decoder's session
        session["custom_ops_library"] = library
    return with_session_entries(
        {
            "model": {
                "bos_token_id": tokenizer.get("bos_token_id") if tokenizer.get("bos_token_id") is not None else 0,
                "context_length": hp.context_length,
                "decoder": {
                    "session_options": session,
                    "filename": MODEL_FILE,
                    "head_size": dim(cache, 3, where),
                    "hidden_size": hp.hidden,
                    "inputs": {
                        "input_ids": "input_ids",
                        "attention_mask": "attention_mask",
                        "past_key_names": "past_key_values.%d.key",
                        "past_value_names": "past_key_values.%d.value",
                    },
                    "outputs": {
                        "logits": "logits",
                        "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value",
                    },
                    "num_attention_heads": hp.n_heads,
                    "num_hidden_layers": hp.n_layers,
                    "num_key_value_heads": dim(cache, 1, where),
                },
                "eos_token_id": stop if len(stop) != 1 else stop[0],
                "pad_token_id": stop[0] if stop else 0,
                "type": ARCHITECTURES[arch].genai_type if arch in ARCHITECTURES else "llama",
                "vocab_size": hp.vocab,
            },
            "search": {
                "do_sample": False,
                "max_length": hp.context_length,
                "min_length": 0,
                "num_beams": 1,
                "num_return_sequences": 1,
                "past_present_share_buffer": False,
                "repetition_penalty": 1.0,
                "temperature": 1.0,
                "top_k": 1,
                "top_p": 1.0,
            },
        },
        config_entries or {},
    )


def with_session_entries(
    config: dict[str, Any], entries: dict[str, str], label: Any = "genai_config.json", provider: str | None = None
) -> dict[str, Any]:
    """A genai config whose decoder session also gets these ONNX Runtime session config entries,
    and runs on `provider` (genai's name, e.g. "cuda": onnxruntime-genai-cuda then puts the model on
    the GPU; a CPU build is told `config.clear_providers()`)."""
    session = (
        config.get("model", {}).get("decoder", {}).get("session_options")
        if isinstance(config.get("model"), dict) and isinstance(config["model"].get("decoder"), dict)
        else None
    )
    if not isinstance(session, dict):
        raise MoepassError(f"{label}: no model.decoder.session_options object (not a genai config moepass wrote)")
    session.update({k: str(v) for k, v in entries.items()})
    if provider is not None:
        session["provider_options"] = [{provider: {}}]
    return config


GENAI_MAX_DRAFT_TOKENS = 16  # onnxruntime-genai 0.18: "speculative.max_draft_tokens must be between 1 and 16"
GENAI_NGRAM_SIZE = 3  # the context suffix its n-gram lookup matches (moepass.runtime.speculative: 3, then 2)


def check_speculation(spec: str, draft_tokens: int) -> tuple[Path | None, dict[str, Any] | None]:
    """The draft model's folder and its genai decoder entry (None, None for n-gram lookup), checked."""
    from moepass.runtime.speculative import parse

    if not 1 <= draft_tokens <= GENAI_MAX_DRAFT_TOKENS:
        raise MoepassError(
            f"{wording().option('--draft-tokens', draft_tokens)}: onnxruntime-genai takes 1 to {GENAI_MAX_DRAFT_TOKENS}"
        )
    kind, path = parse(spec)
    if kind == "ngram" or path is None:
        return None, None
    draft_dir = Path(path)
    draft_config_file = draft_dir / GENAI_CONFIG_FILE
    if not draft_config_file.is_file() or not (draft_dir / MODEL_FILE).is_file():
        raise MoepassError(
            f"{draft_dir}: not a converted model folder ({MODEL_FILE} and {GENAI_CONFIG_FILE}); "
            "the draft model is a moepass convert output"
        )
    draft = read_json_object(draft_config_file)
    model = draft.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
        raise MoepassError(f"{draft_config_file}: no model.decoder object (not a genai config moepass wrote)")
    return draft_dir, model


def with_speculation(config: dict[str, Any], spec: str, draft_tokens: int, folder: Path) -> dict[str, Any]:
    """A genai config that decodes speculatively, as onnxruntime-genai 0.18 reads it (probed): a
    top-level "speculative" object (n-gram lookup: "ngram_size"), and for a draft model its decoder
    under model.draft, whose filename is relative to `folder` (where this config will lie); a draft
    model needs the shared past/present buffer mode ("Requested length of rewind is greater than the
    current length" otherwise, at the first rejected draft)."""
    draft_dir, draft = check_speculation(spec, draft_tokens)
    config["speculative"] = {"max_draft_tokens": draft_tokens}
    if draft_dir is None or draft is None:
        config["speculative"]["ngram_size"] = GENAI_NGRAM_SIZE
        return config
    if draft.get("vocab_size") != config["model"].get("vocab_size"):
        raise MoepassError(
            f"{draft_dir}: the draft model has {draft.get('vocab_size')} tokens, the model "
            f"{config['model'].get('vocab_size')}; a draft model needs the same vocabulary"
        )
    config["model"]["draft"] = {
        **draft["decoder"],
        "filename": os.path.relpath(draft_dir.resolve() / MODEL_FILE, folder.resolve()),
    }
    config["search"]["past_present_share_buffer"] = True
    return config
