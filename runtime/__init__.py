"""moepass.runtime: load a converted (or partitioned) model with ONNX Runtime and generate.

`load(model_dir, device="auto"|"cpu"|"cuda", cuda_plugin=None, mode=None)` picks the execution
provider and the expert-offload options that match the model's annotations (see
`moepass.runtime.providers`), checks what it can before creating the session, and returns a
`Decoder`: KV cache kept between steps (through an IO binding, as ONNX Runtime values, during
generation), greedy or sampled decoding (temperature, top-k, top-p,
seed), stop tokens from the GGUF, tokens streamed as they come, and text in / text out through the
tokenizer.json that convert writes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from moepass.core.errors import MoepassError, first_line
from moepass.core.files import (LOGITS_TO_KEEP, OPTIONS_FILE, REPORT_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
                                load_model, model_file, read_json_object)
from moepass.runtime.providers import SessionPlan, check_layer_placement, log, plan_session, provider_in_effect
from moepass.core import keys

if TYPE_CHECKING:
    import onnx_ir


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise MoepassError("onnxruntime is not installed: pip install 'moepass[cpu]' (or [gpu])") from None
    return onnxruntime


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy; top_k 0 and top_p 1 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise MoepassError(f"invalid sampling settings {self}: temperature >= 0, top_k >= 0, 0 < top_p <= 1")


def choose_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token from a logits vector: argmax, or a draw after temperature, top-k and top-p filtering."""
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    order = np.argsort(-z, kind="stable")
    if sampling.top_k:
        order = order[: sampling.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if sampling.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


class Decoder:
    """An ONNX Runtime session over a converted decoder, with its KV-cache bookkeeping."""

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", threads: int | None = None,
                 graph: "onnx_ir.Model | None" = None, cuda_plugin: str | None = None, mode: str | None = None,
                 profile_prefix: str | None = None):
        """`graph`: run this in-memory variant of the model (e.g. a profiling copy) with the weights
        of `model_dir`'s data file instead of `model_dir`'s own model.onnx. `profile_prefix`: record
        ONNX Runtime's per-node profile (`session.end_profiling()` writes it under this prefix)."""
        import onnx_ir

        ort = _import_onnxruntime()
        self.model_dir = Path(model_dir)
        model_path = model_file(self.model_dir)
        folder = model_path.parent
        self.info = read_json_object(folder / REPORT_FILE)
        options_file = read_json_object(folder / OPTIONS_FILE)
        option_entries = _json_field(options_file, "session_config_entries", dict, folder / OPTIONS_FILE)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in option_entries.items()):
            raise MoepassError(f"{folder / OPTIONS_FILE}: session_config_entries must map strings to strings")
        placement_mode = _json_field(options_file, "placement", dict, folder / OPTIONS_FILE).get("mode")
        if placement_mode not in (None, *keys.OFFLOAD_MODES):
            raise MoepassError(f"{folder / OPTIONS_FILE}: placement.mode must be one of {', '.join(keys.OFFLOAD_MODES)}")
        structure = graph if graph is not None else load_model(model_path)
        self.plan: SessionPlan = plan_session(ort, structure, option_entries, device, cuda_plugin, mode,
                                              placement_mode)
        options = ort.SessionOptions()
        self.threads = usable_threads(threads)
        if self.threads:
            options.intra_op_num_threads = self.threads
        options.log_severity_level = 3
        if profile_prefix:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        for key, value in self.plan.config_entries.items():
            options.add_session_config_entry(key, value)
        source: str | bytes = str(model_path)
        if graph is not None:
            source = onnx_ir.to_proto(graph).SerializeToString()
            options.add_session_config_entry(keys.EXTERNAL_DATA_FOLDER_KEY, str(folder))
        try:
            if self.plan.plugin_devices:
                options.add_provider_for_devices(self.plan.plugin_devices, {})
                self.session = ort.InferenceSession(source, options)
            else:
                self.session = ort.InferenceSession(source, options, providers=self.plan.providers)
        except Exception as e:  # ORT raises its own exception types; keep its message, one line
            raise MoepassError(f"{model_path}: ONNX Runtime {ort.__version__} cannot load it: "
                               f"{first_line(e)}") from None
        self.plan = provider_in_effect(self.session, self.plan, ort)   # ONNX Runtime may have fallen back to the CPU
        # MoE node -> EP, where a per-layer plan is in force (checked against the plan)
        self.moe_placement = check_layer_placement(self.session, structure, self.plan)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_layer_key)
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self._cache_shapes = {n: inputs[n].shape for n in self.past_names}
        self._cache_dtype = np.float16 if self.past_names and inputs[self.past_names[0]].type == "tensor(float16)" \
            else np.float32
        # models converted by moepass >= 0.1 compute the logits of the last N positions on request
        self.keeps_logits = any(i.name == LOGITS_TO_KEEP for i in self.session.get_overridable_initializers())
        report = folder / REPORT_FILE
        self.stop_ids = tuple(_json_field(_json_field(self.info, "tokenizer", dict, report), "stop_token_ids", list,
                                          report))
        if not all(isinstance(t, int) for t in self.stop_ids):
            raise MoepassError(f"{report}: tokenizer.stop_token_ids must be integers")
        # positions the model has RoPE tables for (GGUF conversions; None where unknown)
        self.context_length = _json_field(self.info, "hparams", dict, report).get("context_length")
        if self.context_length is not None and (not isinstance(self.context_length, int) or self.context_length < 1):
            raise MoepassError(f"{report}: hparams.context_length must be a positive integer")
        self._tokenizer = None
        self._tokenizer_path = folder / TOKENIZER_FILE

    @property
    def vocab_size(self) -> int:
        return int(self.session.get_outputs()[0].shape[-1])

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` convert wrote (tokenizer.json), or a clear error."""
        if self._tokenizer is None:
            if not self._tokenizer_path.is_file():
                raise MoepassError(f"{self._tokenizer_path}: no tokenizer beside the model; use token ids "
                                   "(the GGUF had no tokenizer moepass can rebuild)")
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
            except Exception as e:  # tokenizers raises plain Exception for every malformed file
                raise MoepassError(f"{self._tokenizer_path}: not a readable tokenizer ({first_line(e)})") from None
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def empty_cache(self, batch: int = 1, length: int = 0) -> dict[str, np.ndarray]:
        """Zero KV cache tensors of `length` positions (0: an empty cache for `forward`)."""
        return {n: np.zeros((batch, shape[1], length, shape[3]), dtype=self._cache_dtype)
                for n, shape in self._cache_shapes.items()}

    def forward(self, input_ids: np.ndarray, cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run new tokens `[B, S]` after the cached ones; returns logits `[B, S, V]` and the new cache."""
        logits, cache, _ = self.forward_with(input_ids, cache, [])
        return logits, cache

    def forward_with(self, input_ids: np.ndarray, cache: dict[str, np.ndarray], extra_outputs: Sequence[str],
                     ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """`forward`, also fetching the named extra graph outputs (e.g. a profiling copy's router logits)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        past_len = next(iter(cache.values())).shape[2] if cache else 0
        mask = np.ones((input_ids.shape[0], past_len + input_ids.shape[1]), dtype=np.int64)
        feeds = {"input_ids": input_ids, "attention_mask": mask, **cache}
        names = ["logits", *self.present_names, *extra_outputs]
        outputs = self.session.run(names, feeds)
        n_cache = len(self.present_names)
        new_cache = dict(zip(self.past_names, outputs[1:1 + n_cache]))
        return outputs[0], new_cache, dict(zip(extra_outputs, outputs[1 + n_cache:]))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] | None = None,
                 sampling: Sampling = Sampling()) -> Iterator[int]:
        """Prefill the prompt in one step, then one token per step through the KV cache; yields each
        new token as soon as it is chosen, and stops after a stop token (default: the GGUF's)."""
        if not prompt_ids:
            raise MoepassError("the prompt is empty: give at least one token id")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise MoepassError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if self.context_length:
            room = self.context_length - len(prompt_ids)
            if room <= 0:
                raise MoepassError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds "
                                   f"{self.context_length}")
            if max_new_tokens > room:
                log.warning(f"generation stops after {room} new tokens, at the model's context length "
                            f"({self.context_length})")
                max_new_tokens = room
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        rng = np.random.default_rng(sampling.seed)
        step = _BoundDecoding(self, capacity=len(prompt_ids) + max_new_tokens)
        logits = step.run(prompt_ids)
        for i in range(max_new_tokens):
            token = choose_token(logits, sampling, rng)
            yield token
            if token in stops or i == max_new_tokens - 1:  # no step for a token nobody will read
                return
            logits = step.run([token])

    def apply_chat_template(self, user_message: str) -> str:
        """The prompt for one user message, with the model's chat template (from the GGUF)."""
        config = read_json_object(self._tokenizer_path.with_name(TOKENIZER_CONFIG_FILE))
        template = config.get("chat_template")
        if not template:
            raise MoepassError(f"{self._tokenizer_path.parent}: the model has no chat template (tokenizer.chat_template)")
        try:
            import jinja2
        except ImportError:
            raise MoepassError("--chat needs jinja2: pip install 'moepass[chat]'") from None
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # the template comes from the model file: rendered in jinja2's sandbox (no attribute of
        # Python's internals, no mutation), as Hugging Face transformers renders chat templates
        env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, extensions=["jinja2.ext.loopcontrols"])
        try:
            return env.from_string(template).render(messages=[{"role": "user", "content": user_message}],
                                                    add_generation_prompt=True,
                                                    bos_token=config.get("bos_token") or "",
                                                    eos_token=config.get("eos_token") or "")
        except Exception as e:  # noqa: BLE001 - whatever the model file's template raises: SecurityError,
            # TemplateError, or a Python error from its expressions (1/0, range limits)
            where = self._tokenizer_path.with_name(TOKENIZER_CONFIG_FILE)
            raise MoepassError(f"{where}: the chat template cannot be rendered ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else 'no message'})") from None

    def generate_text(self, prompt: str, max_new_tokens: int, sampling: Sampling = Sampling()) -> Iterator[str]:
        """Text in, text out, streamed: yields pieces of text as tokens complete them."""
        ids: list[int] = []
        shown = ""
        for token in self.generate(self.encode(prompt), max_new_tokens, sampling=sampling):
            if token in self.stop_ids:
                break
            ids.append(token)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # a character split over tokens: wait for the rest
                continue
            yield text[len(shown):]
            shown = text


# Prompt tokens per step: GroupQueryAttention's CPU kernel holds [heads, new, total] attention
# probabilities, so one step over a 32k-token prompt would need 128 GB for 32 heads; at 512 a step
# needs at most heads x 512 x context floats.
PREFILL_CHUNK = 512


class _BoundDecoding:
    """Decoding steps through an IO binding, with a KV cache that does not grow by copying.

    Each layer's cache is one ONNX Runtime buffer of `capacity` positions, bound both as
    past_key_values.N.* and as present.N.*: GroupQueryAttention sees the same memory on both sides
    and writes each step's keys and values in place (ONNX Runtime's past/present shared-buffer
    mode), so a step costs the same whatever the context length, instead of copying the whole
    cache into a new present tensor. The attention mask's length tells it how many positions are
    filled. Only the last position's logits are computed (the model's `logits_to_keep` input) and
    copied back."""

    def __init__(self, decoder: Decoder, capacity: int):
        import onnxruntime as ort

        self._decoder = decoder
        self._binding = decoder.session.io_binding()
        # In place on the CPU EP, where the buffers are the kernel's own memory. On a GPU EP host
        # buffers would be copied to the device and back each step, so the pointers differ there:
        # it keeps the growing cache (present.N.* bound as the next step's past) until device-side
        # buffers are checked on a GPU.
        self._in_place = decoder.plan.provider == "CPUExecutionProvider"
        self._capacity = capacity
        self._last_only = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))
        self._cache = {n: ort.OrtValue.ortvalue_from_numpy(a)
                       for n, a in decoder.empty_cache(length=capacity if self._in_place else 0).items()}
        self._length = 0
        if self._in_place:
            self._bind_cache()

    def run(self, token_ids: Sequence[int]) -> np.ndarray:
        """The next-token logits after `token_ids`; a long prompt goes in PREFILL_CHUNK-token steps
        (as llama.cpp's n_ubatch), so the attention and expert buffers stay bounded."""
        chunks = [token_ids[i:i + PREFILL_CHUNK] for i in range(0, len(token_ids), PREFILL_CHUNK)]
        for chunk in chunks[:-1]:
            self._step(chunk)
        return self._step(chunks[-1])

    def _bind_cache(self) -> None:
        """Bind what stays the same from step to step: logits_to_keep, the logits output and the
        KV cache (in place: each buffer as both past and present, once for the whole request)."""
        d, binding = self._decoder, self._binding
        if d.keeps_logits:  # an overridable initializer: bound as an OrtValue (bind_cpu_input refuses it)
            binding.bind_ortvalue_input(LOGITS_TO_KEEP, self._last_only)
        binding.bind_output("logits", "cpu")  # the first output bound: get_outputs()[0]
        for past, present in zip(d.past_names, d.present_names):
            binding.bind_ortvalue_input(past, self._cache[past])
            if self._in_place:
                binding.bind_ortvalue_output(present, self._cache[past])
            else:
                binding.bind_output(present, "cpu")

    def _step(self, token_ids: Sequence[int]) -> np.ndarray:
        d, binding = self._decoder, self._binding
        ids = np.asarray([token_ids], dtype=np.int64)
        if self._in_place and self._length + ids.shape[1] > self._capacity:
            raise MoepassError(f"{self._length + ids.shape[1]} tokens do not fit the KV cache of {self._capacity}")
        self._length += ids.shape[1]
        if not self._in_place:  # the cache values change every step: bind them anew
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            self._bind_cache()
        binding.bind_cpu_input("input_ids", ids)  # replaces the previous step's binding of the name
        binding.bind_cpu_input("attention_mask", np.ones((1, self._length), dtype=np.int64))
        d.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        if not self._in_place:
            self._cache = dict(zip(d.past_names, outputs[1:]))
        return outputs[0].numpy()[0, -1]


def _json_field(data: dict, key: str, kind: type, path: Path):
    """data[key] when it is a `kind` (an empty one when absent); another type is a clear error."""
    value = data.get(key, kind())
    if not isinstance(value, kind):
        raise MoepassError(f"{path}: '{key}' must be a JSON {'object' if kind is dict else 'array'}, "
                           f"found {type(value).__name__}")
    return value


def usable_threads(requested: int | None) -> int | None:
    """`requested` intra-op threads, at most the CPUs this process may run on (ONNX Runtime would
    otherwise start one OS thread per request and can exhaust the process limit)."""
    if not requested:
        return requested
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested > available:
        log.warning(f"--threads {requested} is more than the {available} CPUs available; using {available}")
        return available
    return requested


def _layer_key(name: str) -> tuple[int, str]:
    _, layer, kind = name.split(".")
    return int(layer), kind


def load(model_dir: str | os.PathLike, device: str = "auto", cuda_plugin: str | None = None, mode: str | None = None,
         threads: int | None = None) -> Decoder:
    """Load a converted model directory (or its model.onnx) for inference.

    device: "auto" (best available), "cpu" or "cuda" (a CUDA EP is required). cuda_plugin: path of
    the ONNX Runtime CUDA plugin EP library (default: $MOEPASS_CUDA_PLUGIN). mode: expert offload
    "disabled", "auto" (fall back with one warning) or "required" (fail, naming the node and rule);
    default: what partition wrote into onnxruntime_options.json, else "disabled".
    """
    return Decoder(model_dir, device=device, threads=threads, cuda_plugin=cuda_plugin, mode=mode)


__all__ = ["Decoder", "Sampling", "choose_token", "load"]
