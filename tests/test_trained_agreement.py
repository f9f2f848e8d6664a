"""Trained models, quantized by llama.cpp's own quantizer and converted with the default (moepass's own
CPU kernels over the GGUF's blocks) and into ONNX Runtime's own forms (`--expert-format qmoe`; int8
activations both), keep llama.cpp's fidelity to the unquantized model, by the measure llama.cpp users
judge quantizations with (`llama-perplexity --kl-divergence`): on held-out token windows, the mean
KL divergence of the next-token distribution from the F32 model's is at most RATIO_BOUND times
llama.cpp's on the same file, the whole 90 % bootstrap interval of the ratio (over windows) at or
below it, and the F32 model's most likely token comes first at least as often as in llama.cpp's
run, less TOP_MARGIN.

Two models made differently (tests/conftest.py): "markov", fixtures/train_fixture.py (a qwen3moe
trained on a synthetic Markov language, written by moepass's fixture writer) and "text",
fixtures/hf_fixture.py (a Hugging Face Qwen3-MoE of other shapes trained on English prose, written
by llama.cpp's own convert_hf_to_gguf.py). Both are the same bytes on every x86-64 CPU (the digest
tests below), so what differs between an AVX2 and an AVX-512 machine is the kernels only.

The bound rests on these measurements (benchmarks/agreement.py, 2026-12-01, after the conversion
speed-up: the same bytes): mean KLD ratio to llama.cpp's on the same file, with AVX-512 kernels (a
Xeon natively) / AVX2 kernels (the same Xeon with AVX-512 hidden, as an AMD EPYC:
tests/cpu_family.py):

    file type   markov          text            default form
    Q4_K_M      0.964 / 0.964   1.014 / 1.014   int8/b128
    Q5_K_M      0.820 / 0.820   1.046 / 1.045   int8/b32
    Q6_K        0.839 / 0.839   0.992 / 0.990   int8/b128
    Q4_0        0.998 / 0.998   1.001 / 1.001   int4/b32 (exact)
    Q8_0        0.984 / 0.985   1.002 / 1.003   int8/b32 (exact)
    IQ4_XS      0.865 / 0.864   1.001 / 1.001   int8/b32 (exact)
    MXFP4_MOE   1.005 / 1.004   1.001 / 1.000   int8/b32 (exact)
    Q2_K        1.003 / 1.003   1.001 / 1.002   int8/b128
    IQ2_XXS     1.021 / 1.021   1.028 / 1.028   int4/b32
    IQ1_S       0.985 / 0.985   1.003 / 1.003   int4/b32

The default (2026-12-07, an EPYC Zen 4, AVX-512): 0.999-1.001x on both models for Q4_K_M, Q5_K_M,
Q6_K, Q4_0, Q8_0, IQ4_XS, MXFP4_MOE and Q2_K (every interval within [0.997, 1.003]): it computes
what llama.cpp does, the embedding's rows too (moepass::GatherPacked), so NATIVE_BOUND is 1.02; IQ2_XXS
and IQ1_S, whose experts it gives the qmoe forms, 1.015-1.018x.

The kernel families move no ratio by more than 0.002 (an earlier run of the same kind saw up to
0.031); the largest, 1.046, leaves RATIO_BOUND 1.1 room for that and
for the 90 % bootstrap intervals (at most 1.12 above, for text Q5_K_M). Same top: at most 0.4
points below llama.cpp's (text Q4_K_M: 8 of 2,032 positions), where TOP_MARGIN allows 0.5.

A 2-core AMD EPYC with AVX-512 (2026-12-01) trains both fixtures into other bytes than the Xeon
does, whatever the kernel pins (ATen's capability, MKL_CBWR, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA: each tried, the same other bytes; the operator that differs is not found).
On its fixtures markov Q6_K measured 1.404x [90 %: 0.975, 1.995] over the first 8 windows (the
markov model's KLD is ~3e-5, carried by a few windows), and text Q4_0's same top 0.54 points below
llama.cpp's (12 positions only llama.cpp's run ranks first against 1 only ours does, of 2,032;
Q4_0's weights move bit-exactly, the difference is the int8 activations' rounding and the Q6_K
output matrix requantized to int8 block 128: block 32 leaves 9 against 1, the exact block 16 4
against 1).

So the ratio's bound holds on its upper interval, with as many windows as it takes to decide:
where the first windows leave the interval across RATIO_BOUND, the test takes twice the windows
(the markov sampler's next ones, the held-out text read further), up to MAX_WINDOWS, and fails
above it; where even MAX_WINDOWS leave it across, the ratio over all of them (8,128 positions)
decides. On a 2-core AMD EPYC (AVX2, 2026-12-06, the EPYC fixtures): markov Q6_K decides at 64
windows, 1.000x [0.953, 1.060]; markov Q4_K_M at 16, 1.030x [0.993, 1.064]; the other markov types
at 8 (the largest, Q2_K 1.035x [1.000, 1.052]); every text type at 16 (the largest, IQ2_XXS 1.020x
[1.010, 1.031]) but Q6_K, undecided at 64: 1.073x [1.024, 1.130] (its default form is int8 block
128, requantized; `--exact` keeps the file's own blocks). A same-top shortfall fails only beyond
TOP_MARGIN plus twice the standard deviation of the positions one side ranks first and the other
not (sqrt of their count, were both sides equally good).
"""

