"""`moepass chat` as a user sees it, through a pseudo-terminal (pexpect): turns that keep the history
in the KV cache (the second turn computes fewer prompt tokens than the whole history holds), the
first answer equal to `moepass run --chat`'s, /reset, /clear, an unknown /command named, Ctrl-C
stopping an answer without leaving, /exit; --think/--no-think on a template without the switch."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from make_fixtures import LONG_DIMS
from moepass.cli import main
from support.turn_speed import TURN_SPEED

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the test extra")

def _spawn(model: Path, *args: str):
    # cwd: `-m` puts the working directory first on sys.path (tests/conftest.py says why not the repository);
    # SIGINT as a terminal gives it: a suite started in the background by a shell inherits SIGINT ignored
    child = pexpect.spawn(sys.executable, ["-m", "moepass.cli", "chat", str(model), "--threads", "1", *args],
                          cwd=str(model.parent), encoding="utf-8", codec_errors="replace", timeout=120,
                          dimensions=(50, 400), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect_exact("Ctrl-C stops an answer")
    return child


def _command(child, text: str, *replies: str) -> None:
    """At the prompt, a /command, and what it answers, in order."""
    child.expect_exact("> ")
    child.sendline(text)
    for reply in replies:
        child.expect_exact(reply)


def _exit(child) -> None:
    _command(child, "/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def _turn(child, text: str) -> tuple[str, tuple]:
    child.expect_exact("> ")
    child.sendline(text)
    child.expect(TURN_SPEED)
    return child.before, child.match.groups()


def test_two_turns_reuse_the_cache_and_reset_forgets(converted):
    model = Path(converted("q4_0"))
    child = _spawn(model, "--max-new-tokens", "8", "--seed", "5", "--system", "be brief")
    answer, (stopped, new, prompt, computed) = _turn(child, "the other one")
    assert not stopped and int(computed) == int(prompt)  # the first turn computes its whole prompt
    expected = CliRunner().invoke(main, ["run", str(model), "--chat", "--system", "be brief", "--prompt",
                                         "the other one", "--max-new-tokens", "8", "--seed", "5", "--temperature",
                                         "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05"])
    assert expected.exit_code == 0, expected.output
    # the terminal echoes the line typed and writes \r\n; compare what the model wrote
    shown = answer.split("the other one", 1)[1].replace("\r\n", "\n").strip("\n")
    assert shown == expected.stdout.strip("\n").replace("\r\n", "\n")
    _, (_, _, prompt2, computed2) = _turn(child, "and then")
    assert int(prompt2) > int(prompt) + int(new)       # the history: first turn, answer, second turn
    assert int(computed2) < int(prompt2) - int(prompt)  # only what the cache did not hold
    _command(child, "/reset", "(conversation forgotten)")
    _, (_, _, prompt3, _) = _turn(child, "the other one")
    assert int(prompt3) == int(prompt)
    _exit(child)


def test_a_speculative_chat_answers_as_a_plain_one(converted):
    """chat --speculative ngram, greedy: each turn's answer is the plain chat's, over the kept cache
    (a float model, as in test_serve)."""
    model = Path(converted("f32"))
    answers = {}
    for extra in ((), ("--speculative", "ngram")):
        child = _spawn(model, "--max-new-tokens", "12", "--temperature", "0", *extra)
        answers[extra] = [_turn(child, text)[0].replace("\r\n", "\n") for text in ("the other one", "and then")]
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    assert answers[("--speculative", "ngram")] == answers[()]


ANSWER = 1500  # tokens: seconds to write on make_fixtures.LONG_DIMS


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(converted):
    """Greedy decoding of a prompt whose long answer meets no stop token (checked first, on this
    CPU), so that the answer is still being written when Ctrl-C comes."""
    from moepass.runtime import load

    model = Path(converted("q4_0", dims=LONG_DIMS))
    decoder = load(model, threads=1)
    prompt = next((p for p in ("the other one", "tell me more", "a long story", "go on", "and again")
                   if not set(decoder.generate(decoder.encode(decoder.apply_chat_template(p)), ANSWER))
                   & set(decoder.stop_ids)), None)
    if prompt is None:
        pytest.skip(f"every prompt's greedy answer meets a stop token within {ANSWER} tokens on this CPU")
    child = _spawn(model, "--max-new-tokens", str(ANSWER), "--temperature", "0")
    child.expect_exact("> ")
    child.sendline(prompt)
    child.expect(re.escape(prompt) + r"\r\n.")  # the terminal's echo, then the answer's first piece
    child.delaybeforesend = 0
    child.sendintr()
    child.expect(TURN_SPEED)
    stopped, new, _, _ = child.match.groups()
    assert stopped and int(new) < ANSWER
    _, (stopped, _, _, computed) = _turn(child, "go on")
    assert not stopped and int(computed) > 0
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_turn_past_the_context_is_refused_and_the_conversation_goes_on(converted):
    """A message that with the history overflows the context (512 tokens here) is not sent: one
    line says so, and the next turn continues the same conversation."""
    model = Path(converted("q4_0"))
    child = _spawn(model, "--max-new-tokens", "4", "--seed", "5")
    _, (_, new, prompt, _) = _turn(child, "the other one")
    child.expect_exact("> ")
    child.sendline("then " * 600)
    child.expect_exact("(not sent: with this message the prompt has ")
    child.expect_exact("/reset forgets the conversation)")
    _, (_, _, prompt2, computed2) = _turn(child, "and then")
    assert int(prompt2) > int(prompt) + int(new) and int(computed2) < int(prompt2)  # the history is still there
    child.expect_exact("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_clear_empties_the_cache_keeps_the_system_prompt_and_an_unknown_command_is_named(converted):
    """/reset keeps in the cache what the new history shares (the system prompt): the next turn
    computes little; /clear empties it: the same prompt (the system prompt kept) is computed whole.
    `/x` says "unknown command /x", then the list."""
    model = Path(converted("q4_0"))
    child = _spawn(model, "--max-new-tokens", "4", "--seed", "5", "--system", "be brief")
    _, (_, _, prompt, computed) = _turn(child, "the other one")
    assert computed == prompt
    _command(child, "/reset", "(conversation forgotten)")
    _, (_, _, prompt2, computed2) = _turn(child, "the other one")
    assert prompt2 == prompt and int(computed2) < int(prompt)
    _command(child, "/clear", "(conversation and KV cache cleared; the system prompt stays)")
    _, (_, _, prompt3, computed3) = _turn(child, "the other one")
    assert prompt3 == prompt and computed3 == prompt3
    _command(child, "/x", "unknown command /x\r\n/reset ", "/clear ")
    _exit(child)


def test_think_on_a_template_without_the_switch_is_a_warning_and_the_chat_goes_on(converted):
    model = converted("q4_0")
    args = ["run", str(model), "--chat", "-p", "the other one", "-n", "4", "--seed", "5"]
    switched = CliRunner().invoke(main, [*args, "--no-think"])
    assert switched.exit_code == 0, switched.output
    warned = [line for line in switched.stderr.splitlines() if line.startswith("moepass: warning: ")]
    assert warned == [f"moepass: warning: {model / 'tokenizer_config.json'}: this chat template has no thinking "
                      "switch; --no-think is ignored"], switched.stderr
    assert switched.stdout == CliRunner().invoke(main, args).stdout
    chat = CliRunner().invoke(main, ["chat", str(model), "--think"], input="/exit\n")
    assert chat.exit_code == 0 and "--think is ignored" in chat.stderr, chat.output
