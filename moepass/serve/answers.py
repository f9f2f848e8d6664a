"""What a chat model's answer holds, read as it streams: the text, the reasoning and the tool calls,
in the two formats published chat templates define for them.

- "hermes" (Qwen2.5, Qwen3, QwQ, Hermes 2/3: a template that writes `<tool_call>`): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the answer's text; the rest is content.
- "harmony" (gpt-oss: `<|channel|>` and `<|message|>`): the answer is messages
  `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY`, each closed by
  `<|end|>` (or the generation's end: `<|return|>`, `<|call|>`) and the next opened by `<|start|>`;
  `analysis` is reasoning, `final` content, a message to `functions.NAME` a tool call whose body is
  its arguments (the recipient may also stand in the role's header, `<|start|>assistant to=...`).

`AnswerReader.feed(piece)` returns the events the new text completes, ("content", text),
("reasoning", text) or ("tool_call", ToolCall), holding back only what could still turn out to be
markup; `finish()` returns the rest. A call whose JSON does not parse stays in the content as the
model wrote it, as llama-server leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

HERMES, HARMONY = "hermes", "harmony"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HARMONY_BODY_ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def answer_format(template_source: str) -> str | None:
    """The tool-call format a chat template defines (HERMES, HARMONY), or None."""
    if "<|channel|>" in template_source and "<|message|>" in template_source:
        return HARMONY
    if _OPEN in template_source:
        return HERMES
    return None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if m.startswith(text[-n:])),
               default=0)  # fmt: skip


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call["name"], text)


class AnswerReader:
    """One answer's text, fed piece by piece (`fmt`: HERMES or HARMONY)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._buffer = ""
        self._inside = False  # hermes: within <tool_call>; harmony: within a message's body
        self._channel: str | None = None
        self._recipient: str | None = None
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        self._buffer += piece
        return self._hermes(final=False) if self.fmt == HERMES else self._harmony(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._hermes(final=True) if self.fmt == HERMES else self._harmony(final=True)

    def _content(self, events: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):  # whitespace between or after calls: none
            events.append(("content", text))

    def _hermes(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            if not self._inside:
                at = self._buffer.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _held(self._buffer, (_OPEN,))
                    self._content(events, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(events, self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(_OPEN) :], True
            at = self._buffer.find(_CLOSE)
            if at < 0 and not final:
                return events
            body = self._buffer if at < 0 else self._buffer[:at]
            call = _hermes_call(body.strip())
            if call is None:
                self._content(events, _OPEN + body + (_CLOSE if at >= 0 else ""))
            else:
                self.calls += 1
                events.append(("tool_call", call))
            self._buffer = "" if at < 0 else self._buffer[at + len(_CLOSE) :]
            self._inside = False
            if at < 0:
                return events

    def _harmony(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            if not self._inside:
                at = self._buffer.find("<|message|>")
                if at < 0:
                    if final and self._buffer.strip() and "<|channel|>" not in self._buffer:
                        self._content(events, self._buffer)  # no harmony markup at all: plain text
                    if final:
                        self._buffer = ""
                    return events
                header = self._buffer[:at]
                channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
                self._channel = channel.group(1) if channel else None
                self._recipient = recipient.group(1) if recipient else None
                self._buffer, self._inside = self._buffer[at + len("<|message|>") :], True
            ends = [(i, m) for m in _HARMONY_BODY_ENDS if (i := self._buffer.find(m)) >= 0]
            if not ends and not final:
                if self._recipient is None:  # reasoning and content stream; a call's body waits
                    keep = _held(self._buffer, _HARMONY_BODY_ENDS)
                    self._body(events, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                return events
            at, marker = min(ends) if ends else (len(self._buffer), "")
            self._body(events, self._buffer[:at])
            self._buffer, self._inside = self._buffer[at + len(marker) :], False
            if not ends:
                return events

    def _body(self, events: list, text: str) -> None:
        if self._recipient is not None:  # a call's body is whole here: it waited in the buffer
            self.calls += 1
            events.append(("tool_call", ToolCall(self._recipient, text.strip())))
        elif text:
            events.append(("reasoning" if self._channel == "analysis" else "content", text))
