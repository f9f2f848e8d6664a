"""`moepass serve`: an OpenAI-compatible HTTP server over one converted (or partitioned) model.

Endpoints as llama-server offers them: `POST /v1/chat/completions`, `POST /v1/completions` (each
streamed as server-sent events with `"stream": true`), `GET /v1/models` (the model's id is its
folder's name), `GET /health`, and llama-server's own: `POST /completion` (its request and answer
fields, `n_predict`, `stop_type`, ...: `llama_body`, `LlamaReply`), `GET /props`, `GET /slots` (one
entry a slot) and `GET /metrics` (Prometheus text, `llamacpp:` names: `Metrics`); and the chat page
at `/` (moepass/serve/webui). The server holds one model, so a request's `model` may name any (as
llama-server takes it); the answer names the served one. The model loads as `moepass run` loads it
(a partitioned model with its expert placement). Up to `parallel` requests generate at once in the
slots of one batch (moepass.runtime.batch; one at a time on a session that cannot batch), the others
wait in a bounded queue, in the order they came: a request that finds it full is answered 503 at
once. A client that goes away stops its generation at its next step. Request fields beyond
OpenAI's, as llama-server has them: `top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`,
`cache_prompt` (default true: the prefix a prompt shares with what a slot holds is not computed
again), `chat_template_kwargs` (e.g.
`{"enable_thinking": false}`); absent sampling fields take llama-server's defaults. `tools` reach
the chat template and the answer's tool calls and reasoning are read out of it (moepass.serve.answers)
into OpenAI's `tool_calls` and llama-server's `reasoning_content`; `logprobs` are the model's own
(chat: `logprobs`/`top_logprobs`; completions: `logprobs` N). Bad requests, and fields the server
does not take, get OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`) with a
4xx status naming the field, and the server goes on serving.

Requests are untrusted input, and the server stays up under them: a body past `max_body` bytes
(`--max-body`, default MAX_BODY) is answered 413 from its Content-Length, before it is read (or as
soon as a chunked one passes the limit); one that does not arrive within BODY_SECONDS
(`--timeout`), 408; JSON nested too deep or holding lone surrogates, 400; a text longer than the
model's context could hold is refused before it is tokenized; chat templates are rendered, and
prompts tokenized, off the event loop (a template bounded in time and size:
moepass.runtime.chat_template), so /health and the other clients are answered meanwhile. Every
status, 404 and 405 too, comes as OpenAI's error object, and a failed request is one line in the
log.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' parameter types (Request) at runtime
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import ipaddress
import itertools
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from moepass.core.errors import MoepassError, first_line
from moepass.core.sampling import Sampling
from moepass.runtime.batch import Cancelled, SlotCache
from moepass.serve.answers import HARMONY, HERMES, AnswerReader, answer_format

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from moepass.runtime import KVCache

# a request's sampling fields bear moepass.Sampling's names (OpenAI's, and llama-server's for the rest)
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
_INTEGER_FIELDS = ("top_k", "seed", "repeat_last_n")
_RANGES = {
    "temperature": (0, 2),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2),
    "repeat_penalty": (0, 10),
}
MAX_BODY = 8 << 20  # bytes: a 2-million-token prompt as text, several times over
BODY_SECONDS = 30.0
DISCONNECT_POLL = 0.25  # seconds between looks for a client gone while its answer is computed
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
_N_PREDICT = ("n_predict", "max_completion_tokens", "max_tokens")  # llama-server's order: the first given counts
RANDOM_SEED = 0xFFFFFFFF  # llama-server's LLAMA_DEFAULT_SEED: a random seed (so is -1)
# the sampling chain moepass.runtime.sampling applies, in its order, by llama-server's names
_SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]
# the request fields each endpoint takes; any other is answered 400, naming it (never ignored)
_COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop", "n", "user",
                  "cache_prompt", "logprobs", *_SAMPLING_FIELDS}  # fmt: skip
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls",
                                "top_logprobs"}  # fmt: skip
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
# llama-server's /completion: its names for the token limit (n_predict; max_tokens and
# max_completion_tokens are its aliases) and return_tokens beside the sampling fields
LLAMA_COMPLETION_FIELDS = {"model", "prompt", "stream", "stop", "cache_prompt", "return_tokens", *_N_PREDICT,
                           *_SAMPLING_FIELDS}  # fmt: skip
# what some clients send that moepass cannot do, and why (the 400's words)
_UNSUPPORTED = {
    "response_format": "structured output needs grammar-constrained sampling, which moepass does not have",
    "logit_bias": "logit biases are not applied yet",
    "functions": "the deprecated functions field: send tools",
    "function_call": "the deprecated function_call field: send tool_choice",
    "echo": "the prompt is not echoed",
    "suffix": "fill-in-the-middle suffixes are not supported",
    "best_of": "best_of needs several generations; only n = 1 is supported",
    "n_probs": "token probabilities come from /v1/completions (logprobs N)",
    "grammar": "grammar-constrained sampling is not supported",
    "json_schema": "structured output needs grammar-constrained sampling, which moepass does not have",
    "n_keep": "the context is not shifted: a prompt and answer longer than the context stop at its end",
}


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, and the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        **counts: int,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.counts = status, param, code, kind, counts

    def body(self) -> dict:
        """OpenAI's error object, and llama-server's counts where it gives them (`n_prompt_tokens`, `n_ctx`)."""
        return {
            "error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code, **self.counts}
        }


def _number(body: dict, name: str, integer: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    low, high = _RANGES.get(name, (0, None))
    if value < low or (high is not None and value > high):
        raise RequestError(
            400,
            f"'{name}' must be between {low} and {high}" if high is not None else f"'{name}' must be >= {low}",
            name,
        )
    return value


def sampling_of(body: dict, defaults):
    """The request's sampling settings over `defaults` (a `Sampling`)."""
    changes = {}
    for field in _SAMPLING_FIELDS:
        value = _number(body, field, integer=field in _INTEGER_FIELDS)
        if value is not None:
            changes[field] = value
    if changes.get("top_p") == 0:
        raise RequestError(400, "'top_p' must be above 0", "top_p")
    if "repeat_penalty" in changes and changes["repeat_penalty"] <= 0:
        raise RequestError(400, "'repeat_penalty' must be above 0", "repeat_penalty")
    if "seed" in changes:
        changes["seed"] %= 2**64
    return dataclasses.replace(defaults, **changes)


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    return stops