from __future__ import annotations

import hashlib
import math
import sys

import pytest

from moepass.convert import convert
from support.oracle import (kld_ratio, llama_quantize, llama_window_logits, moepass_window_logits,
                            next_token_quality, top_disagreements)

pytestmark = pytest.mark.llama

FILE_TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0", "IQ4_XS", "MXFP4_MOE", "Q2_K", "IQ2_XXS", "IQ1_S"]
RATIO_BOUND, TOP_MARGIN = 1.1, 0.005
# the default on the CPU (auto: moepass's own kernels, the GGUF's own blocks, the embedding's rows as ggml
# dequantizes them) computes what llama.cpp does: issue 67's bound, where every tensor has a kernel
NATIVE_BOUND = 1.02
QMOE_IN_THE_DEFAULT = ("IQ2_XXS", "IQ1_S")  # no kernel for their experts: the qmoe forms, RATIO_BOUND
MAX_WINDOWS = {"markov": 64, "text": 64}  # where an undecided interval stops growing (and fails)
# sha256 of the trained fixtures (the markov one at train_fixture.STEPS); the text one is of this
# Python's documentation topics, so it is held only on the version it was measured with
# the fixtures' bytes where the bounds were measured: the Xeon's, then the AMD EPYC's (see above)
MARKOV_DIGESTS = ("32af4933399f6b8473724f7c7ab55ec3b4379ddcc4afddc558bf85af1e899def",
                  "57199d0a8393a4c89b1acde066e4cfdf68f2bb74672580c67415459764030fd9")
TEXT_DIGESTS = {(3, 11): ("a32338ed50c14ff0d9744562e23d9392dbc26f561861eb8cbf79525f0a5b00b1",
                          "2b3cf5bc191e11554cc56f0c303678f8da612a524a5c5ffebe5d9cc2252860ec")}


class Windows:
    """A trained model's held-out windows and llama.cpp's logits of its F32 model on them, the first
    `count` of as many as a test asks for (each set a prefix of the next: the same sampler, or the
    held-out text read further)."""

    def __init__(self, model: str, source, first: list[list[int]]):
        self.model, self.source, self.ids = model, source, list(first)
        self.reference = llama_window_logits(source, self.ids)

    def upto(self, count: int) -> list[list[int]]:
        if count > len(self.ids):
            if self.model == "markov":
                import train_fixture

                more = train_fixture.heldout_windows(count)
            else:
                import hf_fixture

                more = hf_fixture.heldout_ids(self.source.parent / "checkpoint", count)
            assert more[: len(self.ids)] == self.ids, "held-out windows are not a prefix of more of them"
            self.reference += llama_window_logits(self.source, more[len(self.ids):])
            self.ids = more
        return self.ids[:count]


