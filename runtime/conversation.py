"""A multi-turn chat over one model: the messages so far, rendered by the model's chat template,
and one KV cache kept from turn to turn, so that each turn prefills only what the history does not
already hold (the new user message and the template's markup around it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from moepass.runtime.kv_cache import KVCache
from moepass.runtime.sampling import Sampling

if TYPE_CHECKING:
    from moepass.runtime.decoder import Decoder, TextStream


class Conversation:
    """`say(text)` streams the assistant's answer and keeps it in the history (what was shown of it,
    when the answer is stopped early)."""

    def __init__(self, decoder: Decoder, system: str | None = None, **variables: Any):
        self.decoder = decoder
        self.system = system
        self.variables = variables  # for the template, e.g. enable_thinking=False
        self.messages: list[dict[str, str]] = []
        self.cache: KVCache | None = None
        self.last: TextStream | None = None

    def reset(self) -> None:
        """Forget the history (the cache keeps what a new history shares with it: the system prompt)."""
        self.messages = []

    def clear(self) -> None:
        """Forget the history and the KV cache itself (its memory freed; the next turn computes its
        whole prompt, the system prompt kept)."""
        self.messages = []
        self.cache = None
        self.last = None

    def prompt_ids(self, user_text: str) -> list[int]:
        """The whole history and the new message, as tokens. Where the rendered history begins
        with the text the cache holds, those very tokens are kept (the answer as it was generated,
        as llama-cli keeps it) and only the rest is tokenized; otherwise (a template that rewrites
        earlier turns, such as Qwen3 dropping old reasoning) the cache keeps the prefix it shares."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        rendered = self.decoder.chat_template.render(
            [*system, *self.messages, {"role": "user", "content": user_text}], **self.variables
        )
        bos, eos = self.decoder.added_tokens
        tokens = self.cache.tokens if self.cache is not None else []
        if tokens[: len(bos)] == bos and len(tokens) > len(bos) and not eos:
            body = self.decoder.chat_body(rendered)
            held = self.decoder.decode(tokens[len(bos) :])  # the BOS encode added is not in the text
            if len(body) > len(held) and body.startswith(held):
                return [*tokens, *self.decoder.encode(body[len(held) :], special=False)]
        return self.decoder.encode_chat(rendered)

    def say(
        self, user_text: str, max_new_tokens: int, sampling: Sampling = Sampling(), stop: Sequence[str] = ()
    ) -> Iterator[str]:
        ids = self.prompt_ids(user_text)
        self.decoder.room_for(len(ids), max_new_tokens)  # a turn that does not fit: refused, the history kept
        if self.cache is None:
            self.cache = KVCache(self.decoder, capacity=len(ids) + max_new_tokens)
        self.last = stream = self.decoder.generate_text(ids, max_new_tokens, sampling, stop, cache=self.cache)
        self.messages.append({"role": "user", "content": user_text})
        try:
            yield from stream
        finally:  # an answer stopped early (Ctrl-C) stays in the history as far as it was shown
            self.messages.append({"role": "assistant", "content": stream.text})