def check_fields(body: dict, allowed: set[str]) -> None:
    """A field the endpoint does not take is a 400 naming it."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0]
        why = _UNSUPPORTED.get(name, "moepass serve does not take it")
        raise RequestError(400, f"'{name}' is not supported: {why}", name, "unsupported_parameter")


def llama_body(body: dict) -> dict:
    """A llama-server /completion request as the generation reads a /v1/completions one: its token
    limit (`n_predict`, or its aliases `max_completion_tokens`, `max_tokens`; -1: none but the end
    of generation or the context) as `max_tokens`, a seed of -1 (or RANDOM_SEED) as none; the other
    fields are the same. `return_tokens` must be true or false."""
    out = {k: v for k, v in body.items() if k not in _N_PREDICT and k != "seed"}
    given = [(n, body[n]) for n in _N_PREDICT if body.get(n) is not None]
    for name, value in given:  # each checked; the first counts
        if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
            raise RequestError(400, f"'{name}' must be -1 (no limit but the context) or a positive integer", name)
    if given and given[0][1] != -1:
        out["max_tokens"] = given[0][1]
    seed = body.get("seed")
    if not (type(seed) is int and seed in (-1, RANDOM_SEED)):
        out["seed"] = seed
    if not isinstance(body.get("return_tokens", False), bool):
        raise RequestError(400, "'return_tokens' must be true or false", "return_tokens")
    return out


def llama_params(sampling: Sampling, n_predict: int, stops: list[str], stream: bool) -> dict:
    """A request's settings under llama-server's names (its `params` in /slots and /props, its
    `generation_settings`), as far as moepass has them."""
    return {
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": RANDOM_SEED if sampling.seed is None else sampling.seed,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "repeat_last_n": sampling.repeat_last_n,
        "repeat_penalty": sampling.repeat_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "stop": stops,
        "stream": stream,
        "n_probs": 0,
        "samplers": _SAMPLERS,
    }


def logprobs_wanted(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request asks log probabilities for (None: no logprobs).
    Chat: `logprobs` true and `top_logprobs` N; completions: `logprobs` N."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, "'logprobs' must be true or false", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not value:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        name, value = "top_logprobs", (top if top is not None else 0) if value else None
    else:
        name = "logprobs"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(400, f"'{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return value


def tool_choice(body: dict) -> bool:
    """Whether the request's tools reach the template: `tool_choice` "auto" (the default) or "none".
    A forced call ("required", a named function) needs constrained sampling: refused."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    raise RequestError(
        400,
        f"'tool_choice' {json.dumps(choice)} is not supported: moepass cannot force a tool call (no "
        'grammar-constrained sampling); send "auto" or "none"',
        "tool_choice",
    )


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list of objects", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):  # fmt: skip
            raise RequestError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                               f"tools[{i}]")  # fmt: skip
    return tools  # parallel_tool_calls: checked with the other fields (ModelServer.task_of)


def _call_for_template(call: Any) -> Any:
    """An assistant message's tool call as templates read it: OpenAI sends the arguments as JSON
    text; templates iterate over them or pass them to tojson (llama-server parses them too)."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        except RecursionError:
            raise RequestError(400, "a tool call's arguments are JSON nested too deep", "messages") from None
        if isinstance(arguments, dict):
            return {**call, "function": {**function, "arguments": arguments}}
    return call


def message_text(message: Any, i: int) -> dict:
    """One chat message as the template gets it: role and content as strings (a list of text parts
    is joined, as llama-server does), tool calls' arguments as mappings."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if content is None and message.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise RequestError(
            400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
        )
    message = {**{k: v for k, v in message.items() if k != "content"}, "content": content}
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
    return message


