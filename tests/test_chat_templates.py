"""Chat templates: every published template in llama.cpp's models/templates, written into a fixture GGUF
as `tokenizer.chat_template`, read back into the tokenizer files convert writes, and rendered by
moepass.runtime.chat_template and by transformers' `apply_chat_template` on those same files: one user
message, a system prompt, several turns, tools, a tool call and its result, documents and the thinking
switch, where the template reads them. Every render is byte-identical, or both refuse it with the same
error (REFUSED says which and why); no template needs a documented difference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.chat_templates import NO_TEMPLATES, TEMPLATES_DIR
from support.hostile import V, remake

from moepass import MoepassError
from moepass.core.files import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, read_json_object
from moepass.core.gguf_reader import GGUFModel
from moepass.runtime.chat_template import ChatTemplate
from moepass.pipeline.tokenizer import tokenizer_from_gguf


# OpenAI-style messages; tool calls carry their arguments as a mapping, as transformers documents them
# (published templates iterate over them or pass them to tojson; OpenAI's JSON string is parsed first)
USER = {"role": "user", "content": "What is the weather in Paris?"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ANSWER = {"role": "assistant", "content": "It is sunny in Paris, 18 degrees."}
USER_AGAIN = {"role": "user", "content": "And in Rome?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}]
TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call00001",  # Mistral's templates take nine alphanumeric characters only
    "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "Sunny, 18 degrees."}
DOCUMENTS = [{"title": "Paris weather", "text": "Paris: sunny, 18 degrees."}]

# Variables that a template reads and its model card says to pass: firefunction-v2 takes its tools as a
# JSON string `functions`, and the date as `datetime`
VARIABLES = {"fireworks-ai-llama-3-firefunction-v2": {
    "functions": json.dumps([tool["function"] for tool in TOOLS], indent=4), "datetime": "Mon, 02 Jun 2025"}}

# (template, case) -> the start of the message of the error that both moepass and transformers raise:
# conversations the published template refuses, under transformers as here
_NEEDS_TOOLS = "'NoneType' object is not iterable"  # these tool_use templates loop over `tools` unchecked
REFUSED = {
    ("google-gemma-2-2b-it", "system"): "System role not supported",
    **{(stem, case): _NEEDS_TOOLS
       for stem in ("CohereForAI-c4ai-command-r-plus-tool_use", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
                    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use")
       for case in ("user", "system", "multi-turn")},
    # llama.cpp's own template, written for its minja engine: `tools | map(...) | tojson` hands json.dumps
    # a generator under Jinja
    **{("llama-cpp-deepseek-r1", case): "Object of type generator is not JSON serializable"
       for case in ("tools", "tool call")},
    # Kimi's templates queue tool call ids with list.append, which the immutable sandbox forbids
    **{(stem, "tool call"): "access to attribute 'append' of 'list' object is unsafe"
       for stem in ("Kimi-K2-Instruct", "Kimi-K2-Thinking")},
    # Cohere's tool_use templates loop over `tools` whenever documents are given (its RAG prompt is another
    # template, "rag"); with tools too they render
    **{(stem, "documents"): "'NoneType' object is not iterable"
       for stem in ("Cohere2MoE", "CohereForAI-c4ai-command-r7b-12-2024-tool_use")},
    # functionary v3.2 concatenates the arguments as a string: it takes OpenAI's JSON string only
    ("meetkai-functionary-medium-v3.2", "tool call"): 'can only concatenate str (not "dict") to str',
}


def _mentions(source: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", source) is not None


def _cases(source: str, thinking_switch: str | None) -> dict[str, tuple[list[dict], dict]]:
    """case name -> (messages, keyword arguments of the render) for what this template reads."""
    cases = {"user": ([USER], {}), "system": ([SYSTEM, USER], {}), "multi-turn": ([USER, ANSWER, USER_AGAIN], {})}
    if _mentions(source, "tools"):
        cases["tools"] = ([SYSTEM, USER], {"tools": TOOLS})
    if _mentions(source, "tool_calls"):
        cases["tool call"] = ([USER, TOOL_CALL, TOOL_RESULT], {"tools": TOOLS})
    if _mentions(source, "documents"):
        cases["documents"] = ([USER], {"documents": DOCUMENTS})
        if "tools" in cases:
            cases["tools and documents"] = ([USER], {"tools": TOOLS, "documents": DOCUMENTS})
    if thinking_switch:
        cases[f"{thinking_switch}=True"] = ([USER, ANSWER, USER_AGAIN], {thinking_switch: True})
        cases[f"{thinking_switch}=False"] = ([USER, ANSWER, USER_AGAIN], {thinking_switch: False})
    return cases


def _outcome(catch: type[Exception], render, *args, **kwargs) -> tuple[str | None, Exception | None]:
    """(the text, None), or (None, the error) where `render` raises `catch`; anything else fails the test."""
    try:
        return render(*args, **kwargs), None
    except catch as e:
        return None, e


def _tokenizer_files(gguf: Path, source: str, folder: Path) -> Path:
    """The tokenizer files convert writes for the fixture GGUF carrying `source` as its chat template."""
    with_template = remake(gguf, folder / "model.gguf", set_kv={"tokenizer.chat_template": (source, V.STRING)})
    files = tokenizer_from_gguf(GGUFModel(with_template))
    assert files.tokenizer is not None, files.info
    files.write(folder, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
    return folder


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in sorted(TEMPLATES_DIR.glob("*.jinja"))]
                         if TEMPLATES_DIR else [pytest.param(None, marks=pytest.mark.skip(reason=NO_TEMPLATES))])
def test_template_renders_as_transformers_does(path, make_gguf, tmp_path):
    from transformers import PreTrainedTokenizerFast

    source = path.read_bytes().decode("utf-8")  # as it is: no newline translation
    folder = _tokenizer_files(make_gguf("q4_0"), source, tmp_path)
    config = read_json_object(folder / TOKENIZER_CONFIG_FILE)
    assert config["chat_template"] == source
    ours = ChatTemplate(config["chat_template"], folder / TOKENIZER_CONFIG_FILE, config["bos_token"], config["eos_token"])
    theirs = PreTrainedTokenizerFast.from_pretrained(folder)
    assert theirs.chat_template == source and theirs.special_tokens_map == {
        "bos_token": config["bos_token"], "eos_token": config["eos_token"]}  # what apply_chat_template passes too
    cases = _cases(source, ours.thinking_switch)
    assert not {case for stem, case in REFUSED if stem == path.stem} - set(cases), "REFUSED names a case not rendered"
    wrong = []
    for case, (messages, kwargs) in cases.items():
        kwargs = {**VARIABLES.get(path.stem, {}), **kwargs}
        their_text, their_error = _outcome(Exception, theirs.apply_chat_template, messages, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
        our_text, our_error = _outcome(MoepassError, ours.render, messages, add_generation_prompt=True, **kwargs)
        refused = REFUSED.get((path.stem, case))
        if refused is None:
            same = their_error is None and our_error is None and our_text == their_text
        else:  # transformers raises the listed error; moepass raises it too, naming the file
            same = (their_error is not None and str(their_error).startswith(refused)
                    and str(our_error) == f"{ours.where}: the chat template cannot be rendered "
                                          f"({type(their_error).__name__}: {str(their_error).splitlines()[0]})")
        if not same:
            wrong.append((case, our_error or our_text, their_error or their_text))
    assert not wrong, "\n".join(f"{case}:\n  moepass:      {mine!r}\n  transformers: {hf!r}"
                                for case, mine, hf in wrong)


def test_exceptions_name_templates_that_exist():
    if TEMPLATES_DIR is None:
        pytest.skip(NO_TEMPLATES)
    stems = {p.stem for p in TEMPLATES_DIR.glob("*.jinja")}
    assert {stem for stem, case in REFUSED} | set(VARIABLES) <= stems


def test_qwen3_thinking_switch():
    if TEMPLATES_DIR is None:
        pytest.skip(NO_TEMPLATES)
    path = TEMPLATES_DIR / "Qwen-Qwen3-0.6B.jinja"
    template = ChatTemplate(path.read_bytes().decode("utf-8"), path, "<|endoftext|>", "<|im_end|>")
    assert template.thinking_switch == "enable_thinking"
    prompt = "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert template.render([USER]) == template.render([USER], enable_thinking=True) == prompt  # thinks by default
    # switched off: an empty think block after the generation prompt, so the model answers at once
    assert template.render([USER], enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"


def test_a_template_that_never_ends_or_grows_without_bound_is_stopped(monkeypatch):
    """Code from the model file: bounded in time (RENDER_SECONDS, the worker stopped) and in size
    (MAX_RENDERED_CHARS, also for a value built by `*`), one line naming the file."""
    import time

    import moepass.runtime.chat_template as chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    messages = [{"role": "user", "content": "hi"}]
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.perf_counter()
    with pytest.raises(MoepassError, match=r"^model/tokenizer_config.json: the chat template ran for more than"):
        chat_template.ChatTemplate(looping, "model/tokenizer_config.json").render(messages)
    # stopped by its 0.5 s limit: a generous 30 s on a loaded machine, where unstopped it runs for hours
    assert time.perf_counter() - start < 30
    for growing in ("{{ 'x' * 10**10 }}", "{{ [1] * 10**9 }}", "{% for i in range(100000) %}{{ 'y' * 1000 }}"
                    "{% endfor %}"):
        with pytest.raises(MoepassError, match="the chat template cannot be rendered"):
            chat_template.ChatTemplate(growing, "t").render(messages)
    assert chat_template.ChatTemplate("{{ 'ab' * 3 }}", "t").render(messages) == "ababab"
