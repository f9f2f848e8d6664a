"""`moepass serve --parallel N`: N slots decoded together. Concurrent clients each get the answer
the same request gets alone; /slots, /props and /metrics show the slots; a client that leaves
frees its slot at once; many mixed requests leave the server's memory where it was."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.serving import ServeProcess

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SLOTS = 4


@pytest.fixture(scope="module")
def model(converted) -> Path:
    """Float activations: a row decoded in a batch differs from the row alone by float rounding at
    most, so every answer is the one alone token for token (tests/test_batch.py holds int8
    activations to their bound)."""
    return Path(converted("q4_0", activations="float"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    process = ServeProcess(model, tmp_path_factory.mktemp("parallel") / "server.log", "--parallel", str(SLOTS))
    yield process
    assert process.stop() == 0, process.log.read_text()


def completion(base: str, prompt, max_tokens: int, stream: bool = False, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}
    if not stream:
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        return {"text": answer["choices"][0]["text"], "tokens": answer["usage"]["completion_tokens"]}
    text, chunks = "", 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                chunks += 1
    return {"text": text, "streamed": chunks > 0}


def answers_together(base: str, prompts: list, max_tokens: int, stream: bool = True) -> list:
    """The answers of one client a prompt, all asking at once (every other one streamed)."""
    got: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        start.wait()
        got[i] = completion(base, prompts[i], max_tokens, stream=stream and i % 2 == 1)["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_concurrent_clients_each_get_the_answer_alone(server):
    """Four clients at once, prompts of different lengths, streamed and not: each answer is the
    one the same request gets alone, and the model's steps were shared (fewer steps than tokens)."""
    prompts = ["a", "the other one and then some more words to make it longer", [5, 9, 30, 31, 2, 8], "hello there"]
    expected = [completion(server.base, p, 24)["text"] for p in prompts]
    before = _metric(server, "n_decode_total")
    assert answers_together(server.base, prompts, 24) == expected
    steps = _metric(server, "n_decode_total") - before
    assert steps < 4 * 24  # four answers of up to 24 tokens, in shared steps


def test_native_slots_answer_as_alone_with_int8_activations(converted, tmp_path):
    """Through the native form (moepass's own kernels, int8 activations quantized per row, one sum
    order whatever the batch) the answers of four clients at once are the answers alone, as the float
    model's are."""
    import moepass.cpu_ops as cpu_ops

    if cpu_ops.unavailable() is not None:
        pytest.skip(cpu_ops.unavailable())
    native = ServeProcess(Path(converted("q4_k_m", expert_format="native")), tmp_path / "native.log",
                          "--parallel", str(SLOTS))
    try:
        prompts = ["a", "the other one and then some more words to make it longer", [5, 9, 30, 31, 2, 8], "hello"]
        expected = [completion(native.base, p, 24)["text"] for p in prompts]
        assert answers_together(native.base, prompts, 24, stream=False) == expected
    finally:
        assert native.stop() == 0, native.log.read_text()


def test_slots_props_and_metrics_show_every_slot(server, model):
    slots = httpx.get(f"{server.base}/slots").json()
    assert [s["id"] for s in slots] == list(range(SLOTS))
    props = httpx.get(f"{server.base}/props").json()
    assert props["total_slots"] == SLOTS
    kv = props["kv_cache"]
    assert kv["slots"] == SLOTS and kv["bytes_per_position"] > 0
    assert kv["bytes_at_context"] == kv["bytes_per_position"] * props["n_ctx"] * SLOTS
    assert f"{SLOTS} slots (decoded together in one batch); KV cache" in server.log.read_text()


def test_a_client_that_leaves_frees_its_slot(server):
    """A streamed answer of 400 tokens whose client leaves after two chunks: its slot is free
    within a step or two, and the others were never held up."""
    body = {"prompt": "the other one", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as reply:
        seen = 0
        for line in reply.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break
    deadline = time.monotonic() + 10
    while any(s["is_processing"] for s in httpx.get(f"{server.base}/slots").json()):
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    assert "went away after" in server.log.read_text()
    assert completion(server.base, "hi", 2)["tokens"] >= 1


def test_many_mixed_requests_leave_memory_where_it_was(server):
    """50 requests, eight at a time (more than the slots: some wait), short and long, streamed and
    not, some cancelled mid-answer: afterwards every slot is free and the resident memory is
    where the same mix left it the first time (no sequence, cache or thread left behind)."""

    def mix(seed: int) -> None:
        def one(i: int) -> None:
            kind = (seed + i) % 5
            if kind == 4:  # a client that leaves after its first chunk
                body = {"prompt": f"cut {i}", "max_tokens": 200, "temperature": 0, "stream": True}
                with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as reply:
                    for line in reply.iter_lines():
                        if line.startswith("data: {"):
                            break
                return
            completion(server.base, f"request {i} " * (1 + 10 * (kind == 3)), 2 + 30 * (kind % 2), stream=kind == 2)

        threads = []
        for i in range(50):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            if len(threads) >= 8:
                threads.pop(0).join(120)
        for t in threads:
            t.join(120)
        deadline = time.monotonic() + 10
        while any(s["is_processing"] for s in httpx.get(f"{server.base}/slots").json()):
            assert time.monotonic() < deadline
            time.sleep(0.05)

    mix(0)
    first = _rss(server)
    mix(1)
    second = _rss(server)
    assert second <= first + (16 << 20), (first, second)


def _rss(server: ServeProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _metric(server: ServeProcess, name: str) -> float:
    for line in httpx.get(f"{server.base}/metrics").text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(name)