class ModelServer:
    """The model, its slots and its queue; `chat_prompt` and `completion_prompt` turn a request body
    into prompt tokens, then `answer` streams the answer. With `parallel` slots (llama-server's
    -np) that many requests generate at once, decoded together in one batch
    (moepass.runtime.batch.Slots); more wait in the queue of `queue_size`, and past it get 503."""

    def __init__(
        self,
        decoder,
        model_id: str,
        queue_size: int = 8,
        defaults=None,
        echo: Callable[[str], None] = lambda text: None,
        parallel: int = 1,
    ):
        from moepass.runtime import LLAMA_SERVER

        self.decoder = decoder
        self.model_id = model_id
        self.defaults = defaults or LLAMA_SERVER
        self.created = int(time.time())
        self.queue_size = queue_size
        self.echo = echo
        self.data_changed: str | None = None  # why the model is served no more (check_data)
        if parallel < 1:
            raise MoepassError(f"{parallel} slots: at least 1")
        if parallel > 1 and not decoder.batchable:
            raise MoepassError(f"--parallel {parallel}: {decoder.batch_refusal}")
        self.parallel = parallel
        # the slots' KV cache, decoded together on one model thread; a session that cannot batch
        # (a GPU EP) generates one request at a time through one KVCache
        self.batch = None
        if decoder.batchable:
            from moepass.runtime.batch import Slots

            self.batch = Slots(decoder, parallel)
        self._cache: KVCache | None = None
        # each request's generation on a thread of its own; its pieces reach the event loop
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="moepass-slot")
        self._turns = asyncio.Semaphore(parallel)
        self._waiting = 0
        self._longest_token: int | None = None
        self.metrics = Metrics()
        self._runs_at_start = decoder.model_runs
        self._task_ids = itertools.count()
        # per slot: the request generating in it now, else its last one (for /slots)
        self.tasks: list[Task | None] = [None] * parallel

    def close(self) -> None:
        """Stop the slots' model thread (the server has stopped)."""
        if self.batch is not None:
            self.batch.close()
        self._workers.shutdown(wait=False)

    def check_model(self, body: dict) -> None:
        """Any model name is taken, as llama-server takes it with one model (the answer names the
        served one); it must be a non-empty string."""
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise RequestError(
                400, f"'model' must be a non-empty string (this server has one model: '{self.model_id}')", "model"
            )

    def max_tokens(self, body: dict, prompt_tokens: int) -> int:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(400, "'max_tokens' must be a positive integer", "max_tokens")
        context = self.decoder.context_length
        if context and prompt_tokens >= context:
            raise RequestError(
                400,
                f"the prompt has {prompt_tokens} tokens; the model's context holds {context}",
                "messages" if "messages" in body else "prompt",
                "context_length_exceeded",
                n_prompt_tokens=prompt_tokens,
                n_ctx=context,
            )
        if value is None:
            return (context - prompt_tokens) if context else 256
        if context and value > context - prompt_tokens:  # llama-server's n_predict past the context
            room = context - prompt_tokens
            self.echo(f"max_tokens {value} is more than the {room} tokens the context has left: {room} at most")
            return room
        return value

    def check_length(self, text: str, field: str) -> None:
        """Refuses a text that could not fit the context whatever it tokenizes to (no token stands
        for more characters than the vocabulary's longest), before a second is spent on it."""
        context = self.decoder.context_length
        if not context:
            return
        if self._longest_token is None:
            self._longest_token = max(len(t) for t in self.decoder.tokenizer.get_vocab())
        if len(text) > context * self._longest_token:
            raise RequestError(
                400,
                f"the prompt has {len(text):,} characters, more than the model's context of {context:,} tokens "
                "can hold",
                field,
                "context_length_exceeded",
                n_ctx=context,
            )

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", "messages")
        messages = [message_text(m, i) for i, m in enumerate(messages)]
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise RequestError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        tools = _tools(body) if tool_choice(body) else None
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(extra)
        if reserved:
            raise RequestError(400, f"chat_template_kwargs may not set {sorted(reserved)[0]}", "chat_template_kwargs")
        try:
            text = self.decoder.chat_template.render(messages, tools=tools, **extra)
        except MoepassError as e:  # the template refused these messages (e.g. raise_exception), or ran too long
            raise RequestError(400, str(e), "messages") from None
        self.check_length(text, "messages")
        return self.decoder.encode_chat(text)

    def answer_reader(self, body: dict) -> AnswerReader | None:
        """What reads a chat answer's tool calls and reasoning for this model's template: gpt-oss's
        channels always; Hermes-style calls when the request gave tools."""
        fmt = answer_format(self.decoder.chat_template.source)
        if fmt == HARMONY or (fmt == HERMES and body.get("tools") and tool_choice(body)):
            return AnswerReader(fmt)
        return None

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            self.check_length(prompt, "prompt")
            return self.decoder.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.decoder.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
            return list(prompt)
        raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt)", "prompt")

    def task_of(self, body: dict, prompt_ids: list[int]) -> "Task":
        """A request's generation settings, checked (a bad field is a RequestError naming it)."""
        n = body.get("n", 1)
        if n is not None and (isinstance(n, bool) or n != 1):  # true == 1 in Python, not in JSON
            raise RequestError(400, "only n = 1 is supported", "n")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError(400, "'stream_options' must be an object", "stream_options")
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise RequestError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        top = logprobs_wanted(body, chat="messages" in body)
        sampling = sampling_of(body, self.defaults)
        stops = stop_strings(body)
        max_new = self.max_tokens(body, len(prompt_ids))
        reuse = body.get("cache_prompt", True)
        if not isinstance(reuse, bool):
            raise RequestError(400, "'cache_prompt' must be true or false", "cache_prompt")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        return Task(next(self._task_ids), sampling, stops, max_new, -1 if asked is None else asked, top, reuse,
                    bool(body.get("stream")))  # fmt: skip

    def busy(self) -> bool:
        """Whether every slot is generating."""
        return self._turns.locked()

    def processing(self) -> int:
        """Requests generating now."""
        return sum(t is not None and t.processing for t in self.tasks)

    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting

    async def take_turn(self) -> None:
        """Waits for a slot (503 at once when the queue is full)."""
        if self._turns.locked() and self._waiting >= self.queue_size:
            raise RequestError(
                503,
                f"the server is busy: {self._waiting} requests are waiting already",
                kind="server_error",
                code="queue_full",
            )
        self._waiting += 1
        try:
            await self._turns.acquire()
        finally:
            self._waiting -= 1

    def check_data(self) -> None:
        """A 503 from now on, said once in the log, where a data file of the model changed in place
        since it was loaded: its answers would be those of neither model (a file cut short faults the
        server), and a restart loads what is there now."""
        if self.data_changed is None and (why := self.decoder.data_changed()) is not None:
            self.data_changed = f"{why}: the model is served no more; restart the server to load it as it is now"
            self.echo(f"model data changed: {self.data_changed}")
        if self.data_changed is not None:
            raise RequestError(503, self.data_changed, kind="server_error", code="model_data_changed")

    async def answer(
        self, prompt_ids: list[int], body: dict, disconnected: Callable, request_line: str = ""
    ) -> AsyncGenerator[tuple, None]:
        """Yields ("piece", text, stream) as the answer comes (the stream as it was when the piece
        came), then ("end", stream). Waits for a slot in the queue (503 when it is full). The
        generation runs on a thread of its own (`_generate`) and stops at its next step when
        `disconnected()` says the client went away; the metrics count it once, at its end."""
        task = self.task_of(body, prompt_ids)
        await self.take_turn()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        finished = started = False
        cache = None
        try:
            self.check_data()  # after the wait: a change while it waited counts
            cache = self._cache_for(task, prompt_ids)
            task.slot = cache.slot.id if self.batch is not None else 0
            self.tasks[task.slot] = task
            stream = self.decoder.generate_text(
                prompt_ids, task.max_new, task.sampling, task.stops, cache=cache, logprobs=task.top
            )
            task.stream = stream

            def put(event: tuple) -> None:
                loop.call_soon_threadsafe(events.put_nowait, event)

            def free() -> None:  # the slot's turn passes on once the slot itself is free
                with contextlib.suppress(RuntimeError):  # the event loop has ended: nobody waits
                    loop.call_soon_threadsafe(self._turns.release)

            self._workers.submit(self._generate, stream, cache, stop, put, free)
            started = True
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except TimeoutError:
                    if await disconnected():
                        break
                    continue
                if event[0] == "error":
                    raise event[1]
                if event[0] == "end":
                    finished = True
                    if request_line:
                        self.echo(_served_line(request_line, len(prompt_ids), stream))
                    yield "end", stream
                    break
                yield event
                if await disconnected():
                    break
        finally:
            stop.set()
            if isinstance(cache, SlotCache):  # a step it asked for is dropped: the slot frees at the next step
                cache.cancel()
            task.processing = False
            if not started:  # nothing runs on a worker: the slot and the turn are freed here
                if isinstance(cache, SlotCache):
                    cache.slots.release(cache)
                self._turns.release()
            if not finished and task.stream is not None:
                self.echo(
                    f"a client went away after {task.stream.completion_tokens} of {task.max_new} tokens; its "
                    "generation stopped"
                )

    def _cache_for(self, task: "Task", prompt_ids: list[int]):
        """The KV cache a request generates in: a free slot of the batch (the one holding the
        longest prefix of its prompt, with cache_prompt), or the one KVCache of a session that
        cannot batch (made anew without cache_prompt)."""
        from moepass.runtime import KVCache

        if self.batch is not None:
            return self.batch.open(prompt_ids, reuse=task.reuse)
        if self._cache is None or not task.reuse:
            self._cache = KVCache(self.decoder, len(prompt_ids) + task.max_new)
        return self._cache

    def _generate(
        self, stream, cache, stop: threading.Event, put: Callable[[tuple], None], free: Callable[[], None]
    ) -> None:
        """(on a worker thread) the answer's pieces, each with a snapshot of the stream, then its
        end; stops at the next step once `stop` is set. However it ends: the metrics record it,
        then its slot is freed and `free()` passes the turn on."""
        pieces = iter(stream)
        try:
            for piece in pieces:
                put(("piece", piece, stream.snapshot()))
                if stop.is_set():
                    return
            self.metrics.record(stream)
            put(("end",))
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - the request's own coroutine raises it
            put(("error", e))
        finally:
            pieces.close()
            if not stream.finish_reason:  # stopped: what it did is counted all the same
                self.metrics.record(stream)
            if isinstance(cache, SlotCache):
                cache.slots.release(cache)
            free()

    def model_runs(self) -> int:
        """The model's steps since the server started (llama-server's n_decode_total)."""
        return self.decoder.model_runs - self._runs_at_start

    def n_ctx(self) -> int:
        return self.decoder.context_length or 0

    def slot_states(self) -> list[dict]:
        """The slots as llama-server's /slots shows them: each one's request generating now (or its last one)."""
        return [self._slot_state(i, task) for i, task in enumerate(self.tasks)]

    def _slot_state(self, index: int, task: "Task | None") -> dict:
        params = llama_params(self.defaults, -1, [], False) if task is None else task.params()
        stream = task.stream if task is not None else None
        decoded = stream.completion_tokens if stream is not None else 0
        processing = task is not None and task.processing
        held = self.batch.slots[index].tokens if self.batch is not None else (self._cache.tokens if self._cache else [])
        return {
            "id": index,
            "id_task": -1 if task is None else task.id,
            "n_ctx": self.n_ctx(),
            "n_tokens": len(held),  # the positions its KV cache holds (a later prompt may reuse them)
            "speculative": getattr(self.decoder, "speculator", None) is not None,
            "is_processing": processing,
            "params": params,
            "next_token": {
                "has_next_token": processing,
                "has_new_line": stream is not None and "\n" in stream.text,
                "n_remain": -1 if task is None or task.n_predict == -1 else task.n_predict - decoded,
                "n_decoded": decoded,
            },
        }

    def kv_cache(self) -> dict:
        """The KV cache's memory (moepass's own /props field): bytes a position of one slot takes,
        what the slots hold now, and what they take when each fills the context."""
        per_position = self.decoder.kv_bytes_per_position()
        allocated = self.batch.allocated_bytes if self.batch is not None else 0
        if self.batch is None and self._cache is not None:
            allocated = self._cache.capacity * per_position
        return {
            "slots": self.parallel,
            "type": self.decoder.cache_dtype.__name__,
            "bytes_per_position": per_position,
            "allocated_bytes": allocated,
            "bytes_at_context": per_position * self.n_ctx() * self.parallel,
        }

    def props(self) -> dict:
        """llama-server's /props, as far as moepass has its fields."""
        try:
            template = self.decoder.chat_template.source
        except MoepassError:  # no chat template: /v1/chat/completions says so
            template = ""
        path = getattr(self.decoder, "model_dir", None)
        return {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": self.n_ctx(),
                "model": self.model_id,
                "speculative": getattr(self.decoder, "speculator", None) is not None,
                "is_processing": False,
                "params": llama_params(self.defaults, -1, [], False),
            },
            "total_slots": self.parallel,
            "kv_cache": self.kv_cache(),
            "model_alias": self.model_id,
            "model_path": "" if path is None else str(path),
            "n_ctx": self.n_ctx(),
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True,
            "endpoint_props": True,
            "endpoint_metrics": True,
            "chat_template": template,
            "build_info": f"moepass {_version()}",
            "is_sleeping": False,
        }


