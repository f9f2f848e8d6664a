"""moepass partition: memory model, plans, the annotated model (exact), ORT-accepted options, bad input."""

from __future__ import annotations

import filecmp
import json
import os
import re

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

import moepass
from moepass.cli import main
from moepass.partition import partition
from moepass.core.choices import parse_bytes
from moepass.pipeline.placement import (Budget, ExpertGroup, MemoryModel, choose_resident, plan_placement)
from moepass.core.capabilities import offload_violations
from moepass.core.files import SHARED_DATA_FILE
from moepass.core.formats import PLAN_VERSION, read_plan
from moepass.core.model_io import load_model
from moepass.core.moe_nodes import moe_nodes
from moepass.profile import profile
from moepass.runtime import load
import make_fixtures
from support.bounds import assert_within, float_rounding_bound, int8_rerun_bound

PROMPTS = [[5, 77, 200, 13, 99, 150, 7, 260], [31, 42, 318, 1, 64], [128, 3, 17, 250, 64, 9, 300, 120, 45]]
IDS = np.array([[5, 77, 200, 13, 99, 150, 7, 260, 31, 42]])


@pytest.fixture(scope="module")
def popularity(converted):
    return profile(converted("q4_0"), PROMPTS)


def _memory(converted, preset="q4_0"):
    return MemoryModel.of(load_model(converted(preset)))


