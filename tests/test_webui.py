"""The chat page `moepass serve` answers / with, driven in a real browser: Debian's Chromium through
Playwright (`executable_path`; nothing downloaded), against the server on the demo fixture. A
message gets the text the API gives greedily; Stop cancels the answer and the server takes the next
request at once; a reload finds the conversation; markup in an answer is shown as text and runs
nothing; with --api-key the page asks for the key, refuses a wrong one and works with the right
one; every request the page makes goes to the server itself; the page's files are in the package,
small."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from support import markdown_answers
from support.serving import ServeProcess

pytest.importorskip("fastapi")
playwright = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": "0", "max-tokens": "24"}


def chromium() -> str:
    """Debian's Chromium (`apt-get install chromium`, as .ci/run does), or $MOEPASS_CHROMIUM."""
    found = os.environ.get("MOEPASS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no Chromium: apt-get install chromium (or set MOEPASS_CHROMIUM)"
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The demo fixture, converted with float activations: an answer then does not depend (beyond
    float rounding) on how much of its prompt a slot held already, which the page cannot choose."""
    from moepass.convert import convert

    gguf = ROOT / "fixtures" / "qwen3moe-tiny-q4_0.gguf"
    return Path(convert(gguf, tmp_path_factory.mktemp("webui") / "out", activations="float").output_dir)


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    process = ServeProcess(demo, tmp_path_factory.mktemp("webui-server") / "server.log")
    yield process
    assert process.stop() == 0, process.log.read_text()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser, server):
    """A fresh browser context (its own localStorage) on the page; every request it makes recorded.
    The page's Content-Security-Policy is bypassed: the test's own probes are evaluated strings, and
    the page's escaping is tested without the policy behind it."""
    context = browser.new_context(bypass_csp=True)
    opened = context.new_page()
    opened.requests = []
    opened.on("request", lambda request: opened.requests.append(request.url))
    opened.goto(f"{server.base}/")
    yield opened
    context.close()


def settle(page, settings: dict[str, str]) -> None:
    page.click("#toggle-settings")
    for field, value in settings.items():
        page.fill(f"#{field}", value)
        page.dispatch_event(f"#{field}", "change")
    page.click("#toggle-settings")


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_answered(page, count: int = 1) -> None:
    """Until `count` answers are done (each ends with its stats line, or an error)."""
    page.wait_for_function(
        f"document.querySelectorAll('.message.assistant .stats, .message.assistant .error').length >= {count}"
    )


def stored(page) -> list[dict]:
    return json.loads(page.evaluate("localStorage.getItem('moepass.conversations')"))


def test_a_message_gets_the_apis_answer_and_a_reload_keeps_it(page, server):
    settle(page, GREEDY)
    assert page.text_content("#model-name") == "out"
    assert "context 4,096 tokens" in page.text_content("#model-context")
    ask(page, "the other one")
    wait_answered(page)
    expected = httpx.post(f"{server.base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "the other one"}], "temperature": 0, "top_p": 0.95,
        "max_tokens": 24}).json()["choices"][0]["message"]["content"]
    [conversation] = stored(page)
    assert conversation["messages"][0] == {"role": "user", "content": "the other one"}
    assert conversation["messages"][1]["content"] == expected
    stats = page.text_content(".message.assistant .stats")
    assert "prompt tokens" in stats and "generated" in stats and "tokens/s" in stats
    assert conversation["title"] == "the other one"
    # a reload finds the conversation, its answer shown again
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert page.text_content("#conversations li.current .title") == "the other one"
    assert page.locator(".message.user .body").inner_text() == "the other one"
    # every request went to the server itself
    assert page.requests and all(url.startswith(f"{server.base}/") for url in page.requests), page.requests


def long_answer_prompt(model: Path) -> str:
    """A message whose greedy answer runs long on this CPU (at least 100 tokens before a stop token)."""
    from moepass.runtime import Sampling, load

    decoder = load(model, threads=1)
    lengths = {}
    for text in ("tell me more", "once upon a time", "hello there", "why", "more", "a long story", "and again"):
        ids = decoder.encode_chat(decoder.apply_chat_template(text))
        lengths[text] = len(list(decoder.generate(ids, 200, sampling=Sampling(temperature=0))))
    best = max(lengths, key=lengths.get)
    assert lengths[best] >= 100, lengths
    return best


