"""`moepass serve` answers llama-server's own endpoints as llama-server's README describes them:
`POST /completion` (its request fields, its answer's, its server-sent events), `GET /props`,
`GET /slots`, `GET /metrics` (Prometheus text, read here by prometheus_client's own parser), and
any model name where the server holds one model. A server started as a user starts it (a
subprocess on a free local port) over the demo fixture converted."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest

from make_fixtures import CHAT_TEMPLATE
from support.serving import ServeProcess

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
pytest.importorskip("fastapi", reason="moepass serve needs the serve extra")
httpx = pytest.importorskip("httpx")

PROMPT = "the other one"
GREEDY = {"temperature": 0, "cache_prompt": False}  # a fresh KV cache: the same computation each time
N_CTX = 512  # the demo fixture's context
METRICS = ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total", "tokens_predicted_seconds_total",
           "n_decode_total", "requests_processing", "requests_deferred", "prompt_tokens_seconds",
           "predicted_tokens_seconds")
TIMINGS = ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
           "predicted_per_token_ms", "predicted_per_second")


class Server(ServeProcess):
    """The server, and llama-server's endpoints on it."""

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", json=body, timeout=120)

    def completion(self, **body) -> dict:
        response = self.post("/completion", {"prompt": PROMPT, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def get(self, path: str):
        response = httpx.get(f"{self.base}{path}", timeout=60)
        assert response.status_code == 200, response.text
        return response


@pytest.fixture(scope="module")
def model(converted) -> Path:
    return Path(converted("q4_0"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    running = Server(model, tmp_path_factory.mktemp("serve") / "server.log")
    yield running
    assert running.stop() == 0, running.log.read_text()
    assert "Traceback" not in running.log.read_text()


@pytest.fixture(scope="module")
def decoder(model):
    from moepass.runtime import load

    return load(model, threads=1)


def _events(response: httpx.Response) -> list[dict]:
    """A /completion stream's events: each `data: {...}` line, and nothing else but blank lines."""
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: {"), line  # no "[DONE]": llama-server's /completion sends none
            events.append(json.loads(line[len("data: "):]))
    return events


def test_completion_greedy_is_v1_completions_greedy(server, model, decoder):
    """The same tokens as /v1/completions for the same prompt, as text and as ids, in llama-server's fields."""
    answer = server.completion(n_predict=12, return_tokens=True, **GREEDY)
    openai_answer = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0,
                                                    **GREEDY}).json()
    choice = openai_answer["choices"][0]
    assert answer["content"] == choice["text"]
    assert [decoder.decode([t]) for t in answer["tokens"]] == choice["logprobs"]["tokens"]
    assert answer["tokens_predicted"] == openai_answer["usage"]["completion_tokens"]
    assert answer["tokens_evaluated"] == openai_answer["usage"]["prompt_tokens"] == len(decoder.encode(PROMPT))
    assert answer["stop"] is True and answer["model"] == model.name and answer["id_slot"] == 0
    stopped = {k: answer[f"stopped_{k}"] for k in ("eos", "limit", "word")}
    assert sum(stopped.values()) == 1 and stopped[answer["stop_type"]]
    assert stopped["limit"] == (choice["finish_reason"] == "length") and answer["stopping_word"] == ""
    assert set(TIMINGS) <= set(answer["timings"]) and answer["timings"]["prompt_n"] == answer["tokens_evaluated"]
    settings = answer["generation_settings"]
    assert settings["n_ctx"] == N_CTX and settings["model"] == model.name and settings["n_predict"] == 12
    assert settings["temperature"] == 0 and settings["stream"] is False
    # the prompt as token ids, and n_predict's alias max_tokens: the same answer; without return_tokens, no ids
    by_ids = server.completion(prompt=decoder.encode(PROMPT), max_tokens=12, **GREEDY)
    assert by_ids["content"] == answer["content"] and by_ids["tokens"] == []


def test_a_stop_string_is_stopped_word(server):
    whole = server.completion(n_predict=12, **GREEDY)["content"]
    stop = whole[4:6]
    cut = server.completion(n_predict=12, stop=[stop, "\x00never"], **GREEDY)
    assert cut["content"] == whole[:whole.index(stop)]
    assert cut["stop_type"] == "word" and cut["stopped_word"] and cut["stopping_word"] == stop
    assert not cut["stopped_eos"] and not cut["stopped_limit"]


def test_a_streamed_completion_ends_with_stop_and_timings(server, model):
    whole = server.completion(n_predict=16, return_tokens=True, **GREEDY)
    with httpx.stream("POST", f"{server.base}/completion", timeout=120,
                      json={"prompt": PROMPT, "n_predict": 16, "stream": True, **GREEDY}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    *pieces, last = events
    assert pieces and all(e["stop"] is False and "timings" not in e for e in pieces)
    assert "".join(e["content"] for e in pieces) == whole["content"]
    assert [t for e in pieces for t in e["tokens"]] == whole["tokens"]
    assert [e["tokens_predicted"] for e in pieces] == sorted(e["tokens_predicted"] for e in pieces)
    assert all(e["tokens_evaluated"] == whole["tokens_evaluated"] for e in events)
    # the last event: llama-server's final object, its content and tokens sent already
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert set(TIMINGS) <= set(last["timings"]) and last["timings"]["prompt_n"] == whole["tokens_evaluated"]
    assert last["tokens_predicted"] == whole["tokens_predicted"] and last["stop_type"] == whole["stop_type"]
    assert last["model"] == model.name and last["generation_settings"]["stream"] is True


def test_n_predict_minus_one_runs_to_the_end_of_generation_or_the_context(server):
    answer = server.completion(n_predict=-1, stop=["\x00never"], **GREEDY)
    used = answer["tokens_evaluated"] + answer["tokens_predicted"]
    assert answer["stop"] is True and answer["generation_settings"]["n_predict"] == -1
    if answer["stopped_eos"]:  # the model's end of generation, before the context filled
        assert used <= N_CTX and not answer["truncated"]
    else:  # the context full: llama-server's limit, truncated
        assert answer["stopped_limit"] and used == N_CTX and answer["truncated"], answer
    # n_predict left out is -1 too
    assert server.completion(stop=["\x00never"], **GREEDY)["content"] == answer["content"]


@pytest.mark.parametrize("field,value", [
    ("n_predict", 0), ("n_predict", -2), ("n_predict", "8"), ("n_predict", True), ("n_predict", 1.5),
    ("max_tokens", -3), ("temperature", "hot"), ("temperature", 3), ("top_k", -1), ("top_k", 1.5), ("top_p", 0),
    ("top_p", 1.5), ("min_p", 2), ("min_p", [0.1]), ("seed", "x"), ("seed", 1.5), ("seed", -2),
    ("stop", [1]), ("stop", {"a": 1}), ("stream", "yes"), ("cache_prompt", "no"), ("return_tokens", 1),
    ("prompt", 5), ("prompt", []), ("prompt", [-1]), ("prompt", [1, "x"]), ("model", 7), ("model", ""),
    ("repeat_penalty", 0), ("mirostat", 2), ("n_probs", 3), ("grammar", "root ::= 'a'"),
])
def test_a_bad_field_is_a_400_naming_it(server, model, field, value):
    response = server.post("/completion", {"prompt": PROMPT, "n_predict": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == field and (field == "prompt" or f"'{field}'" in error["message"]), error
    if field in ("mirostat", "n_probs", "grammar"):  # a field /completion does not take: never ignored
        assert error["code"] == "unsupported_parameter"
    assert server.completion(n_predict=2)["stop"] is True  # and the server goes on


def test_props_are_llama_servers(server, model):
    from moepass.core.version import __version__

    props = server.get("/props").json()
    assert props["total_slots"] == 1 and props["n_ctx"] == N_CTX and props["model_alias"] == model.name
    assert Path(props["model_path"]).resolve() == model.resolve()
    assert props["chat_template"] == CHAT_TEMPLATE and props["build_info"] == f"moepass {__version__}"
    defaults = props["default_generation_settings"]
    assert defaults["n_ctx"] == N_CTX and defaults["model"] == model.name and defaults["is_processing"] is False
    params = defaults["params"]  # llama-server's defaults, which the server samples with
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert params["n_predict"] == -1 and params["seed"] == 0xFFFFFFFF and params["stop"] == []


def test_slots_show_the_request_generating_and_the_last_one(server):
    done = server.completion(n_predict=5, **GREEDY)
    [idle] = server.get("/slots").json()
    assert idle["id"] == 0 and idle["n_ctx"] == N_CTX and idle["is_processing"] is False
    assert idle["next_token"]["n_decoded"] == done["tokens_predicted"] and idle["params"]["n_predict"] == 5
    assert server.get("/slots?fail_on_no_slot=1").status_code == 200
    body = {"prompt": PROMPT, "n_predict": 480, "stream": True, "stop": ["\x00never"], **GREEDY}
    with httpx.stream("POST", f"{server.base}/completion", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        [busy] = server.get("/slots").json()
        refused = httpx.get(f"{server.base}/slots?fail_on_no_slot=1", timeout=60)
    assert busy["is_processing"] is True and busy["id_task"] > idle["id_task"]
    assert busy["next_token"]["n_decoded"] >= 1 and busy["params"]["n_predict"] == 480
    assert busy["params"]["stream"] is True and busy["params"]["stop"] == ["\x00never"]
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "no slot available"
    deadline = time.monotonic() + 30  # the client left: its generation stops
    while server.get("/slots").json()[0]["is_processing"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = server.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    values = {}
    for name in METRICS:  # each with its # HELP and # TYPE lines
        kind = "counter" if name.endswith("_total") else "gauge"
        family = families[f"llamacpp:{name.removesuffix('_total')}" if kind == "counter" else f"llamacpp:{name}"]
        assert family.type == kind and family.documentation, family
        [sample] = family.samples
        assert sample.name == f"llamacpp:{name}"
        values[name] = sample.value
    return values


def test_metrics_count_exactly_the_tokens_of_a_request(server):
    server.completion(n_predict=2, **GREEDY)  # after it, whatever an earlier request left to the worker is done
    before = _metrics(server)
    answer = server.completion(n_predict=9, stop=["\x00never"], **GREEDY)
    after = _metrics(server)
    grown = {k: after[k] - before[k] for k in METRICS if k.endswith("_total")}
    timings = answer["timings"]
    assert grown["prompt_tokens_total"] == timings["prompt_n"] == answer["tokens_evaluated"]
    assert grown["tokens_predicted_total"] == answer["tokens_predicted"] == 9
    # model steps: the prompt in one (under 512 tokens), then one per token after the first
    assert grown["n_decode_total"] == math.ceil(timings["prompt_n"] / 512) + answer["tokens_predicted"] - 1
    assert grown["prompt_seconds_total"] == pytest.approx(timings["prompt_ms"] / 1e3, abs=1e-5)
    assert grown["tokens_predicted_seconds_total"] == pytest.approx(timings["predicted_ms"] / 1e3, abs=1e-5)
    # the gauges: this request's throughput (the window since the last read), nothing running or waiting now
    assert after["prompt_tokens_seconds"] == pytest.approx(timings["prompt_per_second"], rel=1e-2)
    assert after["predicted_tokens_seconds"] == pytest.approx(timings["predicted_per_second"], rel=1e-2)
    assert after["requests_processing"] == 0 and after["requests_deferred"] == 0
    assert _metrics(server)["prompt_tokens_seconds"] == 0  # a new window, with nothing in it yet
    # a request's tokens count on every endpoint: /v1/completions' too
    openai_answer = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **GREEDY}).json()
    again = _metrics(server)
    assert again["tokens_predicted_total"] - after["tokens_predicted_total"] == openai_answer["usage"][
        "completion_tokens"]


def test_any_model_name_is_answered_with_the_served_one(server, model):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == model.name and chat.choices[0].message.content is not None
    text = client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=3)
    assert text.model == model.name
    streamed = list(client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=3, stream=True))
    assert streamed and all(c.model == model.name for c in streamed)
    assert server.completion(model="gpt-4o", n_predict=2)["model"] == model.name


def test_with_a_key_the_llama_server_endpoints_need_it(model, decoder):
    from starlette.testclient import TestClient

    from moepass.serve.server import ModelServer, create_app

    with TestClient(create_app(ModelServer(decoder, "m", 4), "sesame")) as client:
        for path in ("/props", "/slots", "/metrics"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"authorization": "Bearer sesame"}).status_code == 200, path
        assert client.post("/completion", json={"prompt": "hi", "n_predict": 1}).status_code == 401


def test_metrics_are_counted_exactly_from_many_threads():
    """Generations are recorded on the slots' threads, /metrics read meanwhile: no count is lost."""
    from types import SimpleNamespace

    from moepass.serve.server import Metrics

    metrics = Metrics()
    stream = SimpleNamespace(first_token_at=1.0, prefilled_tokens=7, prompt_seconds=0.5, completion_tokens=3,
                             generation_seconds=0.25)

    def record() -> None:
        for i in range(2000):
            metrics.record(stream)
            if i % 100 == 0:
                metrics.text(0, 0, 0)

    threads = [threading.Thread(target=record) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (metrics.prompt_tokens, metrics.predicted_tokens) == (16000 * 7, 16000 * 3)
    assert metrics.prompt_seconds == pytest.approx(8000) and metrics.predicted_seconds == pytest.approx(4000)


def test_fuzzed_completion_requests_are_answered_4xx_or_200_never_500(model, decoder):
    """/completion bodies built from its own fields with values of every JSON kind: 200 or a 4xx in
    OpenAI's error shape, never a 5xx."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    from starlette.testclient import TestClient

    from moepass.serve.server import LLAMA_COMPLETION_FIELDS, ModelServer, create_app

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3000), st.sampled_from([-1, 0xFFFFFFFF, 2**70]),
                        st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=2), max_leaves=6)
    limits = ("n_predict", "max_tokens", "max_completion_tokens")

    def small(body: dict) -> dict:
        """At most a few tokens: limits above 2 (or -1, none) made 2, and 2 where none is given."""
        body = dict(body)
        for k in limits:
            value = body.get(k)
            if type(value) is int and (value > 2 or value == -1):
                body[k] = 2
        if not any(k in body for k in limits):
            body["n_predict"] = 2
        return body

    # values the field takes, more often than not: answers too, not only refusals
    plausible = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
                 "top_k": st.integers(0, 100), "seed": st.integers(-1, 2**32), "repeat_last_n": st.integers(0, 64),
                 "repeat_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
                 "frequency_penalty": st.floats(-2, 2), "stop": st.lists(st.text(max_size=3), max_size=2),
                 "cache_prompt": st.booleans(), "return_tokens": st.booleans(),
                 "model": st.text(min_size=1, max_size=8),
                 **{k: st.sampled_from([-1, 1, 2, 0]) for k in limits}}

    def field(name: str):
        return st.one_of(plausible[name], plausible[name], values) if name in plausible else values  # 2 in 3

    bodies = st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 300), min_size=1, max_size=5),
                             values)},
        optional={f: field(f) for f in sorted(LLAMA_COMPLETION_FIELDS - {"prompt", "stream"})})
    with TestClient(create_app(ModelServer(decoder, model.name, 4)), raise_server_exceptions=False) as client:

        @settings(max_examples=120, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(bodies.map(small), st.booleans())
        def answered(body, stream):
            response = client.post("/completion", json={**body, "stream": stream})
            assert response.status_code < 500, (body, response.text[:300])
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            elif stream:
                assert json.loads(response.text.strip().split("\n\n")[-1][len("data: "):])["stop"] is True
            else:
                assert response.json()["stop"] is True

        answered()