@pytest.mark.parametrize("text,value", [("8G", 8 << 30), ("8GiB", 8 << 30), ("7.5GB", 7_500_000_000),
                                        ("8000M", 8000 << 20), ("12345678", 12345678), ("512MiB", 512 << 20),
                                        (" 2 g ", 2 << 30), ("100KB", 100_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["8 gigs", "G8", "-1G", "", "1e9", "8Q"])
def test_parse_bytes_rejects(text):
    with pytest.raises(moepass.MoepassError, match="is not a size"):
        parse_bytes(text, "--vram")


@pytest.mark.parametrize("text,says", [("8", "means 8 bytes; give a unit"), ("123456", "means 123456 bytes"),
                                       ("2000T", "more than 1 PiB"), ("1" * 40, "is not a size")])
def test_parse_bytes_refuses_forgotten_units_and_absurd_sizes(text, says):
    with pytest.raises(moepass.MoepassError, match=says):
        parse_bytes(text, "--vram")


def test_memory_model_counts_every_byte(converted):
    model = load_model(converted("q4_0"))
    memory = MemoryModel.of(model)
    total = sum(int(np.prod(v.const_value.shape.numpy())) * v.const_value.dtype.itemsize
                for v in model.graph.initializers.values())
    # and the RoPE cos and sin tables the session folds at load: context x head_dim / 2 float32 each
    tables = 2 * make_fixtures.TEST_DIMS.context_length * (64 // 2) * 4
    assert memory.non_expert_bytes + memory.expert_bytes == total + tables
    report = json.loads((converted("q4_0") / "moepass.json").read_text())
    fc = [w for w in report["weights"] if w["onnx_name"].startswith("blk.0.ffn_experts")]
    assert memory.groups[0].bytes_per_expert * 8 == sum(w["bytes"] for w in fc)
    # K and V, 2 layers, 2 kv heads x 64, float32
    assert memory.kv_bytes(context=100, batch=3) == 2 * 2 * 2 * 64 * 4 * 100 * 3
    d = memory.dims
    assert (d["hidden"], d["vocab"], d["heads"], d["kv_heads"], d["head_dim"]) == (256, 320, 4, 2, 64)
    t = 2 * 16
    expected = 4 * (4 * t * 256 + t * (4 + 4) * 64 + 2 * 4 * 16 * 100 + (t * 2 * (3 * 256 + 256) + t * 8) + t * 320)
    assert memory.work_bytes(context=100, batch=2, prefill_tokens=16) == expected


def _five_resident(source, out):
    """`source` profiled and partitioned with five experts resident (the experts reordered, resident
    first; the model's form kept, lower=False: the reordering alone); the placed model's directory."""
    memory = MemoryModel.of(load_model(source))
    vram = memory.non_expert_bytes + memory.kv_bytes(64, 1) + memory.work_bytes(64, 1, 16) + \
        5 * memory.groups[0].bytes_per_expert
    result = partition(source, out, vram, kernel_table=False, profile=profile(source, PROMPTS), reserve=0, context=64,
                       prefill_tokens=16, target="offload", lower=False)
    assert sum(n.resident_count for n in result.plan.nodes) == 5
    return out


def _logits(model_dir, ids):
    decoder = load(model_dir)
    return decoder.forward(ids, decoder.empty_cache())[0][0].astype(np.float64)


def _prefill_and_step(model_dir):
    """Logits of IDS by one prefill, then of one decode step through the KV cache."""
    decoder = load(model_dir)
    prefill, cache = decoder.forward(IDS, decoder.empty_cache())
    step, _ = decoder.forward(np.array([[11]]), cache)
    return np.concatenate([prefill[0], step[0]])


def _source_and_placed(converted, tmp_path, preset, **kwargs):
    """{activations: (source logits, placed logits)} for float and int8 activations."""
    logits = {}
    for activations in ("float", "int8"):
        source = converted(preset, activations=activations, **kwargs)
        logits[activations] = (_prefill_and_step(source),
                               _prefill_and_step(_five_resident(source, tmp_path / activations)))
    return logits


def test_annotated_model_is_exact(tmp_path, converted):
    """Placing experts reorders them (resident first) and changes nothing else. In float arithmetic
    the placed Q4_0 model computes the source's logits bit for bit: QMoE renormalizes over the
    selected experts and adds their weights in the order of selection, whatever the storage order.
    With int8 activations, within tests/support/bounds.py's int8 rerun bound. The float MoE node of
    the F32 model adds the selected experts' outputs in storage order, which the reordering changes: float32
    rounding of each MoE layer's sum (measured 1.1e-6, 2 units in the last place)."""
    (af, bf), (a8, b8) = _source_and_placed(converted, tmp_path, "q4_0").values()
    np.testing.assert_array_equal(af, bf)
    assert_within(b8, a8, int8_rerun_bound(a8, af), "Q4_0, int8 activations")
    source = converted("f32")
    a, b = _prefill_and_step(source), _prefill_and_step(_five_resident(source, tmp_path / "f32"))
    layers = len(MemoryModel.of(load_model(source)).groups)
    assert_within(b, a, float_rounding_bound(a, layers), "F32 (float MoE)")


# MoE nodes whose mixing weights are the router's softmax over the selected experts (renormalized
# top-k, deepseek2's gathered scores): the placed model is bit for bit the source in float arithmetic.
RENORMALIZING = {"llama", "gpt-oss", "deepseek2", "deepseek2-softmax"}


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe", "llama", "gpt-oss", "deepseek2", "deepseek2-softmax"])
def test_other_architectures_profile_and_partition_exactly(arch, tmp_path, converted):
    """Routing without renormalization feeds QMoE softmax(all router logits), permuted with the
    experts: the softmax then adds its exponentials in the new order, so in float arithmetic the
    placed model equals the source to float32 rounding of one E-term sum per MoE layer (measured
    1e-6, 2 units in the last place), and bit for bit where the node renormalizes (RENORMALIZING).
    With int8 activations, within tests/support/bounds.py's int8 rerun bound (qwen2moe measured 6e-6
    with AVX-512 kernels and 3.6e-3 with AVX2 ones, against a bound of 0.040).
    gpt-oss: the router's bias (MatMul + Add) and the experts' biases are permuted with the experts.
    deepseek2: the group-limited routing's result is gathered into the new order; its dense first
    block has no experts."""
    (af, bf), (a8, b8) = _source_and_placed(converted, tmp_path, "q4_0", arch=arch).values()
    layers = len(MemoryModel.of(load_model(converted("q4_0", arch=arch, activations="float"))).groups)
    float_bound = 0.0 if arch in RENORMALIZING else float_rounding_bound(af, layers)
    if arch in RENORMALIZING:
        np.testing.assert_array_equal(af, bf)
    else:
        assert_within(bf, af, float_bound, f"{arch}, float activations")
    assert_within(b8, a8, int8_rerun_bound(a8, af, float_bound), f"{arch}, int8 activations")


def test_outputs_plan_and_options_accepted_by_onnxruntime(tmp_path, converted, popularity):
    out = tmp_path / "placed"
    result = partition(converted("q4_0"), out, "2MiB", kernel_table=False, profile=popularity, context=64, prefill_tokens=16,
                       reserve="64K", report=tmp_path / "plan.png", target="offload")
    assert sorted(p.name for p in out.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data",
                                                      "moepass.json", "onnxruntime_options.json", "plan.json",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = read_plan(out)
    assert plan.document["format"] == "moepass-plan" and plan.version == PLAN_VERSION and plan == result.plan
    assert plan.active and plan.lowering is not None and plan.lowering.lowered
    mem = plan.memory
    used = mem.non_expert_bytes + mem.kv_cache_bytes + mem.work_bytes + mem.reserve_bytes + mem.resident_expert_bytes
    assert used + mem.free_bytes == mem.vram_bytes == 2 << 20
    assert plan.prediction.label.startswith("estimate")
    model = onnx.load(out / "model.onnx", load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["moepass.placement"])["plan"] == "plan.json"
    for node in plan.nodes:
        onnx_node = next(n for n in model.graph.node if n.name == node.node)
        node_meta = {p.key: p.value for p in onnx_node.metadata_props}
        assert node_meta["moepass.placement.expert_ids"] == ",".join(map(str, node.order))
        assert node_meta["moepass.placement.resident"] == str(node.resident_count)
        assert node.order[: node.resident_count] == node.resident
        assert node.mass_hit_rate == pytest.approx(popularity.mass(node.node)[list(node.resident)].sum())
    data_size = (out / "model.onnx.data").stat().st_size
    assert plan.expert_regions
    for region in plan.expert_regions:
        assert region.offset + region.length <= data_size
        count = next(n.resident_count for n in plan.nodes if n.node == region.node)
        assert region.resident_bytes == region.length * count // 8

    entries = json.loads((out / "onnxruntime_options.json").read_text())["session_config_entries"]
    assert entries == result.options and entries["session.moe.offload.placement"] == "static"

    def session(config):
        options = ort.SessionOptions()
        for key, value in config.items():
            options.add_session_config_entry(key, value)
        return ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])

    session(entries)  # ONNX Runtime validates every session.moe.offload.* key and value, even on the CPU EP
    with pytest.raises(Exception, match="gpu_budget_bytes"):  # the check can fail: a value ORT refuses
        session({**entries, "session.moe.offload.gpu_budget_bytes": "2MiB"})


def test_required_mode_fails_with_missing_bytes(tmp_path, converted):
    memory = MemoryModel.of(load_model(converted("q4_0", expert_format="offload")))  # the GPU form's
    need = memory.non_expert_bytes + memory.kv_bytes(64, 1) + memory.work_bytes(64, 1, 16)
    out = tmp_path / "placed"
    offloadable = converted("q4_0", expert_format="offload")
    need_offload = MemoryModel.of(load_model(offloadable))
    need_offload = (need_offload.non_expert_bytes + need_offload.kv_bytes(64, 1)
                    + need_offload.work_bytes(64, 1, 16))
    with pytest.raises(moepass.MoepassError, match=f"{need_offload - 1000:,} bytes .* missing"):
        partition(offloadable, out, 1000, mode="required", context=64, prefill_tokens=16, reserve=0, target="offload")
    assert not out.exists() and not list(tmp_path.glob(".placed.*"))
    warnings = []
    result = partition(converted("q4_0"), out, 1000, kernel_table=False, mode="auto", context=64, prefill_tokens=16, reserve=0,
                       warn=warnings.append, target="offload")
    short = next(w for w in warnings if "missing" in w)
    assert f"{need - 1000:,} bytes" in short and "missing; no expert is placed on the GPU" in short
    assert result.plan.fits is False
    assert all(n.resident_count == 0 for n in result.plan.nodes)


def test_everything_fits(tmp_path, converted):
    offloadable = converted("q4_0", expert_format="offload")
    result = partition(offloadable, tmp_path / "all", "1G", profile=profile(offloadable, PROMPTS), target="offload")
    assert all(n.resident_count == 8 for n in result.plan.nodes) and not result.warnings
    assert result.plan.active and result.plan.inactive_reason is None and result.plan.offload_active


def test_a_model_onnx_runtime_will_not_offload_gets_an_inactive_plan(tmp_path, converted, popularity):
    """Kept in its form (--keep-form), a default conversion (int4 experts in the raw layout, float32) is
    not offload-eligible: partition says so before planning, names the node and rule and the way out;
    required mode refuses it. Lowered (the default), the same model is offloaded: every node in the
    offload form, the plan active."""
    warnings = []
    result = partition(converted("q4_0"), tmp_path / "placed", "1G", kernel_table=False, profile=popularity,
                       warn=warnings.append, target="offload", lower=False)
    assert "ONNX Runtime will not offload this model's experts (blk.0.moe: int4 experts need weights_prepacked=1" \
        in warnings[0] and "(lower=True, the default)" in warnings[0] and warnings[0].endswith("inactive")
    assert not result.plan.active and "blk.0.moe" in (result.plan.inactive_reason or "")
    plan = read_plan(tmp_path / "placed")
    assert plan.offload_active is False and plan.active is False and "blk.0.moe" in (plan.inactive_reason or "")
    assert "(inactive: ONNX Runtime will not offload this model)" in result.summary_lines()[0]
    with pytest.raises(moepass.MoepassError, match="will not offload this model's experts"):
        partition(converted("q4_0"), tmp_path / "required", "1G", kernel_table=False, profile=popularity,
                  mode="required", target="offload", lower=False)
    assert not (tmp_path / "required").exists()
    assert result.plan.prediction.gpu_hit_rate_by_mass == pytest.approx(1.0)
    lowered = partition(converted("q4_0"), tmp_path / "lowered", "1G", profile=popularity, mode="required",
                        target="offload")
    assert lowered.plan.active and lowered.plan.offload_active and lowered.warnings == []
    assert offload_violations(load_model(tmp_path / "lowered")) == []


def test_policies(converted, popularity):
    memory = _memory(converted)
    per_expert = memory.groups[0].bytes_per_expert
    fixed = memory.non_expert_bytes + memory.kv_bytes(64, 1) + memory.work_bytes(64, 1, 16)
    budget = Budget(fixed + 6 * per_expert, 64, 1, 16, 0)
    balanced = plan_placement(memory, budget, popularity, "balanced")
    assert [len(r) for r in balanced.resident.values()] == [3, 3]
    for node, resident in balanced.resident.items():
        assert resident == list(np.argsort(-popularity.mass(node), kind="stable")[:3])
    best = plan_placement(memory, budget, popularity, "global")
    assert sum(best.mass_hit_rate.values()) >= sum(balanced.mass_hit_rate.values())
    uniform = plan_placement(memory, budget)
    assert uniform.policy == "uniform" and uniform.resident == {"blk.0.moe": [0, 1, 2], "blk.1.moe": [0, 1, 2]}
    with pytest.raises(moepass.MoepassError, match="needs a popularity profile"):
        plan_placement(memory, budget, None, "global")


def test_bad_input(tmp_path, converted, popularity):
    other = tmp_path / "demo"
    moepass.convert(make_fixtures.DEMO_FIXTURE, other)
    profile(other, PROMPTS[:1]).save(tmp_path / "other.json")
    out = tmp_path / "out"
    runner = CliRunner()
    cases = [
        (["--vram", "8G", "--profile", str(tmp_path / "other.json")], "measured on another model"),
        (["--vram", "8 gigs"], "--vram '8 gigs' is not a size"),
        (["--vram", "8G", "--profile", str(tmp_path / "missing.json")], "missing.json: no such file or directory"),
        (["--vram", "8G", "--policy", "global"], "needs a popularity profile"),
        (["--vram", "8G", "--report", str(tmp_path / "plan.svg")], "name it *.png"),
    ]
    for args, message in cases:
        result = runner.invoke(main, ["partition", str(converted("q4_0")), "--ignore-kernel-table", "-o", str(out), "--target", "offload",
                                      *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not out.exists() and not list(tmp_path.glob(".out.*"))
    result = runner.invoke(main, ["partition", str(tmp_path / "nothing"), "-o", str(out), "--vram", "1G"])
    assert result.exit_code == 2 and "nothing: no such file or directory" in result.stderr


def test_same_input_same_files(tmp_path, converted, popularity):
    """Byte-identical outputs for the same inputs: the CPU side's timings are a measurement, so they
    are taken from one plan for both (--cpu-profile), or not made (--no-calibrate)."""
    timed = partition(converted("q4_0"), tmp_path / "timed", "1500K", kernel_table=False, reserve=0, context=64,
                      prefill_tokens=16, target="offload")
    for name in ("a", "b"):
        partition(converted("q4_0"), tmp_path / name, "1500K", kernel_table=False, profile=popularity, reserve=0,
                  context=64, prefill_tokens=16, target="offload", cpu_profile=timed.output_dir / "plan.json")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert mismatch == [] and errors == []


def test_cli_partition(tmp_path, converted):
    result = CliRunner().invoke(main, ["partition", str(converted("q4_0")), "--ignore-kernel-table", "--vram", "1500K", "--reserve", "0",
                                       "--context", "64", "--prefill-tokens", "16", "-o", str(tmp_path / "p"),
                                       "--target", "offload"])
    assert result.exit_code == 0, result.output
    assert "experts on the GPU (uniform policy)" in result.stdout and "estimate" in result.stdout
    assert "moepass: warning:" in result.stderr


# ---- properties of the placement, over random popularity tables and budgets -----------------------

@st.composite
def placement_problems(draw):
    n_layers = draw(st.integers(1, 6))
    experts = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 50), min_size=n_layers, max_size=n_layers))
    masses = [np.array(draw(st.lists(st.floats(0, 1, allow_nan=False), min_size=experts, max_size=experts)))
              for _ in range(n_layers)]
    masses = [m / m.sum() if m.sum() > 0 else np.full(experts, 1 / experts) for m in masses]
    groups = [ExpertGroup(f"blk.{i}.moe", experts, 2, size, 8) for i, size in enumerate(sizes)]
    budget = draw(st.integers(0, sum(sizes) * experts + 10))
    return groups, masses, budget


def _served(groups, masses, chosen):
    return sum(float(m[c].sum()) for m, c in zip(masses, chosen))


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples every run
@given(placement_problems(), st.sampled_from(["global", "balanced"]))
def test_never_over_budget_and_deterministic(problem, policy):
    groups, masses, budget = problem
    chosen = choose_resident(groups, masses, budget, policy)
    assert sum(len(c) * g.bytes_per_expert for c, g in zip(chosen, groups)) <= budget
    assert all(len(set(c)) == len(c) for c in chosen)
    assert chosen == choose_resident(groups, [m.copy() for m in masses], budget, policy)


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples every run
@given(placement_problems(), st.integers(1, 200), st.sampled_from(["global", "balanced"]))
def test_more_budget_never_serves_less(problem, extra, policy):
    groups, masses, budget = problem
    less = _served(groups, masses, choose_resident(groups, masses, budget, policy))
    more = _served(groups, masses, choose_resident(groups, masses, budget + extra, policy))
    assert more >= less - 1e-12




def test_a_per_layer_plan_shares_the_weights_unchanged(converted, tmp_path):
    """--target layers lowers the GPU side to float16 and leaves the experts as they are (a Q4_0
    model's int4/b32 is a form the CUDA kernel takes): the source's data file is shared, hard-linked
    into the placed folder (the same inode, no copy), and only what the GPU form changed (float16
    norms, and the scales, float32 on the CPU at block 32) is written: the placed folder adds that
    to the disk, nothing more. Both models still load (their data files have two links now).
    --target offload reorders the experts and packs them for the SM80 layout: written anew."""
    source = converted("q4_0")
    placed = moepass.partition(source, tmp_path / "layers", "8G", target="layers")
    shared = placed.output_dir / SHARED_DATA_FILE
    assert os.stat(shared).st_ino == os.stat(source / "model.onnx.data").st_ino
    added = sum(p.stat().st_size for p in placed.output_dir.iterdir() if p.name != SHARED_DATA_FILE)
    source_model = ir.load(str(source / "model.onnx"))
    scales = sum(v.const_value.nbytes for v in source_model.graph.initializers.values()
                 if v.dtype == ir.DataType.FLOAT and v.name.endswith("scales"))
    written = (placed.output_dir / "model.onnx.data").stat().st_size
    assert scales / 2 <= written < scales / 2 + 0.02 * shared.stat().st_size  # float16 scales, norms
    assert added < 0.2 * shared.stat().st_size
    assert placed.weights.startswith(f"{SHARED_DATA_FILE}: ") and "(hard link)" in placed.weights
    assert f"  weights          {placed.weights}" in placed.summary_lines()
    shared_data = read_plan(placed.output_dir).shared_data
    assert shared_data is not None and shared_data.file == SHARED_DATA_FILE
    recorded = shared_data.source  # from the placed folder
    assert (placed.output_dir / recorded).resolve() == (source / "model.onnx.data").resolve()
    # float16 on the GPU side: as far from the source as convert's own float16 graph (the offload
    # form, the same Q4_0 weights) is, and the same greedy token wherever the source's margin is wider
    ids = np.array([[1, 2, 3, 4, 90, 7]])
    theirs, half, ours = (_logits(m, ids) for m in (source, converted("q4_0", expert_format="offload"), placed.output_dir))
    bound = 2 * np.abs(half - theirs).max()
    assert np.abs(ours - theirs).max() <= bound
    top2 = np.sort(theirs, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * bound
    assert clear.any() and (ours.argmax(-1) == theirs.argmax(-1))[clear].all()
    assert moe_nodes(load_model(source).graph) and moe_nodes(load_model(placed.output_dir).graph)
    again = moepass.partition(placed.output_dir, tmp_path / "again", "8G", target="layers")  # a placed model's plan
    assert again.plan.active
    moved = moepass.partition(source, tmp_path / "offload", "8G", target="offload")
    assert moved.weights.startswith("model.onnx.data written anew")


def test_the_plan_picture_says_an_inactive_plan_and_hides_no_cell(tmp_path, converted, popularity):
    """An offload plan for a model ONNX Runtime will not offload says so in its title; the legend
    lies outside the heatmap, covering no cell."""
    import matplotlib

    matplotlib.use("Agg")
    from moepass.pipeline.plan_report import plan_figure

    inactive = partition(converted("q4_0"), tmp_path / "placed", "8G", kernel_table=False, profile=popularity,
                         target="offload", lower=False)
    assert inactive.plan.offload_active is False
    figure = plan_figure(inactive.plan, popularity)
    heatmap = figure.axes[0]
    assert "INACTIVE plan: ONNX Runtime will not offload this model, every expert runs on the CPU" in heatmap.get_title()
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legend = heatmap.get_legend().get_window_extent(renderer)
    cells = heatmap.get_window_extent(renderer)
    assert legend.y0 >= cells.y1 - 1, (legend, cells)  # above the cells
    active = partition(converted("q4_0", expert_format="offload"), tmp_path / "placed2", "8G", profile=popularity,
                       target="offload")
    title = plan_figure(active.plan, popularity).axes[0].get_title()
    assert "INACTIVE" not in title and "of routing mass on the GPU" in title


def test_the_summary_names_the_picture_and_the_estimate_that_applies(tmp_path, converted, popularity):
    """partition says which picture it wrote; a per-layer plan prints the one decode estimate it runs
    (its CPU layers on the CPU), not the PCIe one of expert offload; in the picture a KV cache of a
    fraction of a percent of the budget is still a visible segment, and the colour bar says what
    the colours are."""
    import matplotlib

    matplotlib.use("Agg")
    from moepass.pipeline.plan_report import plan_figure

    picture = tmp_path / "plan.png"
    result = CliRunner().invoke(main, ["partition", str(converted("q4_0")), "--vram", "8G", "--target", "layers",
                                       "--no-calibrate", "-o", str(tmp_path / "placed"), "--report", str(picture)])
    assert result.exit_code == 0, result.output
    assert f"picture          {picture}" in result.stdout and picture.is_file()
    estimate = next(line for line in result.stdout.splitlines() if "decode estimate" in line)
    assert "over PCIe" not in estimate and "CPU layers on the CPU" in estimate
    placed = partition(converted("q4_0"), tmp_path / "p2", "8G", profile=popularity, target="layers",
                       calibrate=False)
    figure = plan_figure(placed.plan, popularity)
    bar = figure.axes[-1]
    kv = next(p for p, label in zip(bar.patches, (t.get_text() for t in bar.get_legend().get_texts()))
              if label.startswith("KV cache"))
    assert placed.plan.memory.kv_cache_bytes < 0.01 * placed.plan.memory.vram_bytes
    assert kv.get_width() >= 0.01 * placed.plan.memory.vram_bytes / 2**30 * 0.99  # GiB units at an 8 GiB budget
    assert "1 = average" in figure.axes[1].get_ylabel()


@pytest.mark.parametrize("vram", ["8G", "600M"])
def test_the_plan_picture_is_readable_at_a_small_models_sizes(tmp_path, converted, popularity, vram):
    """The test model's megabytes against gigabytes and megabytes of budget: each part in its own unit
    (no "0.00 GiB"), the bar within its axis and ending where the parts' sum does, the colour bar's
    label no longer than its bar."""
    import matplotlib

    matplotlib.use("Agg")
    from moepass.pipeline.plan_report import bar_widths, plan_figure

    placed = partition(converted("q4_0"), tmp_path / "placed", vram, profile=popularity, target="layers",
                       calibrate=False)
    figure = plan_figure(placed.plan, popularity)
    bar = figure.axes[-1]
    labels = [t.get_text() for t in bar.get_legend().get_texts()]
    assert len(labels) == 6 and not any(re.search(r" 0\.00 [KMGT]iB$", label) for label in labels), labels
    mem = placed.plan.memory
    parts = [mem.non_expert_bytes, mem.kv_cache_bytes, mem.work_bytes, mem.reserve_bytes, mem.resident_expert_bytes,
             mem.free_bytes]
    end = max(p.get_x() + p.get_width() for p in bar.patches)
    budget = bar.lines[0].get_xdata()[0]
    assert end == pytest.approx(budget * sum(parts) / mem.vram_bytes, rel=1e-9) and end <= bar.get_xlim()[1]
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    colour = figure.axes[1]
    assert colour.yaxis.label.get_window_extent(renderer).height <= colour.get_window_extent(renderer).height
    # the widths: a part under 1 % drawn at 1 %, taken from free, the sum kept
    assert bar_widths([50, 1, 0, 9, 20, 20], 100) == [50, 1, 0, 9, 20, 20]
    assert bar_widths([90, 0.1, 0, 0.2, 5, 4.7], 100) == pytest.approx([90, 1, 0, 1, 5, 3])
    assert bar_widths([97, 0.5, 0.5, 1, 1, 0], 100) == pytest.approx([96, 1, 1, 1, 1, 0])


@pytest.mark.parametrize("hidden,expert_ff,preset", [(96, 64, "q4_0"), (160, 96, "q8_0"), (200, 136, "f32"),
                                                     (72, 40, "f32")])
def test_a_model_whose_sizes_the_gpu_kernel_does_not_divide_partitions(hidden, expert_ff, preset, tmp_path):
    """Hidden and expert sizes that are not multiples of 64 (nor of 32 or 16 for some): --target
    layers keeps the MoE layers the CUDA EP's QMoE kernel cannot take on the CPU, says so in
    plan.json, and the placed model runs as the converted one; --target offload refuses in one line."""
    import dataclasses

    dims = dataclasses.replace(make_fixtures.TEST_DIMS, hidden=hidden, head_dim=32, n_heads=4, n_kv_heads=2,
                               expert_ff=expert_ff)
    gguf = make_fixtures.write_moe_gguf(tmp_path / "odd.gguf", preset, dims=dims)
    assert CliRunner().invoke(main, ["convert", str(gguf), "-o", str(tmp_path / "conv"), "-q", "--expert-format",
                                     "qmoe"]).exit_code == 0
    result = CliRunner().invoke(main, ["partition", str(tmp_path / "conv"), "--vram", "2G", "--target", "layers",
                                       "--no-calibrate", "-o", str(tmp_path / "placed")])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "placed" / "plan.json").read_text())
    kept = [w for w in plan["warnings"] if "stay on the CPU" in w]
    quantized = preset != "f32"  # QMoE's tiles; float experts go to the GPU as they are
    assert bool(kept) == quantized, plan["warnings"]
    assert "(a bug)" not in result.output
    ids = ["--prompt-ids", "1,2,3", "-n", "6"]
    converted_tokens = CliRunner().invoke(main, ["run", str(tmp_path / "conv"), *ids])
    placed_tokens = CliRunner().invoke(main, ["run", str(tmp_path / "placed"), *ids])
    assert placed_tokens.exit_code == 0, placed_tokens.output
    assert placed_tokens.stdout == converted_tokens.stdout
    offload = CliRunner().invoke(main, ["partition", str(tmp_path / "conv"), "--vram", "2G", "--target", "offload",
                                        "--no-calibrate", "-o", str(tmp_path / "offload")])
    if quantized:
        assert offload.exit_code == 2 and offload.stderr.startswith("moepass: error: blk.") and "(a bug)" not in \
            offload.stderr, offload.output
        assert offload.stderr.count("\n") == 1 and not (tmp_path / "offload").exists()


