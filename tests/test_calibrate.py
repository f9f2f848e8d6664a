"""partition's CPU side, timed on pieces of the model (moepass.runtime.calibrate), and the GPU
presets. How close the estimate comes to `moepass bench` at real sizes is measured by
benchmarks/estimate.py (docs/benchmarks.md), not here: on these tiny fixtures a step is all
per-node overhead."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from click.testing import CliRunner

import moepass
from moepass.cli import main
from moepass.core.gpus import GPU_PRESETS
from moepass.core.formats import read_plan
from moepass.core.moe_nodes import moe_nodes, tensor_bytes
from moepass.runtime import calibrate


def test_the_pieces_are_the_models_own(converted):
    costs = calibrate.measure_cpu_costs(converted("q4_0"), threads=1)
    model = ir.load(converted("q4_0") / "model.onnx")
    nodes = moe_nodes(model.graph)
    assert set(costs["moe_form_of"]) == {m.name for m in nodes}
    assert len(costs["moe_ms"]) == 1 and all(ms > 0 for ms in costs["moe_ms"].values())  # one form, timed once
    expert = {v.name for m in nodes for v in m.expert_values}
    table = {n.inputs[0].name for n in model.graph if n.op_type in calibrate.EMBEDDING_OPS}
    assert costs["non_expert_bytes_read"] == sum(tensor_bytes(v) for v in model.graph.initializers.values()
                                                 if v.name not in expert | table)
    assert costs["dense_bytes_per_s"] > 0 and costs["threads"] == 1
    step = calibrate.cpu_step_ms(costs)
    assert step["moe"] == pytest.approx(2 * next(iter(costs["moe_ms"].values())))
    assert calibrate.cpu_step_ms(costs, {n.name: 0.25 for n in nodes})["moe"] == pytest.approx(step["moe"] / 4)


def test_partition_predicts_every_layer_on_this_cpu_and_keeps_the_costs(converted, tmp_path, monkeypatch):
    source = converted("q4_0", expert_format="offload")
    placed = moepass.partition(source, tmp_path / "a", "8G", target="layers", threads=1)
    prediction = placed.plan.prediction
    step = calibrate.cpu_step_ms(placed.plan.cpu_costs)
    assert prediction.decode_ms_per_token.cpu_only == pytest.approx(step["moe"] + step["dense"])
    assert prediction.cpu is not None and prediction.cpu.threads == 1 and any(line.startswith("  CPU only ") for line in placed.summary_lines())
    # the tiny fixture: a GPU step's assumed launches outweigh this CPU's whole step, said in one line
    slower = [line for line in placed.summary_lines() if line.startswith("  slower ")]
    decode = prediction.decode_ms_per_token
    assert bool(slower) == (decode.cold_experts_on_cpu > decode.cpu_only), (slower, decode)
    assert not slower or "predicted slower than this CPU alone" in slower[0]
    # an earlier plan's costs are taken instead of timing again; another model's are refused
    monkeypatch.setattr(calibrate, "measure_cpu_costs", lambda *a, **k: pytest.fail("measured again"))
    again = moepass.partition(source, tmp_path / "b", "8G", target="layers", cpu_profile=tmp_path / "a" / "plan.json")
    assert again.plan.cpu_costs == placed.plan.cpu_costs
    with pytest.raises(moepass.MoepassError, match="its costs are of another model"):
        moepass.partition(converted("q8_0"), tmp_path / "c", "8G", target="layers",  # int8 experts: another form
                          cpu_profile=tmp_path / "a" / "plan.json")
    bare = moepass.partition(source, tmp_path / "d", "8G", target="layers", calibrate=False)
    assert bare.plan.prediction.decode_ms_per_token.cpu_only is None and bare.plan.cpu_costs is None
    assert "cpu_only" not in bare.plan.document["prediction"]["decode_ms_per_token"]
    (tmp_path / "bad.json").write_text(json.dumps({"format": "moepass-cpu-costs", "moe_ms": {"x": -1}}))
    with pytest.raises(moepass.MoepassError, match="bad.json: a CPU cost file whose fields are missing"):
        moepass.partition(source, tmp_path / "e", "8G", target="layers", cpu_profile=tmp_path / "bad.json")


def test_a_gpu_preset_gives_the_cards_numbers(converted, tmp_path):
    card = GPU_PRESETS["rtx4060-8g"]
    assert (card.vram, card.bandwidth, card.pcie) == ("8GiB", 272.0, 15.8) and card.source.startswith("https://")
    out = tmp_path / "p"
    result = CliRunner().invoke(main, ["partition", str(converted("q4_0", expert_format="offload")), "--gpu",
                                       "rtx4060-8g", "-o", str(out), "--no-calibrate", "-q", "--target", "layers"])
    assert result.exit_code == 0, result.output
    plan = read_plan(out)
    assert plan.memory.vram_bytes == 8 << 30
    assert plan.inputs.bandwidths_gbps == {"gpu": 272.0, "host": 60.0, "pcie": 15.8}
    result = CliRunner().invoke(main, ["partition", str(converted("q4_0")), "-o", str(tmp_path / "q")])
    assert result.exit_code == 2 and "give --vram SIZE or --gpu NAME" in result.stderr
    assert all(p.source.startswith("https://www.nvidia.com/") for p in GPU_PRESETS.values())
