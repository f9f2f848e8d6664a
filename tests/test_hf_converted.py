"""GGUFs made the way published ones are: a Hugging Face checkpoint (built by transformers at test
time: fixtures/hf_tiny.py, tiny, random, seeded) converted by llama.cpp's own convert_hf_to_gguf.py
at --outtype f32, bf16, f16 and q8_0, and the F32 file quantized by llama.cpp's quantizer to Q4_K_M
(without an importance matrix); each converted by moepass and compared with llama.cpp on the same
file, for every architecture moepass converts (Mixtral as the llama architecture; Granite MoE with
and without its shared expert; DeepSeek in the V2, V2-Lite and V3 forms).

The bounds are test_llama_oracle.py's (tests/support/oracle.py): F32, max |logit difference| <= 1e-4
for a prefill, a token-by-token decode through the KV cache and a prompt fed in two chunks, and so
F16 and BF16, whose values moepass keeps as float32, from llama.cpp on an F32 copy of them; every
other file held against the exact computation (check_against_exact): the converted model as close
to the exact computation of the weights it stores (llama.cpp on an F32 copy of the file with those
values: a Q4_K_M file's K-quant matrices, experts and token table are requantized to int8) as
llama.cpp is to that of the file's (on its F32 dequantization), the exact argmax where exact
arithmetic decides, positions where a router nearly ties left out.
Measured (AVX-512 CPU, 2 cores): F32 3e-7-1.2e-5; BF16 and F16 (kept as float) 9e-6 or less from
exact, against llama.cpp's 1e-4-0.07; Q8_0 and Q4_K_M 2-56 % of the bound. The whole file (11
checkpoints, 55 cases) runs in about a minute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import hf_tiny
from make_fixtures import rewrite_gguf
from moepass.convert import convert
from moepass.runtime import load
from support.oracle import (DISTANCE_FACTOR, F32_TOLERANCE, PROMPT, SPREAD_FLOOR, check_against_exact,
                            dequantized_copy, llama_cpp_module, llama_logits, llama_quantize, routing_near_ties,
                            three_ways)
from support.stored import stored_matrices

llama_cpp = llama_cpp_module()  # the whole module is the oracle: skipped without it

pytestmark = pytest.mark.llama

QUANTIZED = "Q4_K_M"  # llama.cpp's quantizer, from the converter's F32 file
FILE_TYPES = (*hf_tiny.OUTTYPES, QUANTIZED)
FLOAT_FILES = ("f32", "f16", "bf16")  # moepass keeps their values as float32: held to F32's bound
CASES = [(name, file_type) for name in hf_tiny.CHECKPOINTS for file_type in FILE_TYPES]


@pytest.fixture(scope="session")
def hf_gguf(tmp_path_factory):
    """hf_gguf(checkpoint, file_type) -> the GGUF of that checkpoint (hf_tiny.CHECKPOINTS): all the
    converter's types made by one converter process per checkpoint, once per session; a type the
    converter or the quantizer refuses is skipped with its reason."""
    root = tmp_path_factory.mktemp("hf-converted")
    made: dict[str, dict] = {}

    def get(name: str, file_type: str):
        if name not in made:
            checkpoint = hf_tiny.build_checkpoint(name, root / name / "checkpoint")
            made[name] = hf_tiny.convert(checkpoint, root / name)
        files = made[name]
        if file_type not in files:
            source = get(name, "f32")
            path = root / name / f"{file_type}.gguf"
            files[file_type] = path if llama_quantize(source, path, file_type, None) else \
                f"llama.cpp's quantizer refuses {file_type}"
        result = files[file_type]
        if isinstance(result, str):
            pytest.skip(f"{name} {file_type}: {result.strip().splitlines()[-1]}")
        return result

    return get


TEXTS = ["Hello world, this is the test 123!\n  spaces", " leading space", "éü 你好 🙂", "def f(x):\n    return x"]


@pytest.mark.parametrize("add_bos", ["as-converted", True, False])
@pytest.mark.parametrize("name", hf_tiny.CHECKPOINTS)
def test_text_prompts_are_llama_cpps_tokens(name, add_bos, hf_gguf, tmp_path):
    """A text prompt as run, chat, serve, profile and bench tokenize it: llama.cpp's tokens for the
    same file (llama_tokenize with add_special and parse_special, as llama-cli and llama-server),
    BOS included where the file says so: as the converter wrote it, and with add_bos_token set
    both ways."""
    from gguf import GGUFValueType as V
    from support.hostile import remake

    gguf = hf_gguf(name, "f32")
    if add_bos != "as-converted":
        gguf = remake(gguf, tmp_path / "flipped.gguf", set_kv={"tokenizer.ggml.add_bos_token": (add_bos, V.BOOL)})
    decoder = load(convert(gguf, tmp_path / "onnx", echo=lambda line: None).output_dir)
    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            assert decoder.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), (name, text)
    finally:
        llm.close()


def _corpus() -> list[str]:
    """Real text: the paragraphs of the project's README and usage guide (prose, numbers, code,
    tables, flags), and what those lack: emoji with joiners and modifiers, whitespace runs, scripts
    other than Latin, long numbers, control tokens among text."""
    paragraphs = []
    for doc in ("README.md", "docs/usage.md"):
        text = (Path(__file__).resolve().parents[1] / doc).read_text()
        paragraphs += [p for p in text.split("\n\n") if p.strip()][:40]
    return paragraphs + [
        "👩‍💻 🏳️‍🌈 👍🏽 🇯🇵 ❤️‍🔥 ✨✨✨",
        "a  b   c\t\td \n\n\n   e\r\nf \u00a0g",
        "   leading and trailing   ",
        "3.14159 1,000,000 12345678901234567890 0x1F -42 1e-5 2026-12-07",
        "日本語のテキストと中文文本, 한국어 텍스트, русский текст, العربية, ελληνικά",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n\tif x:\n\t\treturn {'a': [1, 2]}  # comment\n    else: pass\n",
        "don't I'll we've THEY'RE it's O'Neil's",
    ]


CORPUS = _corpus()


@pytest.mark.parametrize("pre", ["as-converted", "llama-bpe", "gpt-2"])
def test_a_corpus_is_tokenized_as_llama_cpp_does(pre, hf_gguf, tmp_path):
    """Every tokenizer family the converter writes for byte-level BPE, by its pre-tokenizer: the
    converter's own file (qwen2), and the same vocabulary under Llama-3's (llama-bpe) and GPT-2's
    pre-tokenizers, each against llama.cpp on the same file, text by text of a real corpus
    (SentencePiece: test_a_corpus_is_tokenized_as_llama_cpp_does_by_sentencepiece)."""
    from gguf import GGUFValueType as V
    from support.hostile import remake

    gguf = hf_gguf("qwen3moe", "f32")
    if pre != "as-converted":
        gguf = remake(gguf, tmp_path / f"{pre}.gguf", set_kv={"tokenizer.ggml.pre": (pre, V.STRING)})
    _same_tokens(gguf, tmp_path)


def test_a_corpus_is_tokenized_as_llama_cpp_does_by_sentencepiece(tmp_path):
    """SentencePiece with byte fallback (the fixture writer's llama vocabulary), against llama.cpp."""
    from make_fixtures import write_moe_gguf

    _same_tokens(write_moe_gguf(tmp_path / "spm.gguf", "f32", tokenizer="llama"), tmp_path)


def _same_tokens(gguf, tmp_path) -> None:
    decoder = load(convert(gguf, tmp_path / "onnx", echo=lambda line: None).output_dir)
    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        differ = [text for text in CORPUS
                  if decoder.encode(text) != llm.tokenize(text.encode(), add_bos=True, special=True)]
    finally:
        llm.close()
    assert not differ, f"{len(differ)} of {len(CORPUS)} texts tokenized otherwise than llama.cpp does: {differ[:3]}"


@pytest.mark.parametrize("name,file_type", CASES)
def test_converter_output_matches_llama_cpp(name, file_type, hf_gguf, tmp_path):
    gguf = hf_gguf(name, file_type)
    theirs = llama_logits(gguf, PROMPT)
    model = convert(gguf, tmp_path / "onnx", echo=lambda line: None).output_dir
    ways = three_ways(load(model))
    if file_type in FLOAT_FILES:  # kept as float: F32's bound, from llama.cpp on the file's own values in F32
        exact = theirs if file_type == "f32" else llama_logits(dequantized_copy(gguf, tmp_path / "f32.gguf"), PROMPT)
        for what, ours in ways.items():
            diff = float(np.abs(ours - exact).max())
            assert diff <= F32_TOLERANCE, f"{name} {file_type} {what}: max |logit diff| {diff}"
        print(f"{name} {file_type}: max |logit diff| {max(float(np.abs(o - exact).max()) for o in ways.values()):.2e}")
        return
    # what the file's weights compute, and what the weights the converted model stores compute (the
    # same where moepass keeps the file's values; else requantized experts or matrices)
    file_exact = llama_logits(dequantized_copy(gguf, tmp_path / "exact.gguf"), PROMPT)
    stored = {tensor: array for array, tensor in stored_matrices(model)}
    assert set(stored) <= {t.name for t in GGUFReader(str(gguf)).tensors}, "stored values under names the file lacks"
    stored_exact = llama_logits(rewrite_gguf(gguf, tmp_path / "stored.gguf", stored), PROMPT) if stored else file_exact
    ties = routing_near_ties(model, PROMPT)
    for what, ours in ways.items():
        check_against_exact(ours, stored_exact, theirs, f"{name} {file_type} {what}", ties, their_exact=file_exact)
    kept = ~ties
    ours = max(float(np.abs(o - stored_exact)[kept].max()) for o in ways.values())
    their = float(np.abs(theirs - file_exact)[kept].max())
    print(f"{name} {file_type}: max |logit - exact| {ours:.2e}, llama.cpp's {their:.2e}, "
          f"{ours / (DISTANCE_FACTOR * their + SPREAD_FLOOR * float(stored_exact.std())):.0%} of the bound")


def _next_token_kld(reference: np.ndarray, ours: np.ndarray) -> float:
    """Mean KL divergence of the next-token distributions (ours from the reference's)."""
    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p, q = log_softmax(reference.astype(np.float64)), log_softmax(ours.astype(np.float64))
    return float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))


