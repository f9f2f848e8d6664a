"""Options declared once, for the CLI and the Python API alike: each record names the Python keyword
(a field of the command's options dataclass), the command line's spellings, the default, the values
it takes and the help text. The CLI makes its click options from the records
(moepass.cli.common.declared), the options dataclasses take their defaults from them, and
tests/test_options.py holds each dataclass to its records and each command to its options.

Only facts live here (no click, nothing heavier than the option tables), so `moepass --help`
reads them without importing the compiler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moepass.core.choices import (
    ACTIVATION_MODES,
    DEFAULT_DRAFT_TOKENS,
    EXPERT_FORMATS,
    FLOAT_EXPERT_CHOICES,
    KV_CACHE_TYPES,
    MAX_CONTEXT,
    PLAN_MODES,
    PLUGIN_ENV,
    POLICIES,
    PRINT_AFTER_CHOICES,
    TARGETS,
)


@dataclasses.dataclass(frozen=True)
class Option:
    """One option. `kind`: "text", "int" (within `low`..`high`), "path" (a file), "switch" (a flag
    without a value: True where given, else False) or "off" (a flag that turns the keyword off:
    `--no-calibrate` gives calibrate=False, else True); `choices`: the values it takes; `shown`: the
    default as the help states it where the value alone would not say it (None: the value)."""

    name: str
    flags: tuple[str, ...]
    help: str
    default: Any = None
    kind: str = "text"
    choices: tuple[str, ...] | None = None
    low: int | None = None
    high: int | None = None
    shown: str | None = None
    metavar: str | None = None


def option_table(options: tuple[Option, ...]) -> dict[str, Option]:
    """The options by name (their Python keyword)."""
    return {o.name: o for o in options}


CONVERT_OPTIONS = option_table(
    (
        Option(
            "float_experts",
            ("--float-experts",),
            "F32/F16/BF16 experts: keep as float (com.microsoft::MoE) or quantize into QMoE.",
            "keep",
            choices=FLOAT_EXPERT_CHOICES,
        ),
        Option(
            "expert_format",
            ("--expert-format",),
            "auto: on the CPU, moepass's own kernels over the GGUF's own blocks (moepass::MoEPacked, "
            "MatMulPacked, GatherPacked: llama.cpp's arithmetic, the file's size) for every type they take "
            "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS, MXFP4), the rest as qmoe; qmoe where the "
            "kernels cannot run here or with --activations float. "
            "qmoe: ONNX Runtime's own QMoE and MatMulNBits, which any ONNX Runtime runs: the exact form when "
            "the blocks move bit-exactly (Q4_0, Q8_0, IQ4_XS, MXFP4, ...), else 8 bits at the largest block "
            "(keeps llama.cpp's fidelity); int4: 4 bits (half the bytes, more error), int8: 8 bits; offload: "
            "what ONNX Runtime's expert offload takes (int4 block 32 prepacked, float16 graph); packed: the "
            "GGUF's own blocks in MoEPacked nodes (CUDA only: no CPU kernel of ONNX Runtime's runs them); "
            "native: moepass's own kernels for every layer, refused where a type has none.",
            "auto",
            choices=EXPERT_FORMATS,
        ),
        Option(
            "exact",
            ("--exact",),
            "Keep the exact form of every tensor whose blocks move bit-exactly, even where a requantized form "
            "is faster (Q6_K: int8 block 16 instead of block 128).",
            False,
            kind="switch",
        ),
        Option(
            "activations",
            ("--activations",),
            "int8: quantized to 8 bits inside each quantized matmul, as llama.cpp does (ONNX Runtime "
            "accuracy_level 4; fast). float: exact float arithmetic on the weights (slower; for tests).",
            "int8",
            choices=tuple(ACTIVATION_MODES),
        ),
        Option(
            "imatrix",
            ("--imatrix",),
            "llama.cpp importance matrix (GGUF or .dat): weighs requantization errors per input column.",
            kind="path",
        ),
        Option(
            "context",
            ("-c", "--context"),
            "Positions (tokens) the model is built for: its RoPE tables.",
            kind="int",
            low=1,
            high=MAX_CONTEXT,
            shown="the GGUF's context_length",
        ),
        Option(
            "allow_non_finite",
            ("--allow-non-finite",),
            "Convert tensors holding NaN or Inf (refused by default: the model would compute NaN logits).",
            False,
            kind="switch",
        ),
        Option(
            "print_after",
            ("--print-after",),
            "Print the graph after this step (GGUF: lower, then its passes; ONNX: read, fuse-moe, ...).",
            choices=PRINT_AFTER_CHOICES,
        ),
        Option(
            "genai_speculative",
            ("--genai-speculative",),
            "Write speculative decoding into genai_config.json for onnxruntime-genai (PATH: the draft model's "
            "converted folder); moepass run/chat/serve take --speculative when they run.",
            shown="off",
            metavar="ngram|draft:PATH",
        ),
        Option(
            "draft_tokens",
            ("--draft-tokens",),
            "With --genai-speculative: draft tokens per step.",
            DEFAULT_DRAFT_TOKENS,
            kind="int",
            low=1,
            high=16,
        ),
        Option(
            "kv_cache",
            ("--kv-cache",),
            "The KV cache's type: float16 halves it, int8 quarters it (per-channel scales calibrated on the "
            "model's own keys and values).",
            "float32",
            choices=tuple(KV_CACHE_TYPES),
        ),
        Option(
            "kv_calibration",
            ("--kv-calibration",),
            "With --kv-cache int8: text to calibrate the scales on.",
            kind="path",
            shown="the model's own sampled text",
        ),
    )
)


# partition's options but its budget (--vram, or a --gpu card's) and bandwidths (from the flags, the
# card's data sheet or the defaults: moepass.cli.partition composes them into one Bandwidths)
PARTITION_OPTIONS = option_table(
    (
        Option(
            "target",
            ("--target",),
            "offload: per expert, for the ONNX Runtime CUDA plugin EP's expert offload; layers: whole MoE layers "
            "on the GPU or the CPU, through layer annotations the CUDA EP of a pip-installed onnxruntime-gpu "
            "follows (like llama.cpp's --n-cpu-moe); auto: offload when the model is eligible and a CUDA plugin "
            "EP is named, else layers.",
            "auto",
            choices=TARGETS,
        ),
        Option(
            "cuda_plugin",
            ("--cuda-plugin",),
            f"The CUDA plugin EP library the model will run with (default: ${PLUGIN_ENV}); for --target auto.",
            kind="path",
        ),
        Option(
            "profile",
            ("--profile",),
            "Popularity file from `moepass profile` (without one, placement is uniform).",
            kind="path",
        ),
        Option(
            "policy",
            ("--policy",),
            "global (default with a profile), balanced, or uniform (default without).",
            choices=POLICIES,
        ),
        Option(
            "mode",
            ("--mode",),
            "required: fail when the non-expert weights, KV cache and buffers do not fit.",
            "auto",
            choices=PLAN_MODES,
        ),
        Option(
            "context",
            ("-c", "--context"),
            "Tokens the KV cache holds (default: the model's context, at most 4096; the summary says which).",
            kind="int",
            low=1,
        ),
        Option("batch", ("--batch",), "Sequences at once.", 1, kind="int", low=1),
        Option(
            "prefill_tokens",
            ("--prefill-tokens",),
            "Tokens per prefill step (sizes the working buffers).",
            512,
            kind="int",
            low=1,
        ),
        Option("reserve", ("--reserve",), "GPU memory kept for the runtime itself.", "512MiB"),
        Option(
            "report",
            ("--report",),
            "Also draw the plan (heatmap and memory bar) into this PNG file.",
            kind="path",
        ),
        Option(
            "cpu_profile",
            ("--cpu-profile",),
            "Take the CPU side of the estimate from an earlier plan.json instead of timing it now.",
            kind="path",
        ),
        Option(
            "calibrate",
            ("--no-calibrate",),
            "No timing on this CPU: the bandwidth model alone.",
            True,
            kind="off",
        ),
        Option(
            "kernel_table",
            ("--ignore-kernel-table",),
            "Plan as if the CUDA EP took every node (for an ONNX Runtime build newer than moepass's table of "
            "its kernels); by default MoE layers it has no kernel for stay on the CPU.",
            True,
            kind="off",
        ),
        Option(
            "kv_cache",
            ("--kv-cache",),
            "The KV cache's type in the placed model: the model's, another (from float32), or auto: float16 "
            "where its smaller cache buys resident experts (plan.json says what each type would buy).",
            "keep",
            choices=("keep", "auto", *KV_CACHE_TYPES),
        ),
        Option(
            "lower",
            ("--keep-form",),
            "Annotate (or reorder) the model as it is instead of writing its GPU form: its float32 nodes, which "
            "no CUDA kernel takes, then stay on the CPU whatever the plan.",
            True,
            kind="off",
        ),
        Option(
            "gguf",
            ("--gguf",),
            "The GGUF the model was converted from, where it is now (its GPU form is packed from the file's "
            "blocks); default: where its moepass.json records it.",
            kind="path",
        ),
    )
)
