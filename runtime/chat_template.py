"""Chat templates rendered as Hugging Face transformers' `apply_chat_template` renders them.

A GGUF's `tokenizer.chat_template` is Jinja code from the model file: it runs in Jinja's immutable
sandbox (no attribute of Python's internals, no mutation of what it is given), with the same
environment transformers builds (`trim_blocks`, `lstrip_blocks`, loop controls, the
`{% generation %}` block, a `tojson` that does not escape HTML, `raise_exception`,
`strftime_now`) and the variables it passes: `messages`, `tools`, `documents`,
`add_generation_prompt`, `bos_token`, `eos_token`, and any extra keyword such as Qwen3's
`enable_thinking`. An undefined variable is what transformers makes it: false, and printed as
nothing; reaching into one (`x.y` of an undefined `x`) is an error, as there, and so is an
attribute the sandbox refuses (where transformers would print nothing).

Whatever the template raises or is refused becomes one `MoepassError` naming the file it came from.
A template is code from the model file, so rendering is bounded: RENDER_SECONDS of time (the render
runs in a worker thread, stopped at the limit) and MAX_RENDERED_CHARS of text, also for a string or
list repeated by `*` inside it.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moepass.core.errors import MoepassError

RENDER_SECONDS = 10.0
MAX_RENDERED_CHARS = 32 << 20  # far beyond any context: a prompt of 8 million tokens and more


class _Stopped(BaseException):
    """Raised inside a render that ran past RENDER_SECONDS (not an Exception: the template cannot catch it)."""


# Templates test for these to offer a reasoning switch (Qwen3, DeepSeek-V3.1, Granite, SmolLM3, ...)
THINKING_SWITCHES = ("enable_thinking", "thinking")


def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise MoepassError("chat templates need jinja2: pip install 'moepass[chat]'") from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with
        it (for training masks); rendering keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Undefined(jinja2.Undefined):
        """transformers' undefined (false, printed as nothing), except that what the sandbox refused
        (an attribute of Python's internals) is an error at once instead of an empty value."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self._undefined_exception is SecurityError:
                self._fail_with_undefined_error()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with `*` and `**` checked before they build a value too large to render."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        if len(seq) * times > MAX_RENDERED_CHARS:
                            raise SecurityError(f"a value of {len(seq) * times:,} items is past the render limit")
            if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(right) > 4096:
                raise SecurityError(f"an exponent of {right} is past the render limit")
            return super().call_binop(context, operator, left, right)

    env = Bounded(
        trim_blocks=True, lstrip_blocks=True, undefined=Undefined, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One compiled chat template; `where` names its file in every error."""

    def __init__(self, source: str, where: str | Path, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.where = str(where)
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except MoepassError:
            raise
        except Exception as e:  # noqa: BLE001 - TemplateSyntaxError and whatever the parser raises
            raise self._error(e) from None

    @property
    def thinking_switch(self) -> str | None:
        """The variable this template reads to turn reasoning on or off, if any."""
        return next((name for name in THINKING_SWITCHES if re.search(rf"\b{name}\b", self.source)), None)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict] | None = None,
        documents: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text for `messages` (dicts with `role` and `content`, as OpenAI's API sends
        them). Unlike `apply_chat_template`, `add_generation_prompt` defaults to True: moepass renders
        to generate the next assistant turn."""
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **variables,
            "messages": list(messages),
            "tools": None if tools is None else list(tools),
            "documents": None if documents is None else list(documents),
            "add_generation_prompt": add_generation_prompt,
        }
        rendered = _bounded(lambda: self._render(context), RENDER_SECONDS)
        if rendered is None:
            raise MoepassError(f"{self.where}: the chat template ran for more than {RENDER_SECONDS:.0f} s; stopped")
        if isinstance(rendered, Exception):
            raise self._error(rendered)
        return rendered

    def _render(self, context: dict[str, Any]) -> str | Exception:
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise MemoryError(f"the text is past {MAX_RENDERED_CHARS:,} characters")
                pieces.append(piece)
            return "".join(pieces)
        except Exception as e:  # noqa: BLE001 - whatever the model file's template raises: SecurityError,
            # TemplateError, or a Python error from its expressions (1/0, range limits, deep recursion)
            return e

    def _error(self, e: Exception) -> MoepassError:
        message = str(e).splitlines()[0] if str(e) else "no message"
        return MoepassError(f"{self.where}: the chat template cannot be rendered ({type(e).__name__}: {message})")


def _bounded(work, seconds: float):
    """`work()` in a worker thread, waited on for `seconds`; past them the thread is stopped (an
    exception raised in it at its next Python instruction: a template is Python code once
    compiled) and None is returned."""
    result: list = []

    def run() -> None:
        try:
            result.append(work())
        except _Stopped:
            pass

    worker = threading.Thread(target=run, name="chat-template", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive() and worker.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Stopped))
        worker.join(1.0)
    return result[0] if result else None