@pytest.mark.parametrize("expert_format", ["auto", "qmoe"])
@pytest.mark.parametrize("target", ["layers", "offload"])
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "deepseek-v3"])
def test_real_q4_k_m_files_are_placed_on_the_gpu(name, target, expert_format, hf_gguf, tmp_path):
    """The headline on files llama.cpp's converter and quantizer made: `convert` (its default, moepass's
    own CPU kernels, and qmoe, ONNX Runtime's forms), then `partition
    --vram 8G` places every MoE layer (--target layers) or expert (--target offload) on the GPU, in
    a form the kernel table and the offload rules take (deepseek2's sigmoid router, which no CUDA
    kernel takes, on the CPU, said in plan.json), and the placed model, run on the CPU EP, computes
    what the unplaced one does as closely as convert's own float16 offload form of the file does."""
    from support.gpu_form import gpu_nodes_are_taken

    import moepass

    gguf = hf_gguf(name, QUANTIZED)
    model = convert(gguf, tmp_path / "onnx", expert_format=expert_format, echo=lambda line: None).output_dir
    half = convert(gguf, tmp_path / "half", expert_format="offload", echo=lambda line: None).output_dir
    placed = moepass.partition(model, tmp_path / "placed", "8G", target=target, calibrate=False)
    assert placed.plan.active and placed.warnings == [], placed.warnings
    nodes = placed.plan.nodes
    assert all(n.device == "gpu" for n in nodes) if target == "layers" else all(n.resident_count == n.experts
                                                                                 for n in nodes)
    gpu_nodes_are_taken(placed.output_dir, target)
    if name.startswith("deepseek"):
        assert any("MoEGroupRouter" in why for why in placed.plan.lowering.cpu_nodes.values())
    reference, ours, theirs = (three_ways(load(m))["prefill"] for m in (model, placed.output_dir, half))
    # positions where a router nearly ties left out (float16 rounding may pick the other expert there:
    # DeepSeek-V3's file differs by 1.7 at one such position, by 0.14 at most elsewhere), as
    # check_against_exact leaves them out
    kept = ~routing_near_ties(model, PROMPT)
    assert kept.sum() >= (len(kept) + 1) // 2, f"{name}: too few positions without a router near-tie"
    error, their_error = (float(np.abs(logits - reference)[kept].max()) for logits in (ours, theirs))
    assert error <= 1.5 * their_error + 1e-6, (error, their_error)
    print(f"{name} {target} {expert_format}: max |logit diff| {error:.2e} (offload conversion {their_error:.2e}), "
          f"mean KLD from the unplaced model {_next_token_kld(reference, ours):.2e}")