@dataclasses.dataclass
class Task:
    """One request's generation: llama-server's task id, its settings (checked), and once it has
    the model its stream."""

    id: int
    sampling: Sampling
    stops: list[str]
    max_new: int
    n_predict: int  # as asked: -1 for no limit but the context
    top: int | None  # log probabilities wanted
    reuse: bool  # cache_prompt
    streamed: bool
    stream: Any = None
    slot: int = 0
    processing: bool = True

    def params(self) -> dict:
        return llama_params(self.sampling, self.n_predict, self.stops, self.streamed)


class Metrics:
    """llama-server's /metrics: counters since the server started, and the throughput gauges over
    the window since the last read. Recorded when a generation ends (on the event loop, or on the
    model's worker thread for one whose client left) and read by /metrics: under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0  # computed, not taken from the cache (llama-server's count)
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self._window = [0, 0.0, 0, 0.0]  # prompt tokens, seconds; steps after the first token, seconds

    def record(self, stream) -> None:
        """A generation's counts: its prompt's computation (none when it did not end) and its tokens."""
        if not stream.first_token_at:
            return
        prompt = stream.prefilled_tokens
        steps = max(stream.completion_tokens - 1, 0)  # the tokens after the first, a model step each
        with self._lock:
            self.prompt_tokens += prompt
            self.prompt_seconds += stream.prompt_seconds
            self.predicted_tokens += stream.completion_tokens
            self.predicted_seconds += stream.generation_seconds
            for i, value in enumerate((prompt, stream.prompt_seconds, steps, stream.generation_seconds)):
                self._window[i] += value

    def text(self, processing: int, deferred: int, model_runs: int) -> str:
        """The Prometheus text exposition of the metrics (and the requests processing and waiting
        now, the model's steps so far); the throughput window starts again."""
        with self._lock:
            prompt_n, prompt_s, steps, steps_s = self._window
            self._window = [0, 0.0, 0, 0.0]
            counters = [
                ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
                 self.prompt_tokens),
                ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds),
                ("tokens_predicted_total", "Number of generation tokens processed", self.predicted_tokens),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predicted_seconds),
                ("n_decode_total", "Total number of model steps (llama_decode() calls)", model_runs),
            ]  # fmt: skip
        prompt_rate, predicted_rate = prompt_n / prompt_s if prompt_s else 0.0, steps / steps_s if steps_s else 0.0
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", predicted_rate),
            ("requests_processing", "Number of requests processing", processing),
            ("requests_deferred", "Number of requests deferred", deferred),
        ]  # fmt: skip
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, description, value in items:
                lines += [f"# HELP llamacpp:{name} {description}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {value}"]  # fmt: skip
        return "\n".join(lines) + "\n"


