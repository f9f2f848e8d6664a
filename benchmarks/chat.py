"""What keeping the conversation in the KV cache buys `moepass chat` (and `serve`'s prompt cache).

    python benchmarks/chat.py                  # 2 layers of Qwen3-30B-A3B's sizes, Q4_0, 4 turns
    python benchmarks/chat.py --layers 6 --turns 6

A Qwen3-30B-A3B-sized file (hidden 2048, 128 experts, top-8, 151,936-token vocabulary; fewer
layers; fixtures/make_fixtures.py, fixed seed, its ChatML template) converted with the defaults.
Each turn of a conversation is answered twice, greedily, from the same history: by one
`moepass.runtime.Conversation` that keeps its KV cache from turn to turn (what `moepass chat`
does), and with a fresh cache that computes the whole rendered history again (what a tool without
a cache does). Reported per turn: prompt tokens, tokens computed, time to the first answer token
(prefill) both ways; the answers must be the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

import make_fixtures  # noqa: E402

TURNS = ["the other one, and then the one before it, if you please, with all of it said twice",
         "and what of the others? say it again, slowly, one by one, so that I hear them all",
         "the first of them, then the last; and the one in between, if there is one at all",
         "once more from the start: all of them, in the order they came, and nothing left out",
         "and now the other way round, from the last one back to the first, as before",
         "that is all; say it one last time, the whole of it, and then we are done here"]


def first_token_seconds(stream) -> tuple[float, list[int]]:
    start = time.perf_counter()
    pieces = iter(stream)
    first = None
    for _ in pieces:
        if first is None:
            first = time.perf_counter() - start
    return (first if first is not None else time.perf_counter() - start), stream.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4, choices=range(1, len(TURNS) + 1))
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import moepass
    from moepass.runtime import Conversation, KVCache, Sampling

    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        dims = dataclasses.replace(make_fixtures.QWEN3_30B_DIMS, n_layers=args.layers)
        gguf = make_fixtures.write_moe_gguf(Path(scratch) / "chat.gguf", "q4_0", dims=dims)
        out = moepass.convert(gguf, Path(scratch) / "out").output_dir
        decoder = moepass.load(out, threads=args.threads)
        kept = Conversation(decoder)
        greedy = Sampling()
        print(f"{args.layers} layers of Qwen3-30B-A3B's sizes, Q4_0, {args.threads} threads; answers of at most "
              f"{args.answer_tokens} tokens, greedy")
        print(f"{'turn':>4} {'prompt':>7} {'computed':>9} {'prefill (kept cache)':>21} {'prefill (fresh)':>16} "
              f"{'ratio':>6}")
        for turn, text in enumerate(TURNS[:args.turns], 1):
            ids = kept.prompt_ids(text)
            fresh = decoder.generate_text(decoder.encode(decoder.chat_template.render(
                [*kept.messages, {"role": "user", "content": text}])), args.answer_tokens, greedy,
                cache=KVCache(decoder, len(ids) + args.answer_tokens))
            fresh_s, fresh_ids = first_token_seconds(fresh)
            kept_s, kept_ids = first_token_seconds(_Say(kept, text, args.answer_tokens, greedy))
            same = "" if kept_ids == fresh_ids else "  (answers differ)"
            print(f"{turn:>4} {kept.last.prompt_tokens:>7} {kept.last.prefilled_tokens:>9} {kept_s * 1e3:>18.1f} ms "
                  f"{fresh_s * 1e3:>13.1f} ms {fresh_s / kept_s:>5.1f}x{same}")


class _Say:
    """conversation.say(...) as a stream whose token_ids are known afterwards."""

    def __init__(self, conversation, text, n, sampling):
        self.conversation, self.args = conversation, (text, n, sampling)

    def __iter__(self):
        yield from self.conversation.say(*self.args)

    @property
    def token_ids(self):
        return self.conversation.last.token_ids


if __name__ == "__main__":
    main()