def test_stop_cancels_and_the_server_takes_the_next_request(page, server, demo):
    prompt = long_answer_prompt(demo)
    settle(page, {"temperature": "0", "max-tokens": "200"})
    # a slow reader: the page takes each network read 300 ms late (the demo writes 200 tokens in well
    # under a second), so that Esc lands while the answer still streams
    page.evaluate("""() => {
        const read = window.originalRead = ReadableStreamDefaultReader.prototype.read;
        ReadableStreamDefaultReader.prototype.read = async function () {
            await new Promise((r) => setTimeout(r, 300)); return read.call(this); };
    }""")
    ask(page, prompt)
    page.wait_for_selector("#stop:not([hidden])")
    page.wait_for_function("document.querySelector('.message.assistant .body').textContent.length > 0")
    page.keyboard.press("Escape")
    wait_answered(page)
    assert "stopped" in page.text_content(".message.assistant .stats")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    answer = httpx.post(f"{server.base}/v1/completions", timeout=60,
                        json={"prompt": "hi", "max_tokens": 4, "temperature": 0}).json()
    assert answer["usage"]["completion_tokens"] >= 1  # served: the stopped answer let its slot go
    deadline = time.monotonic() + 60  # a wait, not a speed bound
    while any(slot["is_processing"] for slot in httpx.get(f"{server.base}/slots").json()):
        assert time.monotonic() < deadline, "the stopped answer still holds its slot"
        time.sleep(0.05)
    # regenerate and edit, after a stop
    page.evaluate("() => { ReadableStreamDefaultReader.prototype.read = window.originalRead; }")
    settle(page, GREEDY)
    page.click(".message.assistant .regenerate")
    wait_answered(page)
    page.click(".message.user .edit")
    page.fill(".message.user textarea.edit", "hello there")
    page.click(".message.user .save")
    wait_answered(page)
    messages = stored(page)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "hello there"


def test_a_refused_prompt_gets_its_count_and_what_would_help(page):
    """A first message past the context: the server's token count, the context's, and what helps (not a
    new chat); a later turn: the conversation's count, and a new chat or an edit besides."""
    ask(page, "one two three " * 1500)  # past the demo's 4,096 positions (15,015 tokens)
    wait_answered(page)
    said = page.text_content(".message.assistant .error")
    assert re.fullmatch(r"This message is [\d,]+ tokens; the model's context holds 4,096\. Send a shorter message, "
                        r"or convert the model with a longer context \(moepass convert --context N\)\.", said), said
    page.click("#new-chat")
    settle(page, GREEDY)
    ask(page, "one two three " * 200)  # 2,000 tokens, and a 2,100-token message that would fit alone
    wait_answered(page, 1)
    ask(page, "one two three " * 210)
    wait_answered(page, 2)
    said = page.locator(".message.assistant .error").last.text_content()
    assert re.match(r"The conversation is [\d,]+ tokens; the model's context holds 4,096\. Start a new chat", said), said


def test_twenty_turns_of_chat_on_the_demo_fit_its_context(page):
    """The page's answer length left to it (a 32nd of the context): twenty turns on the demo model, whose
    random weights seldom stop an answer, without a refusal."""
    settle(page, {"temperature": "0"})
    assert page.get_attribute("#max-tokens", "placeholder") == "auto: 128"
    for turn in range(20):
        ask(page, f"turn {turn}: tell me more")
        wait_answered(page, turn + 1)
    assert page.locator(".message.assistant .error").count() == 0
    messages = stored(page)[0]["messages"]
    assert len(messages) == 40 and all(m["content"] for m in messages[1::2])


def test_a_phones_width_and_the_keys(browser, server):
    context = browser.new_context(bypass_csp=True, viewport={"width": 390, "height": 800})
    page = context.new_page()
    page.goto(f"{server.base}/")
    page.wait_for_function("document.getElementById('model-name').textContent === 'out'")
    assert not page.is_visible("#sidebar") and page.is_visible("#composer")
    page.click("#toggle-sidebar")
    assert page.is_visible("#new-chat")
    page.click("#new-chat")  # a new conversation folds the list away again
    assert not page.is_visible("#sidebar")
    page.click("#toggle-sidebar")
    page.click("#close-sidebar")  # its close button
    assert not page.is_visible("#sidebar")
    page.click("#toggle-sidebar")
    page.mouse.click(370, 400)  # a tap outside it, on the conversation's side
    assert not page.is_visible("#sidebar") and page.locator("#conversations li").count() == 2
    page.fill("#input", "first line")
    page.press("#input", "Shift+Enter")
    page.type("#input", "second line")
    assert page.input_value("#input") == "first line\nsecond line" and page.locator(".message").count() == 0
    settle(page, GREEDY)
    page.press("#input", "Enter")
    wait_answered(page)
    assert page.locator(".message.user .body").inner_text() == "first line\nsecond line"
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width  # nothing wider than the screen
    context.close()


