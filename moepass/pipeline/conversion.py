"""The GGUF conversion: a GGUF file read and lowered into an ONNX decoder whose weights are not yet
written (`lower_gguf_file`: read, moepass.passes.lower, the passes of PIPELINES["gguf"]), then its
folder written (`write_gguf_conversion`: model.onnx + model.onnx.data, weights streamed tensor by
tensor; moepass.json with the hyperparameters, MoE layers and the per-tensor report; the tokenizer,
the KV cache as asked, genai_config.json). convert runs both (`convert_gguf`), as the GGUF cache
does; partition lowers the model further for the GPU between the two.

The files depend only on the input and the options: converting twice, from anywhere, gives
identical bytes (the GGUF's path is recorded relative to the output folder).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import onnx_ir as ir

from moepass.core.architectures import Architecture, architecture_of
from moepass.core.capabilities import offload_violations
from moepass.core.choices import (
    ACTIVATION_MODES,
    KV_CACHE_TYPES,
    format_bytes,
    format_rate,
    one_of,
    with_settings,
)
from moepass.core.errors import MoepassError, wording
from moepass.core.files import (
    GENAI_CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    read_text,
    relative_to_folder,
)
from moepass.core.formats import write_report
from moepass.core.gguf_reader import GGUFModel
from moepass.core.imatrix import load_imatrix
from moepass.core.model_io import save_model
from moepass.core.options import CONVERT_OPTIONS
from moepass.core.quants import parse_form, speed_class
from moepass.passes import PipelineRun, run_pipeline
from moepass.passes.lower import Lowered, LowerOptions, lower_gguf
from moepass.passes.weights.report import WeightReport, merged_records
from moepass.pipeline.atomic import atomic_directory, check_destination
from moepass.pipeline.genai import check_speculation, genai_config, with_speculation
from moepass.pipeline.kv_precision import cache_type_of, describe_cache, kv_bytes_per_position, set_kv_cache
from moepass.pipeline.tokenizer import TokenizerFiles, tokenizer_from_gguf
from moepass.runtime.providers import native_kernels_unavailable

ProgressFn = Callable[[int, int], None]  # (bytes written, total bytes)
# positions from which the summary points a float32 KV cache to int8 (docs/benchmarks.md: at 8,192
# positions int8 decoded 1.13-1.48x float32's speed, at 32,768 1.51x)
LONG_CONTEXT = 8192
ACTIVATION_SUMMARY = {
    "int8": "int8 inside quantized matmuls (ONNX Runtime accuracy_level 4, as llama.cpp): fast; {float} for exact "
    "arithmetic",
    "float": "float (exact arithmetic on the weights; several times slower than int8 on the CPU)",
}


@dataclasses.dataclass
class ConvertResult:
    """What a conversion produced; `summary_lines()` is what the CLI prints."""

    output_dir: Path
    source: Path
    architecture: str
    n_layers: int
    moe_layers: list[dict[str, Any]]
    bytes_by_target: dict[str, int]
    weights: list[dict[str, Any]]
    source_bytes: int
    output_bytes: int
    seconds: float
    tokenizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    offload: str = ""  # whether ONNX Runtime's expert offload can take the model, and if not, why
    fusion: list[dict[str, Any]] | None = None  # ONNX input: what happened to each candidate MoE layer
    existing_moe: int = 0  # ONNX input: com.microsoft QMoE/MoE nodes it had already (kept as they are)
    activations: str = "int8"  # inside quantized matrix products: "int8" (as llama.cpp) or "float" (exact)
    kv_cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # its type, and for int8 the calibration
    kv_bytes_per_position: int = 0  # one sequence, every layer's keys and values, in the cache's type
    context_length: int | None = None  # positions the model is built for

    @property
    def model_path(self) -> Path:
        return self.output_dir / MODEL_FILE

    @property
    def n_exact(self) -> int:
        return sum(all(w["exact"]) for w in self.weights)

    @property
    def max_rel_rms_error(self) -> float:
        return max((e for w in self.weights for e in w["rel_rms_error"]), default=0.0)

    def quality_table(self) -> list[str]:
        """Weights grouped by source type and target form: tensors, bits per weight, exact or the error."""
        groups: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
        for w in self.weights:
            groups[("+".join(sorted(set(w["source_types"]))), w["target"])].append(w)
        width = max([12] + [len(source) + 2 for source, _ in groups])
        target_width = max([10] + [len(target) + 2 for _, target in groups])
        rows = [f"{'source':<{width}}{'target':<{target_width}}{'tensors':>8}{'bits/w':>8}  rel. RMS error"]
        for (source, target), members in sorted(groups.items()):
            bpw = sum(m["bits_per_weight"] * m["bytes"] for m in members) / sum(m["bytes"] for m in members)
            errors = [e for m in members for e in m["rel_rms_error"]]
            error = "exact" if all(all(m["exact"]) for m in members) else f"max {max(errors):.4f}"
            rows.append(f"{source:<{width}}{target:<{target_width}}{len(members):>8}{bpw:>8.2f}  {error}")
        return rows

    def summary_lines(self) -> list[str]:
        words = wording()
        experts = self.moe_layers[0]["experts"] if self.moe_layers else 0
        top_k = self.moe_layers[0]["top_k"] if self.moe_layers else 0
        forms = collections.Counter(m["form"] for m in self.moe_layers)
        lines = [f"converted {self.source.name} ({self.architecture}) -> {self.output_dir}"]
        if self.fusion is not None:
            fused = [f for f in self.fusion if f["fused"]]
            already = (
                f"; {self.existing_moe} QMoE/MoE nodes were there already, kept as they are"
                if self.existing_moe
                else ""
            )
            lines.append(
                f"  MoE layers    {len(fused)} of {len(self.fusion)} candidates fused "
                f"({experts} experts, top-{top_k}){already}"
                if self.fusion
                else f"  MoE layers    none to fuse{already}"
                if already
                else "  MoE layers    none found: the model is written unchanged"
            )
            lines.extend(
                f"    {f['anchor']}: -> {f['node']} ({f['form']})" if f["fused"] else f"    not fused: {f['reason']}"
                for f in self.fusion
            )
        else:
            moe = len(self.moe_layers)
            lines.append(f"  layers        {self.n_layers} ({moe} MoE, {experts} experts, top-{top_k})")
        lines += [
            "  expert form   "
            + (
                ", ".join(
                    f"{form} in {n} layer{'s' if n > 1 else ''}"
                    + (f" ({speed_class(block)})" if (block := parse_form(form)) else "")
                    for form, n in sorted(forms.items())
                )
                or "none"
            ),
            "  activations   "
            + ACTIVATION_SUMMARY[self.activations].format(float=words.option("--activations", "float")),
            f"  bytes         {self.source_bytes:,} in, {self.output_bytes:,} out",
        ]
        requantized8 = any(
            w["target"].startswith("int8") and not any(w["exact"])
            for w in self.weights
            if ".ffn_experts." in w["onnx_name"]
        )
        if self.fusion is None and requantized8 and self.output_bytes > 1.25 * self.source_bytes:
            ratio = self.output_bytes / self.source_bytes
            lines.append(
                f"    {ratio:.2f}x the GGUF: experts requantized into 8 bits keep llama.cpp's fidelity; "
                f"{words.option('--expert-format', 'int4')} is about the GGUF's size, with more error "
                "(docs/benchmarks.md)"
            )
        memory = physical_memory()
        if memory and self.output_bytes > memory:
            lines.append(
                f"    more than this machine's memory ({format_bytes(memory)}): run here, a decode step reads "
                "experts from the disk"
                + (f"; {words.option('--expert-format', 'int4')} is about the GGUF's size" if requantized8 else "")
            )
        for target, nbytes in sorted(self.bytes_by_target.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {target:<18}{nbytes:>16,} bytes")
        inexact = len(self.weights) - self.n_exact
        lines.append(
            f"  weights       {self.n_exact} exact, {inexact} requantized"
            + (f" (max rel. RMS error {self.max_rel_rms_error:.4f})" if inexact else "")
        )
        lines.extend("    " + row for row in self.quality_table())
        lines.append(f"  offload       {self.offload}")
        kind = self.kv_cache.get("type")
        if kind is not None:
            line = f"  KV cache      {describe_cache(kind, self.kv_bytes_per_position, self.context_length)}"
            if "calibration" in self.kv_cache:
                line += f"; per-channel scales from {self.kv_cache['calibration']}"
            lines.append(line)
            if kind == "float32" and (self.context_length or 0) >= LONG_CONTEXT:
                lines.append(
                    f"    {words.option('--kv-cache', 'int8')} holds a quarter of that and decodes up to 1.5x "
                    "faster at 8k-32k positions on the CPU, adding a mean KLD of about 1e-5 or less on two "
                    "trained models, where Q4_K_M's weights add 1e-4 to 1e-3 (docs/benchmarks.md)"
                )
        if self.fusion is not None:
            pass  # an ONNX model carries no tokenizer of its own
        elif self.tokenizer.get("reason"):
            lines.append(f"  tokenizer     none written: {self.tokenizer['reason']} (token ids only)")
        else:
            pre = f", {self.tokenizer['pre']} pre-tokenizer" if self.tokenizer.get("pre") else ""
            lines.append(f"  tokenizer     {self.tokenizer.get('model')}{pre} -> {TOKENIZER_FILE}")
        rate = self.source_bytes / self.seconds if self.seconds else 0.0
        lines.append(f"  time          {self.seconds:.2f} s ({format_rate(rate)} of input)")
        return lines


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """How convert lowers and writes: the Python API's keywords and, under the same names, the CLI's
    flags.

    float_experts: "keep" (F32/F16/BF16 experts stay float, com.microsoft::MoE), "int8" or "int4"
        (quantized into QMoE).
    expert_format: "auto" (moepass's own CPU kernels over the GGUF's own blocks for every type they
        take, the rest as "qmoe": see expert_format_here), "qmoe", "int4" or "int8" for ONNX Runtime's
        QMoE forms (see moepass.core.quants.expert_form), "native" (the kernels for every layer),
        "offload" (what ONNX Runtime's expert offload requires: int4 block 32 prepacked, float16) or
        "packed" (com.microsoft::MoEPacked, CUDA only).
    activations: "int8" (default): activations quantized to 8 bits inside every quantized matrix
        product, as llama.cpp does (ONNX Runtime's accuracy_level 4, several times faster on the
        CPU); "float": exact float arithmetic (see moepass.passes.activations).
    imatrix: a llama.cpp importance matrix (GGUF or .dat) weighting requantization errors per column.
    print_after: print the graph after this step (moepass.core.choices.PASS_NAMES, per input kind).
    allow_non_finite: convert tensors holding NaN or Inf (refused by default: the model would
        compute NaN logits).
    context: the positions the model is built for (its RoPE tables; default: the GGUF's
        context_length, refused when its tables would outweigh the whole model).
    exact: keep every tensor whose blocks move bit-exactly in its exact form, even where a
        requantized form is faster (Q6_K: int8 block 16 instead of block 128).
    threads: threads converting weights (None: every core the process may use).
    genai_speculative: "ngram" or "draft:PATH" (a converted draft model's folder): speculative
        decoding in genai_config.json, `draft_tokens` per step (see moepass.pipeline.genai.with_speculation).
    kv_cache: the KV cache's type, "float32", "float16" or "int8" (per-channel scales calibrated
        on `kv_calibration`, a text file, else on the model's own sampled text; see
        moepass.pipeline.kv_precision).
    """

    # each default is its option's (moepass.core.options.CONVERT_OPTIONS), declared once for the CLI too
    float_experts: str = CONVERT_OPTIONS["float_experts"].default
    expert_format: str = CONVERT_OPTIONS["expert_format"].default
    activations: str = CONVERT_OPTIONS["activations"].default
    imatrix: str | os.PathLike | None = CONVERT_OPTIONS["imatrix"].default
    print_after: str | None = CONVERT_OPTIONS["print_after"].default
    allow_non_finite: bool = CONVERT_OPTIONS["allow_non_finite"].default
    context: int | None = CONVERT_OPTIONS["context"].default
    exact: bool = CONVERT_OPTIONS["exact"].default
    threads: int | None = None  # every core the process may use (the CLI's --threads, shared by commands)
    genai_speculative: str | None = CONVERT_OPTIONS["genai_speculative"].default
    draft_tokens: int = CONVERT_OPTIONS["draft_tokens"].default
    kv_cache: str = CONVERT_OPTIONS["kv_cache"].default
    kv_calibration: str | os.PathLike | None = CONVERT_OPTIONS["kv_calibration"].default

    def __post_init__(self) -> None:
        one_of(self.activations, ACTIVATION_MODES, "activations")
        one_of(self.kv_cache, KV_CACHE_TYPES, "kv_cache")
        if self.kv_calibration is not None and self.kv_cache != "int8":
            words = wording()
            raise MoepassError(f"{words.name('--kv-calibration')} applies to {words.option('--kv-cache', 'int8')}")

    @classmethod
    def of(cls, options: ConvertOptions | None, settings: dict[str, Any]) -> ConvertOptions:
        """`options` (default: the defaults) with `settings` in place of its fields; an unknown name is
        refused, naming the nearest field."""
        return with_settings(cls, options, settings, "convert")

    def lowering(self) -> LowerOptions:
        """The lowering's options (the importance matrix read here; "auto" as expert_format_here says)."""
        return LowerOptions(
            float_experts=self.float_experts,
            expert_format=expert_format_here(self.expert_format, self.activations)[0],
            imatrix=load_imatrix(self.imatrix) if self.imatrix else None,
            context=self.context,
            exact=self.exact,
            threads=self.threads,
        )


def expert_format_here(choice: str, activations: str = "int8") -> tuple[str, str | None]:
    """The expert format a GGUF is lowered with for `choice`, and why it is not the one asked for (None
    where it is): "auto" stays auto (moepass's own kernels where they take the types) where
    moepass.cpu_ops runs here, else becomes "qmoe", and so it does with float activations, which the
    kernels do not compute (they quantize activations as llama.cpp does)."""
    if choice != "auto" or activations != "int8":
        return ("qmoe" if choice == "auto" else choice), None
    why = native_kernels_unavailable()
    if why is None:
        return choice, None
    return "qmoe", f"moepass's own CPU kernels cannot run here ({why}): ONNX Runtime's QMoE forms instead"


@dataclasses.dataclass
class GgufConversion:
    """A GGUF file lowered to an ONNX decoder whose weights are not yet written (lazy tensors):
    what `convert` writes, and what `partition` lowers further for the GPU before writing it."""

    source: Path
    gguf: GGUFModel
    arch: Architecture
    lowered: Lowered
    model: ir.Model
    activations: str
    expert_format: str

    @property
    def offload(self) -> str:
        """Whether ONNX Runtime's expert offload takes the model, and if not, why, in words."""
        violations = offload_violations(self.model)
        return (
            "eligible (int4 block 32 prepacked, float16)"
            if not violations
            else f"not eligible: {violations[0][0]}: {violations[0][1]}"
            + (
                f" ({wording().option('--expert-format', 'offload')} makes it eligible)"
                if self.expert_format != "offload"
                else ""
            )
        )

    def result(self, output_dir: Path, written: WrittenConversion, seconds: float) -> ConvertResult:
        lowered = self.lowered
        bytes_by_target: dict[str, int] = collections.Counter()
        for w in written.weights:
            bytes_by_target[w["target"]] += w["bytes"]
        return ConvertResult(
            output_dir=output_dir,
            source=self.source,
            architecture=self.arch.gguf_arch,
            n_layers=lowered.hparams.n_layers,
            moe_layers=lowered.moe_layers,
            bytes_by_target=dict(bytes_by_target),
            weights=written.weights,
            source_bytes=self.gguf.file_bytes,
            output_bytes=written.output_bytes,
            seconds=seconds,
            tokenizer=written.tokenizer,
            offload=self.offload,
            activations=self.activations,
            kv_cache=written.kv_cache,
            kv_bytes_per_position=kv_bytes_per_position(self.model.graph)
            // KV_CACHE_TYPES[cache_type_of(self.model) or "float32"]
            * KV_CACHE_TYPES[written.kv_cache["type"] or "float32"],
            context_length=lowered.hparams.context_length,
        )


@dataclasses.dataclass
class WrittenConversion:
    """What writing a conversion left in its folder: the report's weights, tokenizer and KV cache
    entries, and the folder's bytes."""

    weights: list[dict[str, Any]]
    tokenizer: dict[str, Any]
    kv_cache: dict[str, Any]
    output_bytes: int


def lower_gguf_file(
    source: Path,
    options: LowerOptions,
    activations: str = "int8",
    *,
    allow_non_finite: bool = False,
    kv_cache: str = "float32",
    print_after: str | None = None,
    echo: Callable[[str], None] = print,
) -> GgufConversion:
    """Read a GGUF file, lower it and run the GGUF pipeline's passes (a float16 `kv_cache` among
    them): nothing written yet."""
    gguf = GGUFModel(source, allow_non_finite=allow_non_finite)
    arch = architecture_of(gguf)
    lowered = lower_gguf(gguf, arch, options)
    run = PipelineRun(activations=activations, kv_cache=kv_cache)
    model = run_pipeline(lowered.model, "gguf", run, print_after, echo)
    return GgufConversion(source, gguf, arch, lowered, model, activations, options.expert_format)


def write_gguf_conversion(
    conversion: GgufConversion,
    tmp: Path,
    options: ConvertOptions,
    progress: ProgressFn | None = None,
    *,
    calibration_text: str | None = None,
    echo: Callable[[str], None] = print,
    output_dir: Path | None = None,
    also: WeightReport | None = None,
) -> WrittenConversion:
    """The conversion's files in `tmp`: model.onnx and its weights, moepass.json (the lowering's
    weight records, those of `also` in their place where it has them: partition's GPU form), the
    tokenizer, the KV cache as asked and genai_config.json."""
    gguf, lowered, model = conversion.gguf, conversion.lowered, conversion.model
    with ThreadPoolExecutor(1) as beside, _collector_paused():
        # the tokenizer (a second of Python for a 151,936-token vocabulary) is rebuilt beside the weights,
        # whose writer mostly waits for the disk and the worker threads
        tokenizer_files = beside.submit(_write_tokenizer, gguf, tmp)
        # one writer thread, in initializer order: each tensor converted on several threads chunk by chunk
        # (moepass.passes.weights), a group's codes written before its scales
        save_model(model, tmp / MODEL_FILE, progress)
        records = [r.as_dict() for r in lowered.report.records.values()]
        if also is not None:
            records = merged_records(records, also)
        report: dict[str, Any] = {
            "input": "gguf",
            "source": {
                "file": conversion.source.name,
                "parts": [p.name for p in gguf.parts],
                "bytes": gguf.file_bytes,
                # where the file lies, from the output folder, and what it held: partition packs a
                # GPU form from its blocks
                "path": relative_to_folder(conversion.source, output_dir or tmp),
                "fingerprint": gguf.fingerprint(),
            },
            "architecture": conversion.arch.gguf_arch,
            "activations": conversion.activations,
            "hparams": lowered.hparams.as_dict(),
            "moe_layers": lowered.moe_layers,
            "weights": records,
        }
        tokenizer = tokenizer_files.result()
    report["tokenizer"] = tokenizer.info
    report["kv_cache"] = set_kv_cache(
        tmp,
        options.kv_cache,
        cache_type_of(model),
        lowered.hparams.context_length,
        calibration_text,
        options.threads,
        echo,
    )
    genai = genai_config(lowered.hparams, model, tokenizer.info)
    if options.genai_speculative:
        genai = with_speculation(genai, options.genai_speculative, options.draft_tokens, output_dir or tmp)
    (tmp / GENAI_CONFIG_FILE).write_text(json.dumps(genai, indent=1, sort_keys=True) + "\n")
    write_report(tmp, report)
    output_bytes = sum(f.stat().st_size for f in tmp.iterdir())
    return WrittenConversion(records, tokenizer.info, report["kv_cache"], output_bytes)


def convert_gguf(
    source: Path,
    output_dir: Path,
    options: ConvertOptions,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    echo: Callable[[str], None] = print,
) -> ConvertResult:
    """`source` converted into `output_dir`: checked, lowered, written into a temporary folder beside
    it and renamed at the end (convert's GGUF route, and the GGUF cache's)."""
    start = time.perf_counter()
    check_destination(output_dir, overwrite, is_dir=True, inputs=[source])  # before any work
    if options.genai_speculative:  # its draft model and numbers checked before the work too
        check_speculation(options.genai_speculative, options.draft_tokens)
    calibration_text = read_text(Path(options.kv_calibration)) if options.kv_calibration is not None else None
    why = expert_format_here(options.expert_format, options.activations)[1]
    if why is not None:
        echo(why)
    conversion = lower_gguf_file(
        source,
        options.lowering(),
        options.activations,
        allow_non_finite=options.allow_non_finite,
        kv_cache=options.kv_cache,
        print_after=options.print_after,
        echo=echo,
    )
    with atomic_directory(output_dir, overwrite, inputs=conversion.gguf.parts) as tmp:
        written = write_gguf_conversion(
            conversion, tmp, options, progress, calibration_text=calibration_text, echo=echo, output_dir=output_dir
        )
    return conversion.result(output_dir, written, time.perf_counter() - start)


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while the weights are written: the vocabulary's few hundred
    thousand objects would be walked again at every full collection that the writer's and the
    tokenizer's allocations set off (6 % of a Q4_K_M conversion), and what this step allocates
    holds no cycles (arrays freed as each chunk is written). Restored as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write_tokenizer(gguf: GGUFModel, folder: Path) -> TokenizerFiles:
    tokenizer = tokenizer_from_gguf(gguf)
    tokenizer.write(folder, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
    return tokenizer
