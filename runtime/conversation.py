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

    def prompt_ids(self, user_text: str) -> list[int]:
        """The whole history and the new message, as tokens. Where the rendered history begins
        with the text the cache holds, those very tokens are kept (the answer as it was generated,
        as llama-cli keeps it) and only the rest is tokenized; otherwise (a template that rewrites
        earlier turns, such as Qwen3 dropping old reasoning) the cache keeps the prefix it shares."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        rendered = self.decoder.chat_template.render(
            [*system, *self.messages, {"role": "user", "content": user_text}], **self.variables
        )
        if self.cache is not None and self.cache.tokens:
            held = self.decoder.decode(self.cache.tokens)
            if len(rendered) > len(held) and rendered.startswith(held):
                return [*self.cache.tokens, *self.decoder.encode(rendered[len(held) :])]
        return self.decoder.encode(rendered)

    def say(
        self, user_text: str, max_new_tokens: int, sampling: Sampling = Sampling(), stop: Sequence[str] = ()
    ) -> Iterator[str]:
        ids = self.prompt_ids(user_text)
        if self.cache is None:
            self.cache = KVCache(self.decoder, capacity=len(ids) + max_new_tokens)
        self.last = stream = self.decoder.generate_text(ids, max_new_tokens, sampling, stop, cache=self.cache)
        self.messages.append({"role": "user", "content": user_text})
        try:
            yield from stream
        finally:  # an answer stopped early (Ctrl-C) stays in the history as far as it was shown
            self.messages.append({"role": "assistant", "content": stream.text})