def _usage(stream) -> dict:
    return {
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
    }


def _timings(stream) -> dict:
    """llama-server's `timings`: prompt tokens computed (and those the cache held) and the tokens
    generated after the first, each with its milliseconds, per token and per second."""
    runs = max(stream.completion_tokens - 1, 0)
    prompt_ms, predicted_ms = stream.prompt_seconds * 1e3, stream.generation_seconds * 1e3
    return {
        "cache_n": stream.prompt_tokens - stream.prefilled_tokens,
        **rates("prompt", stream.prefilled_tokens, prompt_ms),
        **rates("predicted", runs, predicted_ms),
    }


def rates(kind: str, n: int, ms: float) -> dict:
    """llama-server's `{kind}_n`, `{kind}_ms`, `{kind}_per_token_ms`, `{kind}_per_second`."""
    return {
        f"{kind}_n": n,
        f"{kind}_ms": round(ms, 3),
        f"{kind}_per_token_ms": round(ms / n, 3) if n else 0.0,
        f"{kind}_per_second": round(n * 1e3 / ms, 2) if n and ms else 0.0,
    }


def check_api_key(api_key: str | None) -> None:
    """An empty key (a blank $MOEPASS_API_KEY) is refused: it would serve with no key at all."""
    if api_key is not None and not api_key.strip():
        raise MoepassError(
            "the API key is empty (--api-key or $MOEPASS_API_KEY): it would serve without one; "
            "give a key, or unset it for a server open to whoever reaches it"
        )


def create_app(
    server: ModelServer,
    api_key: str | None = None,
    max_body: int = MAX_BODY,
    body_seconds: float = BODY_SECONDS,
    webui: bool = True,
):
    """The FastAPI application over `server`: refusals in OpenAI's error shape, the API key when
    there is one, the endpoints (OpenAI's and llama-server's), which `Endpoints` answers, and with
    `webui` the chat page at / (its files served without the key: the API behind it asks for it)."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException

    check_api_key(api_key)
    app = FastAPI(title="moepass", version=_version())
    app.exception_handler(HTTPException)(_not_there)
    if api_key:
        app.add_middleware(
            RequireKey, expected=f"Bearer {api_key}".encode(), open_paths=WEBUI_PATHS if webui else frozenset()
        )
    app.add_middleware(OneLine, server=server)  # the outermost: it sees what every other one lets through
    endpoints = Endpoints(server, max_body, body_seconds)

    # no docstrings here: FastAPI would put them in /openapi.json
    @app.get("/health")
    async def health():
        try:
            server.check_data()
        except RequestError as e:  # llama-server's 503 for a model it cannot serve
            return _error_response(e)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return endpoints.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await endpoints.respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await endpoints.respond(request, chat=False)

    # llama-server's own endpoints (/completions: its alias of /completion)
    @app.post("/completion")
    async def completion(request: Request):
        return await endpoints.complete(request)

    @app.post("/completions")
    async def completion_alias(request: Request):
        return await endpoints.complete(request)

    @app.get("/props")
    async def props():
        return server.props()

    @app.get("/slots")
    async def slots(request: Request):
        return endpoints.slots(request)

    @app.get("/metrics")
    async def metrics():
        return endpoints.metrics()

    if webui:

        @app.get("/")
        async def page():
            return _webui_file("index.html")

        @app.get("/webui/{name}")
        async def page_file(name: str):
            return _webui_file(name)

    return app


# the chat page's files (moepass/serve/webui), by the path they are served at; the page itself and
# its script and style come without the API key (the page asks for the key, the API checks it)
WEBUI_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
WEBUI_PATHS = frozenset({"/", *(f"/webui/{name}" for name in WEBUI_FILES)})
# the page loads nothing from anywhere but this server, and runs no inline script, so that markup
# in a model's answer could not run even where the page's own escaping failed
WEBUI_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def _webui_file(name: str) -> Any:
    """One of the chat page's files, from the package (404 for any other name)."""
    from importlib import resources

    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    if name not in WEBUI_FILES:
        raise HTTPException(404, "Not Found")
    data = resources.files("moepass.serve").joinpath("webui").joinpath(name).read_bytes()
    return Response(
        data,
        media_type=WEBUI_FILES[name],
        headers={
            "Content-Security-Policy": WEBUI_POLICY,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        },
    )


def _error_response(e: RequestError) -> "JSONResponse":
    """A refused request's answer: OpenAI's error object, with the refusal's status."""
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


async def _not_there(request: "Request", e: "HTTPException") -> "JSONResponse":
    """404 (no such endpoint), 405 (not with this method) and Starlette's other refusals, in
    OpenAI's error shape."""
    return _error_response(
        RequestError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
    )