@pytest.fixture(scope="module")
def windows(trained_models):
    """name -> its Windows."""
    return {name: Windows(name, source, first) for name, (source, _, first) in trained_models.items()}


@pytest.mark.parametrize("expert_format", ["qmoe", "auto"])
@pytest.mark.parametrize("model", ["markov", "text"])
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_trained_model_keeps_llama_cpps_fidelity(file_type, model, expert_format, trained_models, windows, tmp_path):
    """The mean KLD ratio's 90 % interval lies at or below the bound (RATIO_BOUND; NATIVE_BOUND for
    the default's own kernels, where every tensor of the file has one): where the first windows leave
    it undecided (its high end above, its low end not), twice the windows, up to MAX_WINDOWS; above it
    fails, and still undecided there the ratio over all of them decides."""
    bound = NATIVE_BOUND if expert_format == "auto" and file_type not in QMOE_IN_THE_DEFAULT else RATIO_BOUND
    source, imatrix, first = trained_models[model]
    path = tmp_path / f"{file_type}.gguf"
    assert llama_quantize(source, path, file_type, imatrix), f"llama.cpp refused {file_type}"
    onnx = convert(path, tmp_path / "onnx", expert_format=expert_format, echo=lambda line: None).output_dir
    held_out = windows[model]
    ids, theirs, ours = [], [], []
    count = len(first)
    while True:
        new = held_out.upto(count)[len(ids):]
        theirs += llama_window_logits(path, new)
        ours += moepass_window_logits(onnx, new)
        ids += new
        reference = held_out.reference[: len(ids)]
        ratio, low, high = kld_ratio(reference, ours, theirs)
        if high <= bound or low > bound or count >= MAX_WINDOWS[model]:
            break
        count = min(2 * count, MAX_WINDOWS[model])
    our_quality, their_quality = (next_token_quality(reference, logits, ids) for logits in (ours, theirs))
    print(f"{model} {file_type} {expert_format}: mean KLD {ratio:.3f}x llama.cpp's [90 %: {low:.3f}, {high:.3f}] "
          f"over {len(ids)} windows")
    # decided: the interval at or below the bound; undecided at MAX_WINDOWS: the point estimate over
    # all of them (8,128 positions) against it
    decided = high <= bound or (low <= bound and count >= MAX_WINDOWS[model] and ratio <= bound)
    assert decided, (
        f"{model} {file_type}: mean KLD {ratio:.3f}x llama.cpp's [90 %: {low:.3f}, {high:.3f}] over {len(ids)} "
        f"windows; ours {our_quality}, llama.cpp's {their_quality}")
    only_ours, only_theirs = top_disagreements(reference, ours, theirs)
    noise = 2 * math.sqrt(only_ours + only_theirs) / our_quality.positions
    assert our_quality.top1 >= their_quality.top1 - TOP_MARGIN - noise, (
        f"{model} {file_type}: same top {our_quality.top1:.1%} against llama.cpp's {their_quality.top1:.1%} "
        f"({only_theirs} positions only llama.cpp ranks first, {only_ours} only ours)")
    print(f"{model} {file_type}: {ratio:.3f}x [{low:.3f}, {high:.3f}] over {len(ids)} windows")


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_trained_fixtures_are_the_same_on_every_cpu(trained_models):
    """The fixtures the bounds above were measured on: training pins torch's and MKL's kernels
    (fixtures/train_fixture.py); the Xeon and the AMD EPYC above still train other bytes, both
    measured. A CPU that trains a third kind fails here: measure the bounds on it."""
    assert _digest(trained_models["markov"][0]) in MARKOV_DIGESTS, "the markov fixture is not a measured one"
    expected = TEXT_DIGESTS.get(sys.version_info[:2])
    if expected is None:
        pytest.skip(f"the text fixture was measured on Python {', '.join('.'.join(map(str, v)) for v in TEXT_DIGESTS)}")
    assert _digest(trained_models["text"][0]) in expected, "the text fixture is not a measured one"