HOSTILE = ('<img src=x onerror="window.pwned=1"><script>window.pwned=2</script> '
           '[click](javascript:window.pwned=3) **bold** `code`\n\n```\n<b onmouseover="window.pwned=4">x</b>\n```')


def test_markup_in_an_answer_is_text_and_runs_nothing(page):
    """The answer comes from a stand-in for the server (the demo model writes no markup): raw HTML,
    a script, an event handler and a javascript: link all show as text; markdown still renders."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": HOSTILE[:40]}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": HOSTILE[40:]}, "finish_reason": None}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    ask(page, "anything")
    wait_answered(page)
    answer = page.locator(".message.assistant .body")
    text = answer.inner_text()
    assert '<img src=x onerror="window.pwned=1">' in text and "<script>window.pwned=2</script>" in text
    assert "[click](javascript:window.pwned=3)" in text
    assert answer.locator("img, script, a, b").count() == 0
    assert answer.locator("strong").inner_text() == "bold" and answer.locator("pre code").count() == 1
    page.hover(".message.assistant pre")
    assert page.evaluate("window.pwned") is None


RENDERED = """(text) => {
  const root = renderMarkdown(text);
  const all = (selector) => [...root.querySelectorAll(selector)].map((node) => node.textContent);
  return {code: all("pre code"), languages: all(".code-language"), copies: root.querySelectorAll("button.code-copy").length,
          paragraphs: all("p"), elements: root.querySelectorAll("pre b, pre script").length};
}"""


@pytest.mark.parametrize("text,code,languages,paragraphs", [
    ("```\nline one\nline two\n```", ["line one\nline two"], [], []),
    ("before\n\n```python\nx = `a` + '``'\n    y = 1\n```\nafter", ["x = `a` + '``'\n    y = 1"], ["python"],
     ["before", "after"]),
    ("```js\nlet a = 1\nlet b", ["let a = 1\nlet b"], ["js"], []),  # unclosed while streaming: code to the end
    ("```\n<b>x</b>\n<script>window.pwned = 5</script>\n```", ["<b>x</b>\n<script>window.pwned = 5</script>"], [], []),
    ("```\none\n```\n\n```sh\ntwo\nthree\n```", ["one", "two\nthree"], ["sh"], []),
])
def test_a_fenced_block_is_one_block_with_its_language_and_a_copy_button(page, text, code, languages, paragraphs):
    """Every line of a fenced block is the block's, as text (the fence used to close at the first line's
    end, leaving the rest and the closing fence as a paragraph); its language a label, a copy button."""
    rendered = page.evaluate(RENDERED, text)
    assert rendered["code"] == code and rendered["languages"] == languages, rendered
    assert rendered["copies"] == len(code) and rendered["elements"] == 0, rendered
    assert rendered["paragraphs"] == paragraphs, rendered


OUTLINE = """(text) => {
  const own = (node) => [...node.childNodes].filter((c) => !["UL", "OL"].includes(c.nodeName))
    .map((c) => c.textContent).join("");
  const outline = (node) => {
    const tag = node.tagName.toLowerCase();
    if (node.classList.contains("code-block")) {
      const label = node.querySelector(".code-language");
      return ["code", label ? label.textContent : null, node.querySelector("pre code").textContent];
    }
    if (node.classList.contains("table-wrap")) {
      const cells = (row) => [...row.children].map((cell) => cell.textContent);
      return ["table", cells(node.querySelector("thead tr")), [...node.querySelectorAll("tbody tr")].map(cells),
              [...node.querySelector("thead tr").children].map((cell) => cell.style.textAlign)];
    }
    if (tag === "ul" || tag === "ol") {
      return [tag, node.getAttribute("start"), [...node.children].map((li) =>
        [own(li), ...[...li.children].filter((c) => ["UL", "OL"].includes(c.nodeName)).map(outline)])];
    }
    return [tag, node.textContent];
  };
  return [...renderMarkdown(text).children].map(outline);
}"""


def _lists(value):
    """The corpus' outline with tuples as the lists JSON gives back."""
    return [_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


@pytest.mark.parametrize("index", range(len(markdown_answers.CORPUS)))
def test_answers_with_code_lists_and_tables_render_as_written(page, index):
    """tests/support/markdown_answers.py: numbered steps with code between them keep their numbers,
    nested lists nest, tables have their cells and alignments (an escaped pipe is a pipe), quotes,
    rules, headings and links come out as the blocks they are, every text as text."""
    text, expected = markdown_answers.CORPUS[index]
    assert page.evaluate(OUTLINE, text) == _lists(expected)


LINKS = """(text) => [...renderMarkdown(text).querySelectorAll("a")].map((a) => [a.textContent, a.getAttribute("href")])"""


def test_links_keep_their_parentheses_and_stop_at_the_sentences(page):
    """A URL with balanced parentheses is whole (it was cut at the first ")"); a link inside a
    parenthesis ends at its own; only http(s) and mailto become links."""
    assert page.evaluate(LINKS, "see [Foo](https://en.wikipedia.org/wiki/Foo_(bar)) now") == [
        ["Foo", "https://en.wikipedia.org/wiki/Foo_(bar)"]]
    assert page.evaluate(LINKS, "(as [the docs](https://x.org/a) say), and [mail](mailto:a@b.org)") == [
        ["the docs", "https://x.org/a"], ["mail", "mailto:a@b.org"]]
    assert page.evaluate(LINKS, "[x](javascript:alert(1)) [y](ftp://x.org)") == []


@pytest.mark.parametrize("line", ["[", "[a](", "`", "**a", "*a", "| a "])
def test_a_long_line_renders_in_time_linear_in_its_length(page, line):
    """A line of 40,000 "[" took 606 ms (each "[" read to the line's end: quadratic), re-rendered every
    50 ms while streaming. Linear: four times the text, under eight times the time (quadratic would be
    sixteen), the best of five renders each."""
    ratio = page.evaluate("""(unit) => {
      const best = (n) => {
        const text = unit.repeat(n);
        let least = Infinity;
        for (let i = 0; i < 5; i++) {
          const t0 = performance.now();
          renderMarkdown(text);
          least = Math.min(least, performance.now() - t0);
        }
        return least;
      };
      best(2000);  // warm
      return best(80000 / unit.length) / Math.max(best(20000 / unit.length), 0.5);
    }""", line)
    assert ratio < 8, ratio


def test_the_page_asks_for_the_api_key(browser, demo, tmp_path):
    guarded = ServeProcess(demo, tmp_path / "server.log", "--api-key", "sesame")
    try:
        assert httpx.get(f"{guarded.base}/").status_code == 200  # the page itself needs no key
        assert httpx.get(f"{guarded.base}/props").status_code == 401  # the API does
        context = browser.new_context(bypass_csp=True)
        page = context.new_page()
        page.goto(f"{guarded.base}/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key", "wrong")
        page.click("#key-save")
        page.wait_for_function("document.getElementById('key-message').textContent.includes('refused')")
        assert page.is_visible("#key-dialog")
        page.fill("#key", "sesame")
        page.click("#key-save")
        page.wait_for_function("document.getElementById('model-name').textContent === 'out'")
        settle(page, GREEDY)
        ask(page, "the other one")
        wait_answered(page)
        assert stored(page)[0]["messages"][1]["content"]
        context.close()
    finally:
        assert guarded.stop() == 0


def test_no_webui_serves_no_page(demo, tmp_path):
    bare = ServeProcess(demo, tmp_path / "server.log", "--no-webui")
    try:
        assert httpx.get(f"{bare.base}/").status_code == 404
        assert httpx.get(f"{bare.base}/webui/app.js").status_code == 404
    finally:
        assert bare.stop() == 0
    assert "chat in a browser" not in bare.log.read_text()


def test_the_wheel_carries_the_page(tmp_path):
    """Built as a wheel (not only the editable install these tests run from), the package holds the page."""
    import subprocess
    import sys
    import zipfile

    from moepass.serve.server import WEBUI_FILES

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("moepass-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"moepass/serve/webui/{name}" for name in WEBUI_FILES} <= names


def test_the_pages_files_are_in_the_package_and_small(server):
    from importlib import resources

    from moepass.serve.server import WEBUI_FILES

    folder = resources.files("moepass.serve").joinpath("webui")
    sizes = {name: len(folder.joinpath(name).read_bytes()) for name in WEBUI_FILES}
    assert sum(sizes.values()) < 300_000, sizes
    for name in WEBUI_FILES:
        reply = httpx.get(f"{server.base}/" if name == "index.html" else f"{server.base}/webui/{name}")
        assert reply.status_code == 200 and "default-src 'none'" in reply.headers["content-security-policy"]
    assert httpx.get(f"{server.base}/webui/../server.py").status_code == 404
    assert "chat in a browser: http://127.0.0.1:" in server.log.read_text()
