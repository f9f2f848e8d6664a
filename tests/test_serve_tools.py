"""The server's tools, tool calls, reasoning and log probabilities, through the official openai client.

Tools reach the model through its own chat template (llama.cpp's published Qwen3 and gpt-oss
templates, in fixture vocabularies with those families' control tokens). A random-weight model
never calls a tool, so for the tool-call tests the model's answer is scripted: its generation
yields the tokens of an answer such a model gives (tokenized by the fixture's own tokenizer);
everything else (template, tokenizer, the answer's reading, OpenAI's shapes, streaming) is the
server's. Log probabilities come from the real model and are checked against the decoder's own
logits; unsupported fields get a 400 naming them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from make_fixtures import TEST_DIMS, write_moe_gguf
from support.chat_templates import NO_TEMPLATES, TEMPLATES_DIR
from support.vocabularies import FAMILIES

import moepass
from moepass.serve.answers import HARMONY, HERMES, AnswerReader

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
pytest.importorskip("fastapi", reason="moepass serve needs the serve extra")

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Running:
    """A moepass server over `decoder` on a free local port, in a thread of this process."""

    def __init__(self, decoder, model_id: str = "fixture"):
        import uvicorn

        from moepass.serve.server import ModelServer, create_app, listen

        listener = listen("127.0.0.1", 0)
        self.port = listener.getsockname()[1]
        self.prompts: list[str] = []
        app = create_app(ModelServer(decoder, model_id, defaults=moepass.Sampling()))
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[listener])), daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            self.thread.join(0.05)

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=60)

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)


def _family_model(tmp_path: Path, family: str, template: str) -> Path:
    specials, eos, _ = FAMILIES[family]
    source = (TEMPLATES_DIR / template).read_text(encoding="utf-8")
    dims = dataclasses.replace(TEST_DIMS, context_length=4096)  # room for a template's tool listing
    gguf = write_moe_gguf(tmp_path / f"{family}.gguf", dims=dims, special_tokens=specials, eos_token=eos,
                          chat_template=source)  # fmt: skip
    return moepass.convert(gguf, tmp_path / family).output_dir


def _scripted(decoder, answer: str, end: str, prompts: list[str]):
    """The decoder, answering `answer` then the token `end` whatever it is asked; what it was
    asked goes to `prompts` (as text)."""
    ids = decoder.encode(answer) + [decoder.encode(end)[0]]

    def generate_steps(prompt_ids, max_new_tokens, stop_ids=None, sampling=None, cache=None):
        prompts.append(decoder.decode(prompt_ids))
        for token in ids[:max_new_tokens]:
            logits = np.zeros(decoder.vocab_size, dtype=np.float32)
            logits[token] = 10.0
            yield token, logits
            if token in decoder.stop_ids:
                return

    decoder.generate_steps = generate_steps
    return decoder


QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GPT_OSS_CALL = ("<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city":"Paris"}')  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    if TEMPLATES_DIR is None:
        pytest.skip(NO_TEMPLATES)
    return _family_model(tmp_path_factory.mktemp("qwen3"), "qwen3", "Qwen-Qwen3-0.6B.jinja")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    if TEMPLATES_DIR is None:
        pytest.skip(NO_TEMPLATES)
    return _family_model(tmp_path_factory.mktemp("gpt-oss"), "gpt-oss", "openai-gpt-oss-120b.jinja")


def _serve_script(model: Path, answer: str, end: str):
    prompts: list[str] = []
    server = Running(_scripted(moepass.load(model), answer, end, prompts))
    return server, prompts


def test_qwen3_tool_calls_reach_the_client(qwen3):
    server, prompts = _serve_script(qwen3, "I will look it up.\n" + QWEN3_CALL, "<|im_end|>")
    try:
        client = server.client()
        reply = client.chat.completions.create(model="fixture", messages=ASK, tools=WEATHER)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert choice.message.content == "I will look it up."
        # the template got the tools: Qwen3 lists them in <tools> in the system turn
        assert "<tools>" in prompts[-1] and '"name": "get_weather"' in prompts[-1]

        # streamed: the text as deltas, the call as one tool_calls delta, then finish_reason
        chunks = list(client.chat.completions.create(model="fixture", messages=ASK, tools=WEATHER, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert text.strip() == "I will look it up." and len(calls) == 1
        assert calls[0].index == 0 and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the call and its result sent back: the template renders them (arguments as JSON text, as OpenAI sends)
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees."}]  # fmt: skip
        client.chat.completions.create(model="fixture", messages=history, tools=WEATHER, max_tokens=8)
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompts[-1]
        assert "<tool_response>\nSunny, 18 degrees.\n</tool_response>" in prompts[-1]

        # tool_choice "none": no tools in the prompt, and the answer's text is the model's own
        plain = client.chat.completions.create(model="fixture", messages=ASK, tools=WEATHER, tool_choice="none")
        assert "<tools>" not in prompts[-1] and plain.choices[0].message.tool_calls is None
        assert QWEN3_CALL in plain.choices[0].message.content and plain.choices[0].finish_reason == "stop"
    finally:
        server.close()


def test_gpt_oss_channels_give_reasoning_and_tool_calls(gpt_oss):
    server, prompts = _serve_script(gpt_oss, GPT_OSS_CALL, "<|call|>")
    try:
        client = server.client()
        reply = client.chat.completions.create(model="fixture", messages=ASK, tools=WEATHER)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == "The user wants the weather; call the tool."
        assert "get_weather" in prompts[-1]  # gpt-oss's template lists the tools in its developer message
        chunks = list(client.chat.completions.create(model="fixture", messages=ASK, tools=WEATHER, stream=True))
        reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
        assert reasoning == "The user wants the weather; call the tool."
        assert [t.function.name for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])] == [
            "get_weather"
        ]
    finally:
        server.close()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_answers_read_the_same_in_any_pieces(step):
    """The reading does not depend on where the stream cut the text."""

    def read(fmt, text):
        reader, events = AnswerReader(fmt), []
        for i in range(0, len(text), step):
            events += reader.feed(text[i : i + step])
        events += reader.finish()
        joined: dict = {}
        for what, value in events:
            joined.setdefault(what, []).append(value if what != "tool_call" else (value.name, value.arguments))
        return {k: v if k == "tool_call" else "".join(v) for k, v in joined.items()}

    two = QWEN3_CALL + "\n" + QWEN3_CALL.replace("Paris", "Rome")
    assert read(HERMES, "Checking <both>.\n" + two) == {
        "content": "Checking <both>.\n",
        "tool_call": [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')],
    }
    assert read(HERMES, "<tool_call>\nnot json\n</tool_call>") == {"content": "<tool_call>\nnot json\n</tool_call>"}
    assert read(HARMONY, GPT_OSS_CALL) == {
        "reasoning": "The user wants the weather; call the tool.",
        "tool_call": [("get_weather", '{"city":"Paris"}')],
    }
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is <|sunny|>."
    assert read(HARMONY, final) == {"reasoning": "Easy.", "content": "It is <|sunny|>."}


@pytest.fixture(scope="module")
def real(converted):
    server = Running(moepass.load(Path(converted("q4_0")), threads=1))
    yield server
    server.close()


def test_chat_logprobs_are_the_models(real, converted):
    client = real.client()
    settings = dict(model="fixture", messages=ASK, max_tokens=6, temperature=0, extra_body={"cache_prompt": False})
    reply = client.chat.completions.create(logprobs=True, top_logprobs=3, **settings)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    decoder = moepass.load(Path(converted("q4_0")), threads=1)
    prompt = decoder.encode(decoder.chat_template.render(ASK))
    logits = decoder.forward(np.array([prompt]), decoder.empty_cache())[0][0, -1].astype(np.float64)
    expected = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = entries[0]
    assert first.model_extra["id"] == int(np.argmax(expected))  # greedy: the likeliest token
    # the server's cache steps and a whole-prompt forward differ by ONNX Runtime's own roundings only
    assert abs(first.logprob - expected[first.model_extra["id"]]) < 1e-3
    assert [t.model_extra["id"] for t in first.top_logprobs] == list(np.argsort(-expected, kind="stable")[:3])
    for entry in entries:
        assert entry.token == decoder.decode([entry.model_extra["id"]])
        assert bytes(entry.bytes) == decoder.token_bytes(entry.model_extra["id"])
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob
    streamed = [e for c in client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **settings)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries]
    assert client.chat.completions.create(**settings).choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(real):
    reply = real.client().completions.create(model="fixture", prompt="the other one", max_tokens=5, temperature=0,
                                             logprobs=2)  # fmt: skip
    logprobs = reply.choices[0].logprobs
    n = len(logprobs.tokens)
    assert n == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert all(len(top) <= 2 and max(top.values()) >= lp for top, lp in zip(logprobs.top_logprobs,
                                                                            logprobs.token_logprobs))  # fmt: skip
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format", "grammar-constrained"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "not applied"),
        ({"frobnicate": 1}, "frobnicate", "does not take it"),
        ({"tools": WEATHER, "tool_choice": "required"}, "tool_choice", "cannot force a tool call"),
        ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "from 0 to 20"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ],
)
def test_unsupported_fields_are_400_naming_them(real, fields, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        real.client().chat.completions.create(model="fixture", messages=ASK, max_tokens=2, extra_body=fields)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert says in refused.value.body["message"]
    assert real.client().chat.completions.create(model="fixture", messages=ASK, max_tokens=2).choices  # still serving
