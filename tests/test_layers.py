"""Per-layer placement (partition --target layers): annotations ONNX Runtime follows, exact models
(the form kept: lower=False, the annotations alone), budgets kept, the runtime's checks and
fallbacks. The lowered GPU form: tests/test_gpu_form.py. GPU placement itself is checked by
benchmarks/gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from moepass.cli import main
from moepass.core.errors import MoepassError
from moepass.core.model_io import load_model
from moepass.partition import partition
from moepass.core.keys import LAYER_ANNOTATION, LAYER_SETTINGS, LAYER_SETTINGS_KEY
from moepass.pipeline.placement import ExpertGroup, MemoryModel, choose_layers
from moepass.profile import profile
from moepass.runtime import load
from moepass.runtime.providers import CPU_EP, CUDA_EP, check_layer_placement, plan_session

PROMPTS = [[5, 77, 200, 13, 99, 150, 7, 260], [31, 42, 318, 1, 64]]
IDS = np.array([[5, 77, 200, 13, 99, 150, 7, 260, 31, 42]])
ARCHS = ["qwen3moe", "qwen2moe", "olmoe", "llama", "gpt-oss", "deepseek2"]

# ONNX Runtime's log for a session whose layering rules it parsed; run in a fresh interpreter so
# its stderr (where ORT logs) can be read
_SESSION_LOG = """
import sys, onnxruntime as ort
options = ort.SessionOptions()
options.log_severity_level = 0
options.add_session_config_entry(sys.argv[2], sys.argv[3])
ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
"""


def _fixed_bytes(memory: MemoryModel) -> int:
    return memory.non_expert_bytes + memory.kv_bytes(64, 1) + memory.work_bytes(64, 1, 16)


def _layer_bytes(memory: MemoryModel) -> list[int]:
    return [g.experts * g.bytes_per_expert for g in memory.groups]


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_at_several_budgets(arch, tmp_path, converted):
    source = converted("q4_0", arch=arch)
    memory = MemoryModel.of(load_model(source))
    reference = load(source).forward(IDS, load(source).empty_cache())[0]
    sizes = _layer_bytes(memory)
    placed_before = -1
    for n_gpu in sorted({0, len(sizes) // 2, len(sizes)}):
        vram = _fixed_bytes(memory) + sum(sizes[len(sizes) - n_gpu:]) + 100  # the last n_gpu layers, just
        out = tmp_path / f"{arch}-{n_gpu}"
        result = partition(source, out, vram, kernel_table=False, reserve=0, context=64, prefill_tokens=16, target="layers",
                           lower=False)
        nodes = result.plan.nodes
        on_gpu = [n.node for n in nodes if n.device == "gpu"]
        assert len(on_gpu) == n_gpu and {n.device for n in nodes} <= {"gpu", "cpu"}
        assert on_gpu == [g.node for g in memory.groups][len(sizes) - n_gpu:]  # llama.cpp's --n-cpu-moe order
        assert len(on_gpu) >= placed_before
        placed_before = len(on_gpu)
        assert _fixed_bytes(memory) + result.plan.memory.resident_expert_bytes <= vram
        assert result.options == {LAYER_SETTINGS_KEY: LAYER_SETTINGS}

        proto = onnx.load(out / "model.onnx", load_external_data=False)
        annotation = {n.name: {p.key: p.value for p in n.metadata_props}.get(LAYER_ANNOTATION)
                      for n in proto.graph.node}
        assert None not in annotation.values(), "a node without layer_ann"
        for n in nodes:
            assert annotation[n.node] == f"{n.device}/{n.node}"
        assert set(annotation.values()) - {f"{n.device}/{n.node}" for n in nodes} == {"gpu"}
        genai = json.loads((out / "genai_config.json").read_text())
        assert genai["model"]["decoder"]["session_options"][LAYER_SETTINGS_KEY] == LAYER_SETTINGS

        logits = load(out).forward(IDS, load(out).empty_cache())[0]
        np.testing.assert_array_equal(logits, reference)   # annotations only: the same computation
        if 0 < n_gpu < len(sizes):
            assert "Layering Rule 1 (cpu -> cpu) mapped to EP: CPUExecutionProvider" in _session_log(out)


def _session_log(model_dir, settings: str = LAYER_SETTINGS) -> str:
    log = subprocess.run([sys.executable, "-c", _SESSION_LOG, str(model_dir / "model.onnx"), LAYER_SETTINGS_KEY,
                          settings], capture_output=True, text=True, timeout=120)
    assert log.returncode == 0, log.stderr
    return log.stderr


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_fused_onnx_models_partition_by_layer(family, exported, tmp_path):
    import onnxruntime as ort

    from moepass.convert import convert

    fused = convert(exported(family, bits=4), tmp_path / "fused").output_dir
    memory = MemoryModel.of(load_model(fused))
    vram = _fixed_bytes(memory) + _layer_bytes(memory)[-1] + 100
    result = partition(fused, tmp_path / "placed", vram, kernel_table=False, reserve=0, context=64, prefill_tokens=16,
                       target="layers", lower=False)
    assert [n.device for n in result.plan.nodes] == ["cpu", "gpu"]
    ids = {"input_ids": (np.arange(64, dtype=np.int64)[None] * 7) % 50}
    before = ort.InferenceSession(str(fused / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, ids)
    placed = ort.InferenceSession(str(tmp_path / "placed" / "model.onnx"), providers=["CPUExecutionProvider"])
    after = placed.run(None, ids)
    np.testing.assert_array_equal(after[0], before[0])
    assert "Layering Rule 1 (cpu -> cpu) mapped to EP: CPUExecutionProvider" in _session_log(tmp_path / "placed")


def test_onnx_runtime_parses_the_rules(tmp_path, converted):
    source = converted("q4_0")
    memory = MemoryModel.of(load_model(source))
    vram = _fixed_bytes(memory) + _layer_bytes(memory)[-1] + 100  # the last layer on the GPU, the first on the CPU
    partition(source, tmp_path / "out", vram, kernel_table=False, reserve=0, context=64, prefill_tokens=16, target="layers",
              lower=False)
    log = _session_log(tmp_path / "out")
    assert "Layering Rule 1 (cpu -> cpu) mapped to EP: CPUExecutionProvider" in log, log
    # a value ONNX Runtime cannot parse is refused: the check above is not vacuous
    bad = subprocess.run([sys.executable, "-c", _SESSION_LOG, str(tmp_path / "out" / "model.onnx"),
                          LAYER_SETTINGS_KEY, "gpu(gpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "layering" in bad.stderr.lower()


def test_profile_compares_with_per_expert_placement(tmp_path, converted):
    source = converted("q4_0")
    memory = MemoryModel.of(load_model(source))
    vram = _fixed_bytes(memory) + _layer_bytes(memory)[-1] + 100
    pop = profile(source, PROMPTS)
    result = partition(source, tmp_path / "out", vram, kernel_table=False, profile=pop, reserve=0, context=64, prefill_tokens=16,
                       target="layers", lower=False)
    prediction = result.plan.prediction
    other = prediction.per_expert_alternative
    # the same bytes chosen expert by expert serve at least the routing mass of whole layers
    assert other is not None and other.gpu_hit_rate_by_mass >= prediction.gpu_hit_rate_by_mass - 1e-12
    assert prediction.gpu_hit_rate_by_mass == pytest.approx(0.5)
    assert any("per expert" in line for line in result.summary_lines())


def test_cli_target_auto(tmp_path, converted, monkeypatch):
    monkeypatch.delenv("MOEPASS_CUDA_PLUGIN", raising=False)
    runner = CliRunner()
    args = ["--vram", "1G", "--reserve", "0", "--context", "64"]
    result = runner.invoke(main, ["partition", str(converted("q4_0", expert_format="offload")), "-o",
                                  str(tmp_path / "a"), *args])
    assert result.exit_code == 0, result.output
    assert "MoE layers on the GPU whole" in result.stdout  # no plugin EP named: layers
    assert json.loads((tmp_path / "a" / "plan.json").read_text())["target"] == "layers"
    plugin = tmp_path / "libplugin.so"
    plugin.write_bytes(b"")
    result = runner.invoke(main, ["partition", str(converted("q4_0", expert_format="offload")), "-o",
                                  str(tmp_path / "b"), "--cuda-plugin", str(plugin), *args])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["target"] == "offload"
    # kept in a form that is not offload-eligible: layers even with a plugin EP named
    result = runner.invoke(main, ["partition", str(converted("q4_0")), "--keep-form", "--ignore-kernel-table", "-o",
                                  str(tmp_path / "c"), "--cuda-plugin", str(plugin), *args])
    assert result.exit_code == 0 and json.loads((tmp_path / "c" / "plan.json").read_text())["target"] == "layers"


@pytest.fixture(scope="module")
def layered(converted, tmp_path_factory):
    source = converted("q4_0")
    memory = MemoryModel.of(load_model(source))
    out = tmp_path_factory.mktemp("layers") / "model"
    vram = _fixed_bytes(memory) + _layer_bytes(memory)[-1] + 100
    partition(source, out, vram, kernel_table=False, reserve=0, context=64, prefill_tokens=16, target="layers", lower=False)
    return out


def _fake_ort(version: str, providers: list[str]):
    return types.SimpleNamespace(__version__=version, get_available_providers=lambda: providers)


def test_runtime_applies_or_refuses_the_layer_assignment(layered):
    model = load_model(layered)
    entries = json.loads((layered / "onnxruntime_options.json").read_text())["session_config_entries"]
    cuda = _fake_ort("1.32.0", [CUDA_EP, CPU_EP])
    plan = plan_session(cuda, model, entries)
    assert plan.provider == CUDA_EP and plan.layer_mode == "auto"
    assert plan.config_entries[LAYER_SETTINGS_KEY] == LAYER_SETTINGS
    assert plan.config_entries["session.record_ep_graph_assignment_info"] == "1"
    assert "session.moe.offload.mode" not in plan.config_entries

    old = _fake_ort("1.24.4", [CUDA_EP, CPU_EP])  # the last release that ignores the setting (docs/gpu.md)
    with pytest.raises(MoepassError, match="per-layer placement required, but ONNX Runtime 1.24.4 predates"):
        plan_session(old, model, entries, mode="required")
    plan = plan_session(old, model, entries)
    assert LAYER_SETTINGS_KEY not in plan.config_entries and plan.layer_mode == "disabled"
    assert plan.warnings == ["ONNX Runtime 1.24.4 predates layer assignment (session.layer_assignment_settings, "
                             "needs 1.25): all 2 MoE layers run on CUDAExecutionProvider (the plan puts 1 on the GPU)"]
    with pytest.raises(MoepassError, match="per-layer placement required, but no CUDA EP"):
        plan_session(_fake_ort("1.32.0", [CPU_EP]), model, entries, mode="required")
    plan = plan_session(cuda, model, entries, mode="disabled")
    assert LAYER_SETTINGS_KEY not in plan.config_entries


def test_runtime_reports_where_layers_ran(layered):
    model = load_model(layered)
    entries = json.loads((layered / "onnxruntime_options.json").read_text())["session_config_entries"]

    def session(assigned: dict[str, str]):
        subgraphs = [types.SimpleNamespace(ep_name=ep, get_nodes=lambda n=n: [types.SimpleNamespace(name=n)])
                     for n, ep in assigned.items()]
        return types.SimpleNamespace(get_provider_graph_assignment_info=lambda: subgraphs)

    plan = plan_session(_fake_ort("1.32.0", [CUDA_EP, CPU_EP]), model, entries)
    as_planned = {"blk.0.moe": CPU_EP, "blk.1.moe": CUDA_EP}
    assert check_layer_placement(session(as_planned), model, plan) == as_planned
    moved = {"blk.0.moe": CPU_EP, "blk.1.moe": CPU_EP}
    required = plan_session(_fake_ort("1.32.0", [CUDA_EP, CPU_EP]), model, entries, mode="required")
    with pytest.raises(MoepassError, match="1 MoE layer\\(s\\) planned for the GPU run on the CPU \\(blk.1.moe"):
        check_layer_placement(session(moved), model, required)


def test_runtime_on_the_cpu(layered):
    result = CliRunner().invoke(main, ["run", str(layered), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "moepass: warning: no CUDA EP: all 2 MoE layers run on the CPU (the plan puts 1 on the GPU)" in result.stderr
    result = CliRunner().invoke(main, ["run", str(layered), "--prompt-ids", "1,2", "--offload", "required"])
    assert result.exit_code == 2 and "per-layer placement required, but no CUDA EP" in result.stderr


@st.composite
def layer_problems(draw):
    sizes = draw(st.lists(st.integers(1, 1000), min_size=1, max_size=12))
    groups = [ExpertGroup(f"blk.{i}.moe", 4, 2, size, 8) for i, size in enumerate(sizes)]
    return groups, draw(st.integers(0, 4 * sum(sizes) + 10))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(layer_problems(), st.integers(0, 4000))
def test_larger_budget_never_fewer_layers(problem, extra):
    groups, budget = problem
    chosen = choose_layers(groups, budget)
    assert sum(g.experts * g.bytes_per_expert for g, gpu in zip(groups, chosen) if gpu) <= budget
    assert sum(choose_layers(groups, budget + extra)) >= sum(chosen)
    # whole layers from the end: no CPU layer after a GPU one
    assert chosen == sorted(chosen)
