"""The Decoder: an ONNX Runtime session over a converted model, its tokenizer and chat template,
and generation through a KV cache (`moepass.runtime.kv_cache`) with llama.cpp's sampling
(`moepass.runtime.sampling`)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moepass.core import keys
from moepass.core.choices import one_of
from moepass.core.errors import MoepassError, first_line, wording
from moepass.core.files import LOGITS_TO_KEEP, OPTIONS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, read_json_object
from moepass.core.formats import SessionOptionsFile, read_report
from moepass.core.model_io import load_model, model_file
from moepass.core.onnx_format import stamp
from moepass.runtime import speculative
from moepass.runtime.chat_template import ChatTemplate
from moepass.runtime.host_memory import check_fits
from moepass.runtime.kv_cache import Cache, KVCache
from moepass.runtime.providers import (
    CPU_EP,
    SessionPlan,
    check_layer_placement,
    log,
    node_placement,
    plan_session,
    provider_in_effect,
    register_native_kernels,
)
from moepass.runtime.sampling import Sampling, StopStrings, choose_token

if TYPE_CHECKING:
    import onnx_ir

    from moepass.runtime.speculative import Speculator


def _import_onnxruntime():
    both = installed_onnxruntimes()
    if len(both) > 1:  # one module, two packages: whichever unpacked last, half of the other's files
        raise MoepassError(
            f"{' and '.join(both)} are both installed: they install the same onnxruntime module, which "
            "then belongs to neither; pip uninstall -y onnxruntime onnxruntime-gpu, then install one: "
            "pip install 'moepass[cpu]' or 'moepass[gpu]' (docs/gpu.md)"
        )
    try:
        import onnxruntime
    except ImportError:
        raise MoepassError("onnxruntime is not installed: pip install 'moepass[cpu]' (or [gpu])") from None
    return onnxruntime


def installed_onnxruntimes() -> list[str]:
    """The ONNX Runtime packages installed beside moepass (onnxruntime, onnxruntime-gpu), each with
    its version: there must be one."""
    from importlib import metadata

    found = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return found


class Decoder:
    """An ONNX Runtime session over a converted decoder, with its KV-cache bookkeeping."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        device: str = "auto",
        threads: int | None = None,
        graph: onnx_ir.Model | None = None,
        cuda_plugin: str | None = None,
        mode: str | None = None,
        profile_prefix: str | None = None,
    ):
        """`graph`: run this in-memory variant of the model (e.g. a profiling copy) with the weights
        of `model_dir`'s data file instead of `model_dir`'s own model.onnx. `profile_prefix`: record
        ONNX Runtime's per-node profile (`session.end_profiling()` writes it under this prefix)."""
        import onnx_ir

        ort = _import_onnxruntime()
        self.model_dir = Path(model_dir)
        model_path = model_file(self.model_dir)
        folder = model_path.parent
        self.report = read_report(folder)
        options_file = SessionOptionsFile.read(folder)
        option_entries = options_file.session_config_entries
        placement_mode = options_file.placement.mode if options_file.placement is not None else None
        if placement_mode is not None:
            one_of(placement_mode, keys.OFFLOAD_MODES, f"{folder / OPTIONS_FILE}: placement.mode")
        structure = graph if graph is not None else load_model(model_path)
        self.plan: SessionPlan = plan_session(ort, structure, option_entries, device, cuda_plugin, mode, placement_mode)
        if self.plan.provider == CPU_EP:  # every MoE node's experts are packed in host memory
            check_fits(structure, model_path)
        self.threads = usable_threads(threads)
        # ONNX Runtime's own start-up lines (a CUDA EP it could not create, a layering rule with no
        # EP) only at FATAL: moepass says what happened in one line (provider_in_effect), and a
        # failure raises with ONNX Runtime's message
        ort.set_default_logger_severity(4)
        # the data files as ONNX Runtime maps them now: one rewritten in place changes (or, cut short,
        # faults) the running model under it (data_changed)
        self._data_stamps = {path: _stamp(path) for path in data_files(structure)}
        source: str | bytes = str(model_path)
        if graph is not None:
            source = onnx_ir.to_proto(stamp(graph, str(model_path))).SerializeToString()

        def new_session(ep_options: dict[str, str], profile_name: str = ""):
            options = ort.SessionOptions()
            if self.threads:
                options.intra_op_num_threads = self.threads
            options.log_severity_level = 4
            if profile_prefix:
                options.enable_profiling = True
                options.profile_file_prefix = profile_prefix + profile_name
            for key, value in self.plan.config_entries.items():
                options.add_session_config_entry(key, value)
            register_native_kernels(options, structure)
            if graph is not None:
                options.add_session_config_entry(keys.EXTERNAL_DATA_FOLDER_KEY, str(folder))
            try:
                if self.plan.plugin_devices:
                    options.add_provider_for_devices(self.plan.plugin_devices, ep_options)
                    return ort.InferenceSession(source, options)
                return ort.InferenceSession(source, options, providers=self.plan.providers)
            except Exception as e:  # ORT raises its own exception types; keep its message, one line
                raise MoepassError(
                    f"{model_path}: ONNX Runtime {ort.__version__} cannot load it: {first_line(e)}"
                ) from None

        self.session = new_session(self.plan.ep_options)
        self.plan = provider_in_effect(self.session, self.plan, ort)  # ONNX Runtime may have fallen back to the CPU
        # calls of several tokens, where the device's own path for them is not trusted (WebGPU's
        # QMoE): the same model with its MoE layers on the CPU (session_for)
        self.prompt_session = (
            new_session(self.plan.prompt_ep_options, "-prompts") if self.plan.prompt_ep_options else None
        )
        # MoE node -> EP, where a per-layer plan is in force (checked against the plan)
        self.moe_placement = check_layer_placement(self.session, structure, self.plan)
        # node -> (operator, EP) where the EP takes only some nodes (WebGPU)
        self.node_placement = node_placement(self.session, self.plan)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_layer_key)
        _check_inputs(model_path, inputs, self.past_names)
        self.feeds_mask, self.feeds_positions = "attention_mask" in inputs, "position_ids" in inputs
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self._cache_shapes = {n: inputs[n].shape for n in self.past_names}
        cache_types = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}  # else float32
        self.cache_dtype = (
            cache_types.get(inputs[self.past_names[0]].type, np.float32) if self.past_names else np.float32
        )
        # several sequences decode together (moepass.runtime.batch) over a cache in place, where
        # GroupQueryAttention takes a length per row; where they cannot, why not
        self.batch_refusal = _batch_refusal(model_path, self.plan.provider, self.past_names, structure)
        # models converted by moepass >= 0.1 compute the logits of the last N positions on request
        self.keeps_logits = any(i.name == LOGITS_TO_KEEP for i in self.session.get_overridable_initializers())
        self.stop_ids = self.report.stop_token_ids
        # positions the model has RoPE tables for (GGUF conversions; None where unknown)
        self.context_length = self.report.context_length
        # what set context_length below the model's (the CLI's "-c 4"), said where it limits a request
        self.context_limit: str | None = None
        # llama.cpp's -n -1: each request runs until the stop token or a full context, cut to the room
        # its prompt leaves without the warning a cut request gets
        self.until_full = False
        self._tokenizer = None
        self._token_bytes: Any = None
        self._chat_template: ChatTemplate | None = None
        self._added_tokens: tuple[list[int], list[int]] | None = None
        self._tokenizer_path = folder / TOKENIZER_FILE
        self.model_runs = 0  # steps of the model so far (a server's n_decode_total)
        self.prompt_runs = 0  # of which the prompt session's (session_for)
        # drafts checked K at a time (moepass.runtime.speculative); None: one token per step
        self.speculator: Speculator | None = None

    def data_changed(self) -> str | None:
        """What changed in place in a data file this session reads since it was loaded (None: none).
        A file replaced by another (a new file renamed over it, as moepass writes its own) or removed
        leaves the loaded one in use, whole: not a change."""
        for path, loaded in self._data_stamps.items():
            now = _stamp(path)
            if now is None or loaded is None or now[:2] != loaded[:2]:
                continue
            if now[2:] != loaded[2:]:
                size = f"{loaded[2]:,} bytes, now {now[2]:,}" if now[2] != loaded[2] else f"{now[2]:,} bytes, modified"
                return f"{path} was rewritten in place since the model was loaded ({size})"
        return None

    def speculate(self, speculator: Speculator | None) -> None:
        """Generate with speculative decoding from now on (None: plain decoding again)."""
        if speculator is not None:
            speculator.check_target(self)
        self.speculator = speculator

    @property
    def vocab_size(self) -> int:
        return int(self.session.get_outputs()[0].shape[-1])

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None or self._tokenizer_path.is_file()

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` convert wrote (tokenizer.json), or a clear error."""
        if self._tokenizer is None:
            if not self._tokenizer_path.is_file():
                raise MoepassError(
                    f"{self._tokenizer_path}: no tokenizer beside the model; use token ids "
                    "(convert writes one for a GGUF whose tokenizer it can rebuild, "
                    "none for ONNX input)"
                )
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
            except Exception as e:  # tokenizers raises plain Exception for every malformed file
                raise MoepassError(f"{self._tokenizer_path}: not a readable tokenizer ({first_line(e)})") from None
        return self._tokenizer

    def encode(self, text: str, special: bool = True) -> list[int]:
        """`text` as llama.cpp tokenizes a prompt (llama_tokenize with add_special = `special`,
        parse_special on): its control tokens read as such, and with `special` the BOS before and
        the EOS after where the GGUF says to add them (tokenizer.ggml.add_bos_token and
        add_eos_token, else llama.cpp's default for the tokenizer model)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if special:
            bos, eos = self.added_tokens
            ids = [*bos, *ids, *eos]
        return ids

    def encode_chat(self, rendered: str) -> list[int]:
        """A rendered chat template as llama.cpp tokenizes it: the BOS (EOS) text the template
        itself writes at the start (end) dropped where the tokenizer adds the token, so that it is
        there once."""
        return self.encode(self.chat_body(rendered))

    def chat_body(self, rendered: str) -> str:
        """A rendered chat template without the BOS (EOS) text that `encode` adds as a token."""
        bos, eos = self.added_tokens
        bos_text, eos_text = (self.tokenizer.id_to_token(t[0]) if t else "" for t in (bos, eos))
        if bos_text and rendered.startswith(bos_text):
            rendered = rendered[len(bos_text) :]
        if eos_text and rendered.endswith(eos_text):
            rendered = rendered[: -len(eos_text)]
        return rendered

    @property
    def added_tokens(self) -> tuple[list[int], list[int]]:
        """The token ids `encode` puts before and after a prompt: ([BOS] or [], [EOS] or []), from
        tokenizer_config.json (add_bos_token, add_eos_token; bos_token, eos_token)."""
        if self._added_tokens is None:
            where = self._tokenizer_path.with_name(TOKENIZER_CONFIG_FILE)
            config = read_json_object(where) if where.is_file() else {}
            self._added_tokens = added_tokens(config, self.tokenizer, where)
        return self._added_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a piece of a character for some: what `decode` of the
        token alone shows as U+FFFD)."""
        if self._token_bytes is None:
            self._token_bytes = _token_bytes_table(self.tokenizer)
        return self._token_bytes(token)

    def kv_bytes_per_position(self) -> int:
        """The KV cache's bytes for one position of one sequence (every layer's keys and values)."""
        return (
            sum(int(shape[1]) * int(shape[3]) for shape in self._cache_shapes.values())
            * np.dtype(self.cache_dtype).itemsize
        )

    def empty_cache(self, batch: int = 1, length: int = 0) -> dict[str, np.ndarray]:
        """Zero KV cache tensors of `length` positions (0: an empty cache for `forward`)."""
        return {
            n: np.zeros((batch, shape[1], length, shape[3]), dtype=self.cache_dtype)
            for n, shape in self._cache_shapes.items()
        }

    def session_for(self, tokens: int):
        """The session that runs a call of `tokens` tokens (all rows): the prompt session where there
        is one and the call has several (counted in prompt_runs), else the model's session."""
        if tokens > 1 and self.prompt_session is not None:
            self.prompt_runs += 1
            return self.prompt_session
        return self.session

    def forward(self, input_ids: np.ndarray, cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run new tokens `[B, S]` after the cached ones; returns logits `[B, S, V]` and the new cache."""
        logits, cache, _ = self.forward_with(input_ids, cache, [])
        return logits, cache

    def forward_with(
        self,
        input_ids: np.ndarray,
        cache: dict[str, np.ndarray],
        extra_outputs: Sequence[str],
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """`forward`, also fetching the named extra graph outputs (e.g. a profiling copy's router logits)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        past_len = next(iter(cache.values())).shape[2] if cache else 0
        feeds = {**self.feeds(input_ids, past_len), **cache}
        names = ["logits", *self.present_names, *extra_outputs]
        outputs = self.session_for(input_ids.size).run(names, feeds)
        n_cache = len(self.present_names)
        new_cache = dict(zip(self.past_names, outputs[1 : 1 + n_cache]))
        return outputs[0], new_cache, dict(zip(extra_outputs, outputs[1 + n_cache :]))

    def feeds(self, input_ids: np.ndarray, past_len: int) -> dict[str, np.ndarray]:
        """input_ids [B, S] after `past_len` cached positions, with the attention mask and position
        ids where the model takes them (exported models may take either, neither or both)."""
        return self.row_feeds(input_ids, [past_len] * input_ids.shape[0])

    def row_feeds(self, input_ids: np.ndarray, held: Sequence[int]) -> dict[str, np.ndarray]:
        """`feeds` for a batch whose row i runs input_ids[i] after `held[i]` cached positions: the
        attention mask right-padded (row i: ones for its held and new positions; all ones where
        every row holds as many), the positions per row."""
        batch, length = input_ids.shape
        feeds = {"input_ids": input_ids}
        starts = np.asarray(held, dtype=np.int64)
        if self.feeds_mask:
            width = int(starts.max()) + length
            feeds["attention_mask"] = (np.arange(width) < (starts + length)[:, None]).astype(np.int64)
        if self.feeds_positions:
            feeds["position_ids"] = starts[:, None] + np.arange(length, dtype=np.int64)
        return feeds

    @property
    def batchable(self) -> bool:
        """Whether several sequences can decode together (`generate_batch`, `serve --parallel`)."""
        return not self.batch_refusal

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop: Sequence[str] = (),
        parallel: int = 4,
        logprobs: int | None = None,
    ) -> list[TextStream]:
        """Each prompt's answer, `parallel` prompts decoding together in one batch (continuous
        batching: a finished one's slot takes the next prompt at once); the finished streams in the
        prompts' order (their `text`, `token_ids`, `finish_reason`, timings). Each answer is the one
        `generate_text` gives that prompt alone, to the bit where every kernel computes a row the
        same at any batch size (docs/usage.md, "Serving many at once", says where not)."""
        import concurrent.futures

        from moepass.runtime.batch import Slots

        ids = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for i, p in enumerate(ids):
            if not p:
                raise MoepassError(f"prompt {i} is empty")
        slots = Slots(self, max(1, min(parallel, len(ids))))

        def answer(prompt: list[int]) -> TextStream:  # on a thread of its own, a slot of its own
            cache = slots.open(prompt)
            try:
                stream = self.generate_text(prompt, max_new_tokens, sampling, stop, cache, logprobs)
                for _ in stream:
                    pass
                return stream
            finally:
                slots.release(cache)

        try:
            with concurrent.futures.ThreadPoolExecutor(slots.count, thread_name_prefix="moepass-sequence") as pool:
                return list(pool.map(answer, ids))
        finally:
            slots.close()

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: Sequence[int] | None = None,
        sampling: Sampling = Sampling(),
        cache: Cache | None = None,
    ) -> Iterator[int]:
        """Prefill the prompt, then one token per step through the KV cache; yields each new token as
        soon as it is chosen, and stops after a stop token (default: the GGUF's). `cache`: a
        `KVCache` kept between calls (a chat, a server): the prefix it shares with `prompt_ids` is
        not computed again. With a `speculator` (`speculate`), several tokens per step."""
        for token, _ in self.generate_steps(prompt_ids, max_new_tokens, stop_ids, sampling, cache):
            yield token

    def generate_steps(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: Sequence[int] | None = None,
        sampling: Sampling = Sampling(),
        cache: Cache | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """`generate`, each token with the logits `[V]` it was chosen from (the model's own, before
        sampling's penalties)."""
        history = list(prompt_ids)
        if not history:
            raise MoepassError("the prompt is empty: give at least one token id")
        vocab = self.vocab_size
        bad = [t for t in history if not 0 <= t < vocab]
        if bad:
            raise MoepassError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        max_new_tokens = self.room_for(len(history), max_new_tokens)
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        rng = np.random.default_rng(sampling.seed)
        if cache is None:
            cache = KVCache(self, capacity=len(history) + max_new_tokens)
        logits = cache.extend(history)
        if self.speculator is not None:
            yield from speculative.generate(
                self.speculator, cache, history, logits, max_new_tokens, stops, sampling, rng
            )
            return
        for i in range(max_new_tokens):
            token = choose_token(logits, sampling, rng, history)
            yield token, logits
            if token in stops or i == max_new_tokens - 1:  # no step for a token nobody will read
                return
            history.append(token)
            logits = cache.run([token])

    def room_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """How many of `max_new_tokens` fit the context after a prompt (a warning when fewer); a
        prompt that fills the context is a `ContextOverflow`."""
        if not self.context_length:
            return max_new_tokens
        room = self.context_length - prompt_tokens
        if room <= 0:
            more = (
                f"{self.context_limit} limits this run; give more, up to the {self.report.context_length} the "
                "model was converted for"
                if self.context_limit
                else f"{wording().call('convert', wording().option('--context', 'N'))} builds it for more"
            )
            whose = "this run's" if self.context_limit else "the model's"
            raise ContextOverflow(
                f"the prompt has {prompt_tokens} tokens; {whose} context holds {self.context_length} ({more})"
            )
        if max_new_tokens > room and not self.until_full:
            n = self.context_length
            whose = f"this run's context of {n} ({self.context_limit})" if self.context_limit else f"the model's ({n})"
            log.warning(f"generation stops after {room} new tokens, at {whose}")
        return min(max_new_tokens, room)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (from the GGUF, in tokenizer_config.json), compiled once."""
        if self._chat_template is None:
            where = self._tokenizer_path.with_name(TOKENIZER_CONFIG_FILE)
            config = read_json_object(where)
            source = config.get("chat_template")
            if not source:
                raise MoepassError(
                    f"{self._tokenizer_path.parent}: the model has no chat template (tokenizer.chat_template)"
                )
            if not isinstance(source, str):
                raise MoepassError(f"{where}: chat_template must be a string")
            tokens = {k: config[k] if isinstance(config.get(k), str) else "" for k in ("bos_token", "eos_token")}
            self._chat_template = ChatTemplate(source, where, **tokens)
        return self._chat_template

    def apply_chat_template(self, user_message: str, system: str | None = None, **variables: Any) -> str:
        """The prompt for one user message (after an optional system message), with the model's chat
        template; `variables` reach the template (e.g. enable_thinking=False)."""
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.chat_template.render([*messages, {"role": "user", "content": user_message}], **variables)

    def generate_text(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop: Sequence[str] = (),
        cache: Cache | None = None,
        logprobs: int | None = None,
    ) -> TextStream:
        """Text (or token ids) in, text out, streamed: iterating yields pieces of text as tokens
        complete them; a stop string ends the answer and is not shown. Afterwards the stream tells
        its `finish_reason` ("stop" or "length") and token counts. `logprobs`: record each token's
        log probability and the `logprobs` likeliest alternatives' (stream.logprobs)."""
        if isinstance(prompt, str) and not prompt:
            raise MoepassError("the prompt is empty: give some text")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return TextStream(self, ids, max_new_tokens, sampling, stop, cache, logprobs)


class ContextOverflow(MoepassError):
    """The prompt does not fit the model's context."""


class TextStream:
    """The pieces of one answer as they come; afterwards its finish reason and token counts."""

    def __init__(
        self,
        decoder: Decoder,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        cache: Cache | None,
        logprobs: int | None = None,
    ):
        self._decoder = decoder
        self.top_logprobs = logprobs  # alternatives recorded per token; None: no log probabilities
        # with `logprobs`: per generated token but a stop token, (id, log probability, the
        # likeliest tokens' (id, log probability)), under the model's own distribution
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._cache = cache if cache is not None else KVCache(decoder, len(prompt_ids) + max_new_tokens)
        self._args = (prompt_ids, max_new_tokens, None, sampling, self._cache)
        self._stop = StopStrings(stop)
        self.prompt_tokens = len(prompt_ids)
        self.prefilled_tokens = 0  # of the prompt, run through the model (the rest was cached)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" (a stop token or string) or "length"
        self.ended_by = ""  # the same, in words
        # perf_counter at the start, at the first token (the prompt's computation ends there) and at the last
        self.started = self.first_token_at = self.last_token_at = 0.0

    @property
    def prompt_seconds(self) -> float:
        """The prompt's computation: from the start to the first token (as llama.cpp's prompt eval)."""
        return max(self.first_token_at - self.started, 0.0)

    @property
    def generation_seconds(self) -> float:
        """The tokens after the first, each a step of its own (as llama.cpp's eval)."""
        return max(self.last_token_at - self.first_token_at, 0.0)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def snapshot(self) -> TextStream:
        """The stream as it is now, its tokens, text and log probabilities fixed (for a reader on
        another thread while this one goes on generating)."""
        frozen = copy.copy(self)
        frozen.token_ids, frozen.logprobs = list(self.token_ids), list(self.logprobs)
        return frozen

    def __iter__(self) -> Generator[str, None, None]:
        d = self._decoder
        shown = ""
        self.started = time.perf_counter()
        for token, logits in d.generate_steps(*self._args):
            self.last_token_at = time.perf_counter()
            if not self.token_ids:
                self.prefilled_tokens = self._cache.prefilled
                self.first_token_at = self.last_token_at
            self.token_ids.append(token)
            if token in d.stop_ids:
                self.finish_reason, self.ended_by = "stop", f"the stop token {d.decode([token])!r}"
                break
            if self.top_logprobs is not None:
                self.logprobs.append(token_logprobs(logits, token, self.top_logprobs))
            text = d.decode([t for t in self.token_ids if t not in d.stop_ids])
            if text.endswith("\ufffd"):  # a character split over tokens: wait for the rest
                continue
            piece = self._stop.feed(text[len(shown) :])
            shown = text
            if piece:
                self.text += piece
                yield piece
            if self._stop.hit:
                self.finish_reason, self.ended_by = "stop", "a stop string"
                return
        if self.finish_reason is None:
            self.finish_reason, self.ended_by = "length", "the token limit"
        rest = self._stop.flush()
        if rest:
            self.text += rest
            yield rest


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """`token`'s log probability under softmax(`logits`), and the `top` likeliest tokens' (most
    likely first; ties by id)."""
    z = logits.astype(np.float64)
    shifted = z - z.max()
    log_probs = shifted - np.log(np.exp(shifted).sum())
    best = np.argsort(-log_probs, kind="stable")[:top]
    return token, float(log_probs[token]), [(int(i), float(log_probs[i])) for i in best]


def _token_bytes_table(tokenizer):
    """id -> bytes for a tokenizer convert wrote: added tokens as their text; byte-level BPE through
    GPT-2's byte <-> character map; SentencePiece pieces with "▁" as a space and <0xNN> as byte NN."""
    import json as json_module

    spec = json_module.loads(tokenizer.to_str())
    added = {t["id"]: t["content"].encode() for t in spec.get("added_tokens", [])}
    decoder = spec.get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    if byte_level:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]  # GPT-2 moves these to U+0100 on
        chars = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}

    def of(token: int) -> bytes:
        if token in added:
            return added[token]
        piece = tokenizer.id_to_token(token) or ""
        if byte_level:
            return bytes(chars[c] for c in piece if c in chars)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    return of


FED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def data_files(model: onnx_ir.Model) -> list[Path]:
    """The external data files the model's initializers lie in."""
    import onnx_ir

    return sorted({
        Path(t.path) for v in model.graph.initializers.values()
        if isinstance(t := v.const_value, onnx_ir.ExternalTensor)
    })  # fmt: skip


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """A file's device, inode, size and modification time (None: not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _check_inputs(model_path: Path, inputs: dict, past_names: list[str]) -> None:
    """The model takes what moepass feeds (input_ids, and attention_mask, position_ids and
    past_key_values.* where it has them) and can generate: a sequence axis that is not fixed, or a
    KV cache. Anything else is refused at load, naming the input."""
    unknown = [n for n in inputs if n not in FED_INPUTS and n not in past_names]
    if "input_ids" not in inputs:
        raise MoepassError(
            f"{model_path}: the model has no input 'input_ids' (its inputs: {', '.join(inputs)}); "
            "moepass feeds token ids through it"
        )
    if unknown:
        raise MoepassError(
            f"{model_path}: the model needs the input '{unknown[0]}', which moepass does not feed "
            f"(it feeds {', '.join(FED_INPUTS)} and past_key_values.*)"
        )
    shape = inputs["input_ids"].shape
    if not past_names and len(shape) == 2 and isinstance(shape[1], int):
        raise MoepassError(
            f"{model_path}: input_ids has the fixed shape {list(shape)} and the model has no KV cache: "
            f"it computes exactly {shape[1]} tokens and cannot generate; export it with a dynamic "
            "sequence axis (torch.onnx.export dynamic_axes / dynamic_shapes)"
        )


def _batch_refusal(model_path: Path, provider: str, past_names: list[str], structure: onnx_ir.Model) -> str:
    """Why several sequences cannot decode together in this session ("" where they can): that
    needs the KV cache in place (the CPU EP) and GroupQueryAttention, which takes a length per row."""
    if not past_names:
        return f"{model_path}: the model has no KV cache; sequences cannot decode together"
    if provider != CPU_EP:
        return (
            f"{model_path}: sequences decode together on the CPU EP only (the KV cache in place); "
            f"this session runs on {provider}"
        )
    if not any(node.op_type == "GroupQueryAttention" for node in structure.graph.all_nodes()):
        return (
            f"{model_path}: the model's attention is not GroupQueryAttention (an ONNX export's own); "
            "sequences of different lengths cannot decode together"
        )
    return ""


def usable_threads(requested: int | None) -> int | None:
    """`requested` intra-op threads, at most the CPUs this process may run on (ONNX Runtime would
    otherwise start one OS thread per request and can exhaust the process limit)."""
    if not requested:
        return requested
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested > available:
        log.warning(
            f"{wording().option('--threads', requested)} is more than the {available} CPUs available; using {available}"
        )
        return available
    return requested


def default_threads() -> int:
    """The intra-op threads ONNX Runtime starts when not told: one per physical core (of those this
    process may run on), as its own count finds them; the CPUs where the system does not say."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as a, open(f"{topology}/core_id") as b:
                cores.add((a.read().strip(), b.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _layer_key(name: str) -> tuple[int, str]:
    _, layer, kind = name.split(".")
    return int(layer), kind


def added_tokens(config: dict, tokenizer, where: str | os.PathLike) -> tuple[list[int], list[int]]:
    """The token ids llama.cpp puts before and after a prompt it tokenizes with add_special:
    ([BOS] or [], [EOS] or []), from the tokenizer_config.json convert wrote (`config`, read from
    `where`): add_bos_token and add_eos_token, bos_token and eos_token."""
    added: list[list[int]] = []
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        add = config.get(flag, False)
        if not isinstance(add, bool):
            raise MoepassError(f"{where}: '{flag}' must be true or false")
        text = config.get(name)
        token = tokenizer.token_to_id(text) if add and isinstance(text, str) else None
        if add and token is None:
            raise MoepassError(f"{where}: '{flag}' is set but '{name}' ({text!r}) is not a token")
        added.append([token] if token is not None else [])
    return added[0], added[1]