def test_an_unknown_option_is_refused_naming_the_nearest(converted, tmp_path):
    """The Python API's keywords are PartitionOptions' fields: a misspelt one is one line naming the
    field meant, before any work (no output folder)."""
    with pytest.raises(moepass.MoepassError, match=r"partition: no option 'targte' \(did you mean target\?\)"):
        moepass.partition(converted("q4_0"), tmp_path / "placed", "8G", targte="layers")
    assert not (tmp_path / "placed").exists()
    from moepass.partition import PartitionOptions

    with pytest.raises(moepass.MoepassError, match="batch must be a positive integer"):
        PartitionOptions(batch=0)
    options = PartitionOptions(target="layers", calibrate=False)
    placed = moepass.partition(converted("q4_0"), tmp_path / "placed", "8G", options, kv_cache="keep")
    assert placed.plan.target == "layers"


def test_partition_reads_as_its_stages():
    """moepass.partition.partition is its stages (read, plan, lower, write) in under 40 lines."""
    import inspect

    from moepass.partition import partition as the_function

    source = inspect.getsource(the_function)
    body = source[source.index('"""', source.index(") -> PartitionResult:")) + 3:]
    body = body[body.index('"""') + 3:]
    lines = [line for line in body.splitlines() if line.strip()]
    assert len(lines) < 40, f"partition() is {len(lines)} lines"
    for stage in ("read_source", "plan_for", "lower_for_plan", "atomic_directory"):
        assert stage in body