# The GPU form (partition's lowering of the default conversion, every layer on the GPU, run here on the
# CPU EP, which runs its float16 graph and its forms), beside llama.cpp (the oracle, not moepass's own
# conversion). Measured (markov / text, 2026-12-07, this EPYC, first windows), mean KLD ratio to
# llama.cpp's on the same file:
#
#     target   Q4_K_M          Q4_0            Q8_0
#     layers   1.133 / 0.989   0.987 / 1.007   1.154 / 0.980   the file's blocks, float16 activations
#     offload  1.507 / 1.027   0.983 / 1.007   10.28 / 4.521   int4 block 32: the plugin's one form
#
# --target layers keeps each type's codes and computes in float16, whose rounding adds to the file's
# own error (most where that is least: Q8_0's is 5.5e-6): FLOAT16_BOUND. --target offload requantizes
# every expert to int4 block 32 (OFFLOAD_FORM: the only form the CUDA plugin EP's expert offload
# takes): its error is an int4 quantization's, so the oracle's own int4 quantization of the same
# model, llama.cpp's Q4_0, bounds it (INT4_BOUND times the larger of that KLD and the file's own; the
# Q8_0 file's 5.7e-5 and 8.4e-5 against Q4_0's 2.1e-4 and 1.1e-3).
GPU_FORM_FILES = ["Q4_K_M", "Q8_0"]
FLOAT16_BOUND, INT4_BOUND = 1.3, 1.1


@pytest.fixture(scope="module")
def llama_q4_0_kld(trained_models, windows, tmp_path_factory):
    """The markov model's mean KLD as llama.cpp's Q4_0 (int4 block 32) file of it computes."""
    source, imatrix, first = trained_models["markov"]
    path = tmp_path_factory.mktemp("q4_0") / "Q4_0.gguf"
    assert llama_quantize(source, path, "Q4_0", imatrix)
    ids = windows["markov"].upto(len(first))
    return next_token_quality(windows["markov"].reference[: len(ids)], llama_window_logits(path, ids), ids).mean_kld


@pytest.mark.parametrize("target", ["layers", "offload"])
@pytest.mark.parametrize("file_type", GPU_FORM_FILES)
def test_the_gpu_form_beside_llama_cpp(file_type, target, trained_models, windows, llama_q4_0_kld, tmp_path):
    """Every layer placed on the GPU (`partition --vram 8G`): the placed model's mean KLD from the F32
    model within FLOAT16_BOUND times llama.cpp's on the same file (layers), or INT4_BOUND times the
    larger of that and llama.cpp's Q4_0 file's (offload), and the same top as often less TOP_MARGIN."""
    from moepass.partition import partition

    source, imatrix, first = trained_models["markov"]
    path = tmp_path / f"{file_type}.gguf"
    assert llama_quantize(source, path, file_type, imatrix), f"llama.cpp refused {file_type}"
    onnx = convert(path, tmp_path / "onnx", echo=lambda line: None).output_dir
    placed = partition(onnx, tmp_path / "placed", "8G", target=target, calibrate=False)
    assert placed.plan.active and all(n.device == "gpu" for n in placed.plan.nodes if target == "layers")
    ids = windows["markov"].upto(len(first))
    reference = windows["markov"].reference[: len(ids)]
    ours = next_token_quality(reference, moepass_window_logits(placed.output_dir, ids), ids)
    theirs = next_token_quality(reference, llama_window_logits(path, ids), ids)
    print(f"the GPU form, {target}, {file_type}: ours {ours}; llama.cpp's {theirs}; its Q4_0 {llama_q4_0_kld:.3e}")
    if target == "layers":
        assert ours.mean_kld <= FLOAT16_BOUND * theirs.mean_kld, (ours, theirs)
    else:
        assert ours.mean_kld <= INT4_BOUND * max(theirs.mean_kld, llama_q4_0_kld), (ours, theirs, llama_q4_0_kld)
    assert ours.top1 >= theirs.top1 - TOP_MARGIN, (ours, theirs)
