"""Several sequences decoded together: N slots of one KV cache, one model thread, continuous batching.

On a CPU a decode step is bound by reading the weights; a step over a batch reads the dense weights
once for all its sequences (and each expert once for all the tokens the batch routes to it), so N
sequences decoded together cost little more than one. `Slots` keeps one KV cache buffer per layer
of shape [N, kv heads, capacity, head size]; each sequence holds a slot (`SlotCache`, with
`KVCache`'s interface, so generation, sampling, stop strings, log probabilities and speculative
decoding run per sequence as they do alone). Every sequence runs on a thread of its own and asks
the model thread for its next step; the model thread waits until every open sequence has asked,
then runs (or after GATHER_SECONDS, with those that asked)
- one decode step over all sequences that asked for one token: rows 0..m-1 of the buffers
  (GroupQueryAttention takes a length per row: the attention mask's row sums, right-padded), and
- one chunk of one prompt (at most PREFILL_CHUNK tokens, on its own row): a new request's prompt
  is computed between decode steps, so that the running streams keep flowing; a speculative
  decoding check (the last token and its drafts) is such a step too.

Each row's result is bitwise the one that sequence gets alone where every kernel computes a row
the same at any batch size: at the test fixtures' sizes (checked by tests/test_batch.py against
`KVCache`). At Qwen3-30B-A3B's sizes QMoE and 8-bit MatMulNBits compute an expert's rows in another
order for one token than for several, so a row's logits differ from its logits alone in the last
bits, as llama.cpp's differ between batch sizes.

The sequences of a decode step must sit in rows 0..m-1: before the step, slots swap rows (their
filled positions copied, which costs far less than computing them). A slot that is free keeps the
tokens its last sequence left; a new sequence takes the free slot sharing the longest prefix with
its prompt (llama-server's prompt cache per slot), else the one unused longest. The buffers start
at FIRST_CAPACITY positions a slot (or the context) and grow by one copy up to the model's context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moepass.core.errors import MoepassError
from moepass.runtime.kv_cache import FIRST_CAPACITY, PREFILL_CHUNK, Cache, KeptLogits, check_run, shared_prefix

Decoder = Any  # moepass.runtime.decoder.Decoder, which imports this module

# the longest a step waits for a sequence that has not asked yet (one held up elsewhere)
GATHER_SECONDS = 0.1


class Cancelled(MoepassError):
    """The sequence was cancelled (its client went away); its slot is free."""


@dataclass(eq=False)
class Slot:
    """One slot of the cache: the buffer row it sits in now and the tokens its positions hold."""

    id: int
    row: int
    tokens: list[int] = field(default_factory=list)
    used: float = 0.0  # when a sequence last released it (the least recently used is taken first)
    draft_cache: Any = None  # the draft model's cache that follows this slot (speculative decoding)
    task: Any = None  # what the owner shows of the sequence holding it (the server's /slots)


@dataclass(eq=False)
class _Request:
    cache: SlotCache
    token_ids: list[int]
    keep: int
    done: int = 0  # of token_ids, run
    rows: np.ndarray | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def single(self) -> bool:
        return len(self.token_ids) == 1


class Slots:
    """`count` slots over one decoder, and the model thread that runs their steps. `open()` a slot
    for a sequence, generate through it from that sequence's own thread (`Decoder.generate_text(...,
    cache=slot_cache)`), `release()` it in a `finally`; `close()` stops the model thread."""

    def __init__(self, decoder: Decoder, count: int):
        if count < 1:
            raise MoepassError(f"{count} slots: at least 1")
        if not decoder.batchable:
            raise MoepassError(decoder.batch_refusal)
        import onnxruntime as ort

        self._ort = ort
        self.decoder = decoder
        self.count = count
        self.capacity = max(1, min(decoder.context_length or FIRST_CAPACITY, FIRST_CAPACITY))
        self._buffers = decoder.empty_cache(batch=count, length=self.capacity)
        self.slots = [Slot(i, i) for i in range(count)]
        self._rows = list(self.slots)  # buffer row -> the slot in it
        self._free = list(self.slots)
        self._bindings: dict[tuple[int, int], Any] = {}  # (first row, rows) -> an IO binding with the cache bound
        self._kept_logits = KeptLogits(ort)
        self._cond = threading.Condition()
        self._open: set[SlotCache] = set()  # sequences that asked for a step and are not released
        self._pending: dict[SlotCache, _Request] = {}
        self._closed = False
        self.decode_steps = 0  # steps of one token per sequence
        self.batched_rows = 0  # the rows they ran together (their mean: the batch's width)
        self._thread = threading.Thread(target=self._serve, name="moepass-slots", daemon=True)
        self._thread.start()

    # -- the sequences' side ------------------------------------------------------------------

    def open(self, prompt_ids: Sequence[int] = (), reuse: bool = True) -> SlotCache:
        """A free slot for a new sequence: with `reuse`, the one whose tokens share the longest
        prefix with `prompt_ids` (its cached positions are not computed again), else the one unused
        longest (its tokens forgotten). MoepassError when every slot is taken."""
        with self._cond:
            if self._closed:
                raise MoepassError("the slots are closed")
            if not self._free:
                raise MoepassError(f"all {self.count} slots are taken")
            prompt = list(prompt_ids)
            best = min(self._free, key=lambda s: s.used)
            if reuse:
                longest = max(self._free, key=lambda s: (shared_prefix(s.tokens, prompt), -s.used))
                if shared_prefix(longest.tokens, prompt):
                    best = longest
            self._free.remove(best)
            if not reuse:
                best.tokens.clear()
            return SlotCache(self, best)

    def release(self, cache: SlotCache) -> None:
        """The sequence is done: its slot is free (its tokens kept for a later prompt)."""
        with self._cond:
            if cache.released:
                return
            cache.released = True
            self._open.discard(cache)
            request = self._pending.pop(cache, None)
            if request is not None:  # a thread that gave up waiting
                request.error = Cancelled("released")
                request.finished.set()
            cache.slot.used = time.monotonic()
            cache.slot.task = None
            self._free.append(cache.slot)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the model thread; steps still asked for fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    @property
    def active(self) -> int:
        """Slots held by a sequence."""
        with self._cond:
            return self.count - len(self._free)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def _ask(self, request: _Request) -> np.ndarray:
        cache = request.cache
        with self._cond:
            if self._closed:
                raise MoepassError("the slots are closed")
            if cache.released:
                raise MoepassError("the slot was released")
            if cache.cancelled:
                self._open.discard(cache)
                self._cond.notify_all()
                raise Cancelled("cancelled")
            self._open.add(cache)
            self._pending[cache] = request
            self._cond.notify_all()
        request.finished.wait()
        if request.error is not None:
            raise request.error
        assert request.rows is not None
        return request.rows

    # -- the model thread ------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._pending:
                    self._cond.wait()
                # the step waits for every open sequence's request (one that is choosing its token
                # now asks in a moment), but not longer than GATHER_SECONDS: a sequence whose thread
                # is held up elsewhere delays the others by that much, never stops them
                deadline = time.monotonic() + GATHER_SECONDS
                while not self._closed and len(self._pending) < len(self._open):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    for request in self._pending.values():
                        request.error = MoepassError("the slots are closed")
                        request.finished.set()
                    self._pending.clear()
                    return
                for cache, request in list(self._pending.items()):  # a client gone: its slot frees now
                    if cache.cancelled:
                        self._finish(request, error=Cancelled("cancelled"))
                        self._open.discard(cache)
                work = list(self._pending.values())
            decodes = [r for r in work if r.single]
            prompts = [r for r in work if not r.single]
            if decodes:
                self._guarded(decodes, self._decode_step)
            if prompts:  # the oldest: one chunk of it
                self._guarded(prompts[:1], lambda requests: self._prompt_step(requests[0]))

    def _guarded(self, requests: list[_Request], step) -> None:
        try:
            step(requests)
        except Exception as e:  # ONNX Runtime's own exception types: the asking sequences get them
            with self._cond:
                for request in requests:
                    self._finish(request, error=MoepassError(f"the model step failed: {e}"))

    def _finish(self, request: _Request, rows: np.ndarray | None = None, error: BaseException | None = None) -> None:
        """(under the lock) the request answered: its thread goes on."""
        request.rows, request.error = rows, error
        self._pending.pop(request.cache, None)
        request.finished.set()

    def _decode_step(self, requests: list[_Request]) -> None:
        """One token for each of `requests`, together: their slots moved to rows 0..m-1 first."""
        m = len(requests)
        wanted = {r.cache.slot for r in requests}
        spare = [row for row in range(m) if self._rows[row] not in wanted]
        for request in requests:
            if request.cache.slot.row >= m:
                self._swap(request.cache.slot.row, spare.pop())
        requests = sorted(requests, key=lambda r: r.cache.slot.row)
        logits = self._run(0, [r.cache.slot.tokens for r in requests], [r.token_ids for r in requests], 1)
        self.decode_steps += 1
        self.batched_rows += m
        with self._cond:
            for i, request in enumerate(requests):
                request.cache.slot.tokens.extend(request.token_ids)
                self._finish(request, rows=logits[i].copy())

    def _prompt_step(self, request: _Request) -> None:
        """The next chunk of a request of several tokens (a prompt, or a token with its drafts),
        on its slot's own row; answered after its last chunk, with the logits of its last `keep`
        positions (the chunks as KVCache.run_rows cuts them)."""
        slot = request.cache.slot
        rest = request.token_ids[request.done :]
        if len(rest) > PREFILL_CHUNK:
            head, keep = min(PREFILL_CHUNK, len(rest) - request.keep), 1
        else:
            head, keep = len(rest), request.keep
        chunk = rest[:head]
        logits = self._run(slot.row, [slot.tokens], [chunk], keep)
        slot.tokens.extend(chunk)
        request.done += head
        if request.done == len(request.token_ids):
            with self._cond:
                self._finish(request, rows=logits[0].copy())

    def _swap(self, a: int, b: int) -> None:
        """Exchange the slots in buffer rows a and b: their filled positions and their places."""
        first, second = self._rows[a], self._rows[b]
        length = max(len(first.tokens), len(second.tokens))
        if length:
            for buffer in self._buffers.values():
                held = buffer[a, :, :length].copy()
                buffer[a, :, :length] = buffer[b, :, :length]
                buffer[b, :, :length] = held
        self._rows[a], self._rows[b] = second, first
        first.row, second.row = b, a

    def _grow(self, needed: int) -> None:
        limit = self.decoder.context_length or needed
        self.capacity = min(max(needed, 2 * self.capacity), limit)
        grown = self.decoder.empty_cache(batch=self.count, length=self.capacity)
        for name, buffer in self._buffers.items():
            filled = buffer.shape[2]
            grown[name][:, :, :filled] = buffer
        self._buffers = grown
        self._bindings.clear()

    def _binding(self, first: int, rows: int):
        """An IO binding over buffer rows first..first+rows-1, the cache bound as both past and present
        (GroupQueryAttention writes each step's keys and values in place)."""
        key = (first, rows)
        binding = self._bindings.get(key)
        if binding is None:
            d = self.decoder
            binding = d.session.io_binding()
            binding.bind_output("logits", "cpu")  # the first output bound: get_outputs()[0]
            for past, present in zip(d.past_names, d.present_names):
                view = self._ort.OrtValue.ortvalue_from_numpy(self._buffers[past][first : first + rows])
                binding.bind_ortvalue_input(past, view)
                binding.bind_ortvalue_output(present, view)
            self._bindings[key] = binding
        return binding

    def _run(self, first: int, held: list[list[int]], new: list[list[int]], keep: int) -> np.ndarray:
        """The model over rows first..first+len(new)-1, row i running `new[i]` after the `held[i]`
        tokens its slot holds; the logits [rows, keep, vocab] of each row's last `keep` positions."""
        d = self.decoder
        width = len(new[0])
        lengths = [len(h) for h in held]
        total = max(lengths) + width
        if total > self.capacity:
            self._grow(total)
        binding = self._binding(first, len(new))
        if d.keeps_logits:
            self._kept_logits.bind(binding, keep)
        for name, value in d.row_feeds(np.asarray(new, dtype=np.int64), lengths).items():
            binding.bind_cpu_input(name, value)
        d.session.run_with_iobinding(binding)
        d.model_runs += 1
        return binding.get_outputs()[0].numpy()[:, -keep:]


class SlotCache(Cache):
    """One sequence's view of its slot, a `Cache` as KVCache is (`extend`, `run`, `run_rows`,
    `truncate`, `tokens`, `prefilled`): each step is asked of the model thread, which runs it with
    the other sequences'. `cancel()` (from any thread) ends the sequence at its next step."""

    def __init__(self, slots: Slots, slot: Slot):
        self.slots = slots
        self.slot = slot
        self.tokens = slot.tokens  # the slot's own list: changed in place only, whoever changes it
        self.prefilled = 0
        self.cancelled = False
        self.released = False

    @property  # the slot's: it stays with the slot for the next sequence
    def draft_cache(self):
        return self.slot.draft_cache

    @draft_cache.setter
    def draft_cache(self, cache) -> None:
        self.slot.draft_cache = cache

    def cancel(self) -> None:
        with self.slots._cond:
            self.cancelled = True
            self.slots._cond.notify_all()

    def run_rows(self, token_ids: Sequence[int], keep: int) -> np.ndarray:
        token_ids = list(token_ids)
        check_run(len(token_ids), keep, len(self.tokens), self.slots.decoder.context_length)
        self.prefilled = len(token_ids)
        return self.slots._ask(_Request(self, token_ids, keep))

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