class OneLine:
    """Whatever escapes an endpoint (ONNX Runtime, a bug): OpenAI's error object, 500, where no
    byte was sent yet, and one line in the log instead of a traceback."""

    def __init__(self, app, server: ModelServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 - the server goes on serving; the line says what
            what = f"{type(e).__name__}: {first_line(e)}"
            self.server.echo(f"request failed: {scope.get('method', '')} {scope.get('path', '')}: {what}")
            if not started and scope["type"] == "http":
                failure = RequestError(500, what, kind="server_error")
                try:
                    await _error_response(failure)(scope, receive, send)
                except Exception:  # noqa: BLE001, S110 - the client is gone
                    pass


def _served_line(request_line: str, prompt_tokens: int, stream: Any) -> str:
    """The log's line for a request answered, as llama-server logs one: method, path, status, tokens
    and milliseconds."""
    prompt_ms, generation_ms = 1e3 * stream.prompt_seconds, 1e3 * stream.generation_seconds
    cached = prompt_tokens - stream.prefilled_tokens
    return (
        f"{request_line} 200: {prompt_tokens} prompt tokens ({cached} cached) in {prompt_ms:.0f} ms, "
        f"{stream.completion_tokens} generated in {generation_ms:.0f} ms"
    )


class RequireKey:
    """The API key, checked before any endpoint but /health (and `open_paths`: the chat page's
    files): the Authorization header must be
    `expected` ("Bearer KEY"). Plain ASGI: Starlette's BaseHTTPMiddleware would pass every streamed
    answer through a second stream, with its own handling of a client that leaves."""

    def __init__(self, app, expected: bytes, open_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.expected, self.open_paths = app, expected, open_paths | {"/health"}

    async def __call__(self, scope, receive, send) -> None:
        from starlette.datastructures import Headers

        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = Headers(scope=scope).get("authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, self.expected):  # in a time that does not tell how much matched
                refused = RequestError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    kind="authentication_error",
                    code="invalid_api_key",
                )
                await _error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@functools.cache
def _answer_stream() -> type:
    """The response a streamed answer goes out in (made on first use: FastAPI is imported only to
    serve)."""
    import anyio
    from fastapi.responses import StreamingResponse

    class AnswerStream(StreamingResponse):
        """A streamed answer whose events are closed however the stream ends. When the client
        leaves, Starlette cancels the stream wherever it is, mid-send too, and leaves the events to
        the garbage collector: until it ran, the answer's turn, and so every later request, would
        wait (and its generation would not be reported stopped)."""

        async def stream_response(self, send) -> None:
            try:
                await super().stream_response(send)
            finally:
                with anyio.CancelScope(shield=True):
                    await cast(AsyncGenerator, self.body_iterator).aclose()

    return AnswerStream


class Endpoints:
    """What the endpoints answer over `server`: the model list, and completions, whose request body
    is read within `max_body` bytes and `body_seconds`, checked, then answered by a `Reply`."""

    def __init__(self, server: ModelServer, max_body: int, body_seconds: float) -> None:
        self.server, self.max_body, self.body_seconds = server, max_body, body_seconds
        self.too_large = f"this server takes request bodies of at most {max_body:,} bytes (--max-body)"

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": self.server.model_id, "object": "model", "created": self.server.created, "owned_by": "moepass"}
            ],
        }

    async def read_body(self, request: "Request") -> dict:
        """The request's body as a JSON object, refused past the size or time limit, when it is not
        JSON text, names another model, or has a `stream` that is not true or false."""
        import anyio

        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            raise RequestError(413 if declared.isdigit() else 400, f"Content-Length {declared[:32]}: {self.too_large}")
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.body_seconds):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise RequestError(413, self.too_large)
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(
                408, f"the request body did not arrive within {self.body_seconds:g} s (--timeout)"
            ) from None
        body = _json_object(b"".join(chunks))
        self.server.check_model(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "'stream' must be true or false", "stream")
        return body

    def refuse(self, request: "Request", e: RequestError) -> "JSONResponse":
        """A refused request: one line in the log, and OpenAI's error object."""
        self.server.echo(f"request refused: {request.method} {request.url.path}: {e.status} {first_line(e)}")
        return _error_response(e)

    async def start(
        self, request: "Request", body: dict, prompt: list[int]
    ) -> tuple[AsyncGenerator[tuple, None], tuple]:
        """The answer and its first event: the request's own errors (queue full, bad fields) come
        before any byte is sent."""
        answer = self.server.answer(prompt, body, request.is_disconnected, f"{request.method} {request.url.path}")
        return answer, await anext(answer)

    async def respond(self, request: "Request", chat: bool) -> Any:
        """A chat (`chat`) or text completion: the whole answer as one object, or with `"stream": true`
        its server-sent events; a refused request is one line in the log and OpenAI's error object."""
        import anyio

        server = self.server
        try:
            body = await self.read_body(request)
            check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            # rendered and tokenized off the event loop: /health and the others are answered meanwhile
            prompt = await anyio.to_thread.run_sync(server.chat_prompt if chat else server.completion_prompt, body)
            reader = server.answer_reader(body) if chat else None
            answer, first = await self.start(request, body, prompt)
        except RequestError as e:  # one line in the log for each request refused
            return self.refuse(request, e)
        reply = Reply(server, body, chat, reader, answer, first)
        if not body.get("stream"):
            return await reply.whole()
        return _event_stream(reply.events())

    async def complete(self, request: "Request") -> Any:
        """llama-server's /completion: its fields in (`llama_body`), its shapes out (`LlamaReply`),
        the same generation as /v1/completions."""
        import anyio

        try:
            given = await self.read_body(request)
            check_fields(given, LLAMA_COMPLETION_FIELDS)
            body = llama_body(given)
            prompt = await anyio.to_thread.run_sync(self.server.completion_prompt, body)
            answer, first = await self.start(request, body, prompt)
        except RequestError as e:
            return self.refuse(request, e)
        reply = LlamaReply(self.server, body, prompt, answer, first)
        if not body.get("stream"):
            return await reply.whole()
        return _event_stream(reply.events())

    def slots(self, request: "Request") -> Any:
        """llama-server's /slots; with `?fail_on_no_slot=1`, 503 while the slot is busy."""
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and self.server.busy():
            return self.refuse(request, RequestError(503, "no slot available", kind="unavailable_error"))
        return self.server.slot_states()

    def metrics(self) -> Any:
        """llama-server's /metrics in Prometheus' text format."""
        from fastapi.responses import PlainTextResponse

        server = self.server
        text = server.metrics.text(server.processing(), server.waiting(), server.model_runs())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _event_stream(events: AsyncGenerator[str, None]) -> Any:
    """Server-sent events, as they come."""
    return _answer_stream()(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _json_object(data: bytes) -> dict:
    """A request body's bytes as a JSON object: JSON text, not nested too deep, without lone surrogates."""
    try:
        body = json.loads(data)
        json.dumps(body, ensure_ascii=False).encode()  # lone surrogates ("\ud800") are not text
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not JSON ({e})") from None
    except UnicodeEncodeError:
        raise RequestError(400, "the request body holds a lone surrogate (\\ud800-\\udfff): not valid text") from None
    except RecursionError:
        raise RequestError(400, "the request body's JSON is nested too deep") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


class Reply:
    """One request's answer in OpenAI's shapes, from `first` (the answer's first event) and the rest
    of `answer` (`ModelServer.answer`): `whole` gives it as one object, `events` as server-sent
    events. Its id, kind and time are set when it is made; the text's parts (content, reasoning,
    tool calls: AnswerParts) and the tokens' log probabilities (TokenLogprobs) are read as it comes."""

    def __init__(
        self,
        server: ModelServer,
        body: dict,
        chat: bool,
        reader: AnswerReader | None,
        answer: AsyncGenerator[tuple, None],
        first: tuple,
    ) -> None:
        self.server, self.body, self.chat, self.answer, self.first = server, body, chat, answer, first
        self.ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        single_call = body.get("parallel_tool_calls") is False
        self.parts = AnswerParts(reader, chat, single_call)
        self.tokens = TokenLogprobs(server.decoder, chat)

    async def whole(self) -> Any:
        """The answer as one object (status 499, empty, when the client left before its end)."""
        event = self.first
        try:
            async for event in _with_first(self.first, self.answer):
                if event[0] == "piece":
                    self.parts.feed(event[1])
        finally:
            await self.answer.aclose()  # its turn ends now, whatever ended the request
        if event[0] != "end":  # the client left
            from fastapi.responses import JSONResponse

            return JSONResponse({}, status_code=499)
        stream = event[1]
        self.parts.finish()
        logprobs = self.tokens.take(stream)
        if self.chat:
            choice = {"index": 0, "message": self.parts.message(), "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": self.parts.text(), "logprobs": logprobs}
        choice["finish_reason"] = self.parts.finish_reason(stream)
        return {
            "id": self.ident,
            "object": self.kind,
            "created": self.created,
            "model": self.server.model_id,
            "choices": [choice],
            "usage": _usage(stream),
            "timings": _timings(stream),
        }

    def sse(self, choices: list, **extra) -> str:
        """One server-sent event: a chunk of the answer holding `choices` (and `extra` fields)."""
        data = {
            "id": self.ident,
            "object": f"{self.kind}.chunk" if self.chat else self.kind,
            "created": self.created,
            "model": self.server.model_id,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunks(self, deltas: list[dict], stream) -> Iterator[str]:
        """One chunk per delta, the log probabilities of the tokens so far on the first (tokens
        whose text is still held back wait for the chunk that shows it)."""
        if not deltas:
            return
        logprobs = self.tokens.take(stream)
        for i, delta in enumerate(deltas):
            choice = {"index": 0, "delta": delta} if self.chat else {"index": 0, **delta}
            yield self.sse([{**choice, "logprobs": logprobs if i == 0 else None, "finish_reason": None}])

    async def events(self) -> AsyncGenerator[str, None]:
        """The answer as server-sent events: (chat) the assistant's role first, a chunk per delta,
        the last chunk with the finish reason and timings, the usage when `stream_options` asks for
        it, then `[DONE]`."""
        options = self.body.get("stream_options")
        include_usage = bool((options or {}).get("include_usage")) if isinstance(options, dict) else False
        if self.chat:
            yield self.sse([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}])  # fmt: skip
        try:
            async for event in _with_first(self.first, self.answer):
                if event[0] == "piece":
                    for chunk in self.chunks(self.parts.feed(event[1]), event[2]):
                        yield chunk
                else:
                    for chunk in self.finale(event[1], include_usage):
                        yield chunk
        finally:  # also when the client went away mid-stream: generation stops, the next request's turn comes
            await self.answer.aclose()
        yield "data: [DONE]\n\n"

    def finale(self, stream, include_usage: bool) -> Iterator[str]:
        """The events at the answer's end: the chunks of the text held back till then, the finish
        reason with llama-server's timings, and the usage when asked for."""
        yield from self.chunks(self.parts.finish(), stream)
        final: dict[str, Any] = {"index": 0, **({"delta": {}} if self.chat else {"text": ""})}
        final.update(logprobs=self.tokens.take(stream), finish_reason=self.parts.finish_reason(stream))
        yield self.sse([final], timings=_timings(stream))
        if include_usage:
            yield self.sse([], usage=_usage(stream))


class LlamaReply:
    """One /completion answer in llama-server's shapes, from `first` and the rest of `answer` (as
    `Reply`): `whole` gives one object (content, tokens_predicted, tokens_evaluated, stop_type with
    the stopped_eos / stopped_limit / stopped_word flags, stopping_word, timings,
    generation_settings, ...), `events` its server-sent events: one per piece of text (content, its
    token ids, stop false), then that object with stop true, empty content and tokens (they came
    already) and the timings; no `[DONE]` (llama-server ends /completion's stream without one)."""

    def __init__(
        self, server: ModelServer, body: dict, prompt: list[int], answer: AsyncGenerator[tuple, None], first: tuple
    ) -> None:
        self.server, self.body, self.prompt, self.answer, self.first = server, body, prompt, answer, first
        self.stops = stop_strings(body)
        self.given = 0  # of the stream's token ids, those sent

    def new_tokens(self, stream) -> list[int]:
        """The ids of the tokens generated since the last call (stop tokens left out)."""
        ids = stream.token_ids[self.given :]
        self.given += len(ids)
        return [t for t in ids if t not in self.server.decoder.stop_ids]

    def final(self, stream, streamed: bool) -> dict:
        server, decoder = self.server, self.server.decoder
        kind, word = stop_type(decoder, stream, self.stops)
        context = server.n_ctx()
        sampling = sampling_of(self.body, server.defaults)
        settings = llama_params(sampling, self.body.get("max_tokens", -1), self.stops, streamed)
        tokens = self.new_tokens(stream) if self.body.get("return_tokens") and not streamed else []
        return {
            "index": 0,
            "content": "" if streamed else stream.text,
            "tokens": tokens,
            "id_slot": 0,
            "stop": True,
            "model": server.model_id,
            "tokens_predicted": stream.completion_tokens,
            "tokens_evaluated": stream.prompt_tokens,
            "generation_settings": {"n_ctx": context, "model": server.model_id, **settings},
            "prompt": decoder.decode(self.prompt),
            "has_new_line": "\n" in stream.text,
            "truncated": kind == "limit" and 0 < context <= stream.prompt_tokens + stream.completion_tokens,
            "stop_type": kind,
            "stopped_eos": kind == "eos",
            "stopped_limit": kind == "limit",
            "stopped_word": kind == "word",
            "stopping_word": word,
            "tokens_cached": stream.prompt_tokens - stream.prefilled_tokens,
            "timings": _timings(stream),
        }

    async def whole(self) -> Any:
        """The answer as one object (status 499, empty, when the client left before its end)."""
        last = self.first
        try:
            async for event in _with_first(self.first, self.answer):
                last = event
        finally:
            await self.answer.aclose()  # its turn ends now, whatever ended the request
        if last[0] != "end":  # the client left
            from fastapi.responses import JSONResponse

            return JSONResponse({}, status_code=499)
        return self.final(last[1], streamed=False)

    def partial(self, content: str, stream) -> str:
        """One piece of the answer as llama-server streams it: its text and the ids of the tokens
        since the last event (which may be tokens alone: a character split over tokens, never ended)."""
        data = {"index": 0, "content": content, "tokens": self.new_tokens(stream), "stop": False, "id_slot": 0,
                "tokens_predicted": stream.completion_tokens, "tokens_evaluated": stream.prompt_tokens}  # fmt: skip
        return _sse(data) if content or data["tokens"] else ""

    async def events(self) -> AsyncGenerator[str, None]:
        try:
            async for event in _with_first(self.first, self.answer):
                if event[0] == "piece":
                    yield self.partial(event[1], event[2])
                else:
                    yield self.partial("", event[1]) + _sse(self.final(event[1], streamed=True))
        finally:  # also when the client went away mid-stream: generation stops, the next request's turn comes
            await self.answer.aclose()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def stop_type(decoder, stream, stops: list[str]) -> tuple[str, str]:
    """Why a generation ended, as llama-server says it: "eos" (a stop token), "word" (a stop string,
    and which: the one the text held back from the answer begins with) or "limit"."""
    if stream.finish_reason != "stop":
        return "limit", ""
    if stream.token_ids and stream.token_ids[-1] in decoder.stop_ids:
        return "eos", ""
    text = decoder.decode([t for t in stream.token_ids if t not in decoder.stop_ids])
    rest = text[len(stream.text) :]
    return "word", next((s for s in stops if s and rest.startswith(s)), "")


class AnswerParts:
    """An answer as it streams: the deltas each new piece of text makes (content, reasoning_content,
    tool_calls: `reader` reads them out of the text; without one, all is content), and at the end
    the message, the text and the finish reason. `single_call`: parallel_tool_calls false, so
    calls after the first are dropped."""

    def __init__(self, reader: AnswerReader | None, chat: bool = True, single_call: bool = False):
        self.reader, self.single_call = reader, single_call
        self.text_key = "content" if chat else "text"  # completions' deltas are text
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list = []

    def feed(self, piece: str) -> list[dict]:
        return self._deltas(self.reader.feed(piece) if self.reader else [("content", piece)])

    def finish(self) -> list[dict]:
        return self._deltas(self.reader.finish()) if self.reader else []

    def _deltas(self, events: list) -> list[dict]:
        deltas = []
        for what, value in events:
            if what == "tool_call":
                if self.single_call and self.calls:
                    continue
                deltas.append({"tool_calls": [value.openai(index=len(self.calls))]})
                self.calls.append(value)
            elif what == "reasoning":
                self.reasoning.append(value)
                deltas.append({"reasoning_content": value})
            else:
                self.content.append(value)
                deltas.append({self.text_key: value})
        return deltas

    def text(self) -> str:
        return "".join(self.content)

    def message(self) -> dict:
        content = self.text()
        message: dict[str, Any] = {"role": "assistant", "content": (content.strip() or None) if self.calls else content}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [c.openai() for c in self.calls]
        return message

    def finish_reason(self, stream) -> str:
        return "tool_calls" if self.calls and stream.finish_reason == "stop" else stream.finish_reason


class TokenLogprobs:
    """The log probabilities of an answer's tokens in OpenAI's shapes (chat: `content` entries with
    `top_logprobs`; completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), each
    token once: `take` gives those not given yet (None when the request asked for none)."""

    def __init__(self, decoder, chat: bool):
        self.decoder, self.chat = decoder, chat
        self.given = 0
        self.offset = 0

    def _token(self, token: int, logprob: float) -> dict:
        return {"id": token, "token": self.decoder.decode([token]), "logprob": logprob,
                "bytes": list(self.decoder.token_bytes(token))}  # fmt: skip

    def take(self, stream) -> dict | None:
        if stream.top_logprobs is None:
            return None
        new = stream.logprobs[self.given :]
        self.given += len(new)
        if self.chat:
            return {"content": [{**self._token(t, lp), "top_logprobs": [self._token(i, p) for i, p in top]}
                                for t, lp, top in new]}  # fmt: skip
        texts = [self.decoder.decode([t]) for t, _, _ in new]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _ in new],
            "top_logprobs": [{self.decoder.decode([i]): p for i, p in top} for _, _, top in new],
            "text_offset": offsets,
        }


