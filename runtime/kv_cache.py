"""The KV cache of one sequence, bound to ONNX Runtime once, and the tokens it holds.

Each layer's cache is one ONNX Runtime buffer of `capacity` positions, bound both as
past_key_values.N.* and as present.N.*: GroupQueryAttention sees the same memory on both sides and
writes each step's keys and values in place (ONNX Runtime's past/present shared-buffer mode), so a
step costs the same whatever the context length, instead of copying the whole cache into a new
present tensor. The attention mask's length tells it how many positions are filled. Only the last
position's logits are computed (the model's `logits_to_keep` input) and copied back, or of the
last K + 1 when speculative decoding checks K drafts (`run_rows`).

The cache remembers which tokens fill it: `extend(ids)` keeps the longest common prefix of what it
holds and `ids`, and runs only the rest (a chat's next turn, or a server request that shares a
prompt with the one before, prefills only what is new). Positions past the kept prefix are simply
written over. A full cache grows (to twice its size, up to the model's context) by one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moepass.core.errors import MoepassError
from moepass.core.files import LOGITS_TO_KEEP

# Prompt tokens per step: GroupQueryAttention's CPU kernel holds [heads, new, total] attention
# probabilities, so one step over a 32k-token prompt would need 128 GB for 32 heads; at 512 a step
# needs at most heads x 512 x context floats.
PREFILL_CHUNK = 512
FIRST_CAPACITY = 8192


class Cache:
    """What generation steps through: a `KVCache`, or a slot of a batch (moepass.runtime.batch.SlotCache).
    Each holds `tokens` (what its filled positions hold) and runs steps after them (`run_rows`);
    `extend` and `run` are built on those."""

    tokens: list[int]
    prefilled: int  # tokens the last extend() ran through the model
    draft_cache: Any  # a KVCache of the draft model's, following this one (speculative decoding)

    def extend(self, token_ids: Sequence[int]) -> np.ndarray:
        """The next-token logits after `token_ids`, the whole context: the cached prefix they share
        is kept, the rest runs in PREFILL_CHUNK-token steps (as llama.cpp's n_ubatch), so the
        attention and expert buffers stay bounded."""
        token_ids = list(token_ids)
        if not token_ids:
            raise MoepassError("nothing to run: the context is empty")
        # the last token runs again: its logits are wanted
        shared = min(shared_prefix(self.tokens, token_ids), len(token_ids) - 1)
        self.truncate(shared)
        return self.run(token_ids[shared:])

    def run(self, token_ids: Sequence[int]) -> np.ndarray:
        """The next-token logits after the cached tokens and `token_ids`."""
        return self.run_rows(token_ids, keep=1)[0]

    def run_rows(self, token_ids: Sequence[int], keep: int) -> np.ndarray:
        """The logits `[keep, vocab]` of the last `keep` positions after the cached tokens and
        `token_ids` (row i: the next-token logits after all but the last keep - 1 - i of them), as
        speculative decoding checks its drafts."""
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Forget the positions from `length` on."""
        raise NotImplementedError


class KeptLogits:
    """The model's `logits_to_keep` input as IO bindings take it (an overridable initializer: bound
    as an OrtValue, which bind_cpu_input refuses), one value per count asked, and which count each
    binding holds (`bind` rebinds only on a change)."""

    def __init__(self, ort):
        self._ort = ort
        self._values: dict[int, Any] = {}

    def bind(self, binding, keep: int) -> None:
        """`binding` computes the logits of the last `keep` positions, into an output of that shape
        (ONNX Runtime would keep the last one's)."""
        if getattr(binding, "kept", None) == keep:
            return
        value = self._values.get(keep)
        if value is None:
            value = self._values[keep] = self._ort.OrtValue.ortvalue_from_numpy(np.array([keep], dtype=np.int64))
        binding.bind_ortvalue_input(LOGITS_TO_KEEP, value)
        binding.bind_output("logits", "cpu")
        binding.kept = keep


class KVCache(Cache):
    """Decoding steps through an IO binding, over a KV cache that holds `tokens`."""

    def __init__(self, decoder, capacity: int):
        """`decoder`: the moepass.runtime.Decoder whose session runs the steps."""
        import onnxruntime as ort

        self._ort = ort
        self._decoder = decoder
        self._binding = decoder.session.io_binding()
        # the prompt session's (Decoder.session_for), made at its first step; never in place
        self._prompt_binding = None
        # In place on the CPU EP, where the buffers are the kernel's own memory. On a GPU EP host
        # buffers would be copied to the device and back each step, so the pointers differ there:
        # it keeps the growing cache (present.N.* bound as the next step's past) until device-side
        # buffers are checked on a GPU.
        self._in_place = decoder.plan.provider == "CPUExecutionProvider" and bool(decoder.past_names)
        # a model without a KV cache (an export of logits only) runs the whole sequence each step
        self._cacheless = not decoder.past_names
        self._kept_logits = KeptLogits(ort)
        # positions allocated now; more are added as they fill (a request may ask for many it never uses)
        self.capacity = max(1, min(capacity, decoder.context_length or capacity, FIRST_CAPACITY))
        self._cache = {
            n: ort.OrtValue.ortvalue_from_numpy(a)
            for n, a in decoder.empty_cache(length=self.capacity if self._in_place else 0).items()
        }
        self.tokens = []
        self.prefilled = 0
        self.draft_cache = None
        if self._in_place:
            self._bind_cache()

    def run_rows(self, token_ids: Sequence[int], keep: int) -> np.ndarray:
        token_ids = list(token_ids)
        check_run(len(token_ids), keep)
        self.prefilled = len(token_ids)
        rest = token_ids
        while len(rest) > PREFILL_CHUNK:  # the last chunk holds the `keep` positions
            head = min(PREFILL_CHUNK, len(rest) - keep)
            self._step(rest[:head], 1)
            rest = rest[head:]
        return self._step(rest, keep)

    def truncate(self, length: int) -> None:
        if length < len(self.tokens):
            del self.tokens[length:]
            if not self._in_place:
                self._cache = {
                    n: self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length]))
                    for n, v in self._cache.items()
                }

    def _grow(self, needed: int) -> None:
        limit = self._decoder.context_length or needed
        if needed > limit:
            raise MoepassError(f"{needed} tokens do not fit the model's context of {limit}")
        self.capacity = min(max(needed, 2 * self.capacity), limit)
        filled = len(self.tokens)
        grown = self._decoder.empty_cache(length=self.capacity)
        for name, value in self._cache.items():
            grown[name][:, :, :filled] = value.numpy()[:, :, :filled]
        self._cache = {n: self._ort.OrtValue.ortvalue_from_numpy(a) for n, a in grown.items()}
        self._binding.clear_binding_inputs()
        self._binding.clear_binding_outputs()
        self._bind_cache()

    def _bind_cache(self, binding=None) -> None:
        """Bind what stays the same from step to step: the logits output and the KV cache (in
        place: each buffer as both past and present, once for the whole request)."""
        d, binding = self._decoder, binding or self._binding
        binding.kept = None  # a new or cleared binding: the step binds logits_to_keep (KeptLogits)
        binding.bind_output("logits", "cpu")  # the first output bound: get_outputs()[0]
        for past, present in zip(d.past_names, d.present_names):
            binding.bind_ortvalue_input(past, self._cache[past])
            if self._in_place:
                binding.bind_ortvalue_output(present, self._cache[past])
            else:
                binding.bind_output(present, "cpu")

    def _step(self, token_ids: Sequence[int], keep: int) -> np.ndarray:
        """Run `token_ids` after the cached tokens; the logits of the last `keep` positions."""
        d, binding = self._decoder, self._binding
        keep = min(keep, len(token_ids))
        if self._cacheless:
            ids = np.asarray([[*self.tokens, *token_ids]], dtype=np.int64)
            feeds = d.feeds(ids, 0)
            if d.keeps_logits:
                feeds[LOGITS_TO_KEEP] = np.array([keep], dtype=np.int64)
            logits = d.session_for(ids.size).run(["logits"], feeds)[0]
            d.model_runs += 1
            self.tokens.extend(int(t) for t in token_ids)
            return logits[0, -keep:]
        ids = np.asarray([token_ids], dtype=np.int64)
        length = len(self.tokens) + ids.shape[1]
        if self._in_place and length > self.capacity:
            self._grow(length)
        session = d.session_for(ids.size)
        if session is not d.session:
            if self._prompt_binding is None:
                self._prompt_binding = session.io_binding()
            binding = self._prompt_binding
        if not self._in_place:  # the cache values change every step: bind them anew
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            self._bind_cache(binding)
        if d.keeps_logits:
            self._kept_logits.bind(binding, keep)
        for name, value in d.feeds(ids, length - ids.shape[1]).items():  # replaces the previous step's binding
            binding.bind_cpu_input(name, value)
        session.run_with_iobinding(binding)
        d.model_runs += 1
        self.tokens.extend(int(t) for t in token_ids)
        outputs = binding.get_outputs()
        if not self._in_place:
            self._cache = dict(zip(d.past_names, outputs[1:]))
        # a copy: ONNX Runtime writes the next step's logits into the same buffer
        return outputs[0].numpy()[0, -keep:].copy()


def shared_prefix(held: Sequence[int], tokens: Sequence[int]) -> int:
    """How many tokens `held` and `tokens` share from the start."""
    shared = 0
    for cached, new in zip(held, tokens):
        if cached != new:
            break
        shared += 1
    return shared


def check_run(new_tokens: int, keep: int, held: int = 0, context: int | None = None) -> None:
    """A step of `new_tokens` after `held` cached ones, keeping the logits of the last `keep`
    positions, is one a cache can run (within the model's `context`, where the caller checks it)."""
    if not 1 <= keep <= min(new_tokens, PREFILL_CHUNK):
        raise MoepassError(f"logits of {keep} positions asked after {new_tokens} new tokens")
    if context and held + new_tokens > context:
        raise MoepassError(f"{held + new_tokens} tokens do not fit the model's context of {context}")
