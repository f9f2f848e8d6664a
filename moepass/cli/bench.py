"""`moepass bench`: prompt and generation speed, as llama-bench measures them."""

from __future__ import annotations

import gc
import json
import time

import click

from moepass.cli.common import (
    context_size,
    converted,
    echo_placement,
    load_settings,
    model_argument,
    run_within,
    runtime_options,
    stderr,
)
from moepass.core.errors import MoepassError


@click.command()
@model_argument()
@click.option(
    "-p",
    "--prompt-tokens",
    type=click.IntRange(1, None),
    default=128,
    show_default=True,
    help="Tokens in the prefill measured (llama-bench's -p).",
)
@click.option(
    "-n",
    "--new-tokens",
    type=click.IntRange(1, None),
    default=64,
    show_default=True,
    help="Tokens decoded per measurement (llama-bench's -n).",
)
@click.option(
    "--depth",
    type=click.IntRange(1, None),
    default=None,
    help="Decode after this many cached tokens (default: after the prompt).",
)
@click.option(
    "-r",
    "--repeats",
    type=click.IntRange(1, None),
    default=3,
    show_default=True,
    help="Measurements of each phase; the best counts (llama-bench's -r).",
)
@click.option(
    "-f",
    "--prompt-file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Measure on this text's tokens instead of -p pseudo-random ones (for --speculative, whose drafts "
    "depend on the text).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Also profile three prefills of -p tokens and 16 decode steps: kernel time per operator type, and the "
    "executor's time between kernels, for each phase.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout (llama-bench-like fields).")
@runtime_options
def bench(model_dir: str, prompt_file, profile: bool, as_json: bool, **options) -> None:
    """Prefill and decode speed (tokens/s of the best of --repeats; min/median/max), peak RSS; with
    --speculative, decode with and without it and the share of drafts kept.

    MODEL: a converted folder, or a GGUF file (converted once with the defaults into a cache, then reused)."""
    from moepass.runtime import load
    from moepass.runtime.bench import measure, profile_phases
    from moepass.runtime.decoder import default_threads

    prompt_tokens, new_tokens, depth, repeats = (
        options.pop(k) for k in ("prompt_tokens", "new_tokens", "depth", "repeats")
    )
    if prompt_file is not None and depth is not None:
        raise click.UsageError("--depth applies to pseudo-random prompts; with --prompt-file decode follows the text")
    given, model_dir = model_dir, converted(model_dir, options)
    context = context_size(given, model_dir, options.pop("ctx_size"))
    load_options = load_settings(options)
    start = time.perf_counter()
    decoder = load(model_dir, **load_options)
    click.echo(f"loaded {model_dir} in {time.perf_counter() - start:.1f} s on {decoder.plan.provider}", err=True)
    echo_placement(decoder)
    run_within(decoder, context)
    prompt = None
    if prompt_file is not None:
        prompt = decoder.encode(prompt_file.read())
        if not prompt:
            raise MoepassError(f"{prompt_file.name}: the prompt file holds no text")
        prompt_tokens = len(prompt)
    _check_bench_fits(decoder, prompt_tokens, depth, new_tokens)
    result = measure(
        decoder,
        prompt_tokens,
        new_tokens,
        repeats,
        depth,
        progress=None if as_json else stderr,
        prompt=prompt,
    )
    result.update(
        model=str(model_dir),
        backend=decoder.plan.provider,
        threads=decoder.threads or default_threads(),
        activations=decoder.report.activations,
        size_bytes=sum(f.stat().st_size for f in decoder.model_dir.iterdir() if f.is_file())
        if decoder.model_dir.is_dir()
        else 0,
        n_params=sum(
            round(w["bytes"] * 8 / w["bits_per_weight"]) for w in decoder.report.weights if w.get("bits_per_weight")
        ),
    )
    used = str(decoder.threads) if decoder.threads else f"{default_threads()} (ONNX Runtime's default)"
    provider = decoder.plan.provider
    if profile:
        del load_options["speculative"], load_options["draft_tokens"]
        del decoder  # the profiling session loads the model again: not two copies of its weights at once
        gc.collect()
        phases = profile_phases(model_dir, prompt_tokens, depth=depth or prompt_tokens, **load_options)
        for phase, where in phases.items():
            result[f"{phase}_profile"] = where
            result[f"{phase}_operator_shares"] = where["operator_shares"]
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    for phase, what in (
        ("prefill", f"{prompt_tokens} tokens"),
        ("decode", f"{new_tokens} tokens after {result['decode']['depth']}"),
    ):
        r = result[phase]
        click.echo(
            f"{phase:<8} {r['tokens_per_s']:10.1f} tokens/s  ({what}; seconds min/median/max "
            f"{r['seconds_min']:.3f}/{r['seconds_median']:.3f}/{r['seconds_max']:.3f})"
        )
    if "speculative" in result:
        spec = result["speculative"]
        click.echo(
            f"plain    {spec['plain_decode']['tokens_per_s']:10.1f} tokens/s  (decode without "
            f"speculation: {spec['speedup']:.2f}x with it; {spec['acceptance']:.0%} of drafts kept, "
            f"{spec['tokens_per_step']:.2f} tokens per step)"
        )
    click.echo(
        f"peak RSS {result['peak_rss_bytes'] / 2**20:10.0f} MiB      ({provider}, "
        f"{used} threads, {result['activations']} activations)"
    )
    for phase, unit in (("prefill", f"a prefill of {prompt_tokens} tokens"), ("decode", "a decode step")):
        spent = result.get(f"{phase}_profile")
        if spent is None:
            continue
        click.echo(
            f"profile  {spent['step_ms']:10.2f} ms {unit} under the profiler: kernels "
            f"{spent['nodes_ms']:.2f} ms, the executor between them {spent['framework_ms']:.2f} ms"
        )
        for op, v in spent["operators"].items():
            if v["ms"] >= 0.01 * spent["nodes_ms"]:
                click.echo(
                    f"  {op:<36}{v['ms'] / spent['nodes_ms']:7.1%} of {phase} kernel time ({v['nodes']:.0f} nodes)"
                )


def _check_bench_fits(decoder, prompt_tokens: int, depth: int | None, new_tokens: int) -> None:
    """bench's measurements within the context (-c, else the model's): each generation takes its
    prompt (-p or --depth) and -n tokens, and one more chosen after the last step."""
    context, built = decoder.context_length, decoder.report.context_length
    cached = max(prompt_tokens, depth or 0)
    needed = cached + new_tokens + 1
    if context and needed > context:
        more = f"a larger -c (up to {built})" if built and context < built else f"convert --context {needed}"
        raise MoepassError(
            f"bench needs a context of {needed} tokens ({cached} cached, -n {new_tokens} and the token after "
            f"them); the context holds {context}: fewer tokens, or {more}"
        )