async def _with_first(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def _version() -> str:
    from moepass.core.version import __version__

    return __version__


def slots_line(model: ModelServer) -> str:
    """The start-up line on the slots and their KV cache's memory."""
    from moepass.core.choices import format_bytes

    kv = model.kv_cache()
    batched = "decoded together in one batch" if model.batch is not None else "one request at a time"
    at_context = (
        f", {format_bytes(kv['bytes_at_context'])} when every slot fills the context of {model.n_ctx():,}"
        if model.n_ctx()
        else ""
    )
    return (
        f"{model.parallel} slot{'s' if model.parallel > 1 else ''} ({batched}); KV cache {kv['type']}, "
        f"{format_bytes(kv['bytes_per_position'])} a position{at_context}"
    )


def listen(host: str, port: int):
    """A socket bound to host:port, before the model loads: a busy port fails at once, in one line."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise MoepassError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server takes on: `parallel` requests generating at once (slots), `queue_size`
    waiting, request bodies of `max_body` bytes arriving within `body_seconds`."""

    parallel: int = 1
    queue_size: int = 8
    max_body: int = MAX_BODY
    body_seconds: float = BODY_SECONDS
    webui: bool = True  # the chat page at /


def serve(
    decoder, model_id: str, listener, api_key: str | None, echo: Callable[[str], None], limits: Limits = Limits()
) -> None:
    """Serve on `listener` (from `listen`) until interrupted (uvicorn: Ctrl-C or SIGTERM stop it
    after the running request)."""
    try:
        import uvicorn
    except ImportError:
        raise MoepassError("moepass serve needs FastAPI and uvicorn: pip install 'moepass[serve]'") from None
    host, port = listener.getsockname()[:2]
    if not api_key and not ipaddress.ip_address(host).is_loopback:
        echo(
            f"warning: serving on {host}, beyond this machine, without an API key: anyone who reaches "
            "the port can use the model (--api-key KEY or $MOEPASS_API_KEY)"
        )

    async def main() -> None:
        model = ModelServer(decoder, model_id, limits.queue_size, echo=echo, parallel=limits.parallel)
        app = create_app(model, api_key, limits.max_body, limits.body_seconds, limits.webui)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        echo(slots_line(model))
        base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        echo(f"serving '{model_id}' on {base}/v1 (OpenAI-compatible; Ctrl-C stops)")
        if limits.webui:
            echo(f"chat in a browser: {base}/")
        try:
            await server.serve(sockets=[listener])
        finally:
            model.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # uvicorn stopped gracefully, then raised the signal again
        pass
    echo("server stopped")
