"""The WebGPU route (runtime/providers.py, device="webgpu"): ONNX Runtime's WebGPU plugin EP
(onnxruntime-ep-webgpu, `moepass[webgpu]`) on a software Vulkan adapter where no GPU is (.ci/lavapipe,
then ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1). The plugin quantizes QMoE's activations to int8 (DP4A)
whatever the node asks, so its rows are held to the error int8 activations give on the CPU EP, the
oracle's own: the CPU's int8-activation form against its float form, on the same inputs.

WebGPU runs in subprocesses: the plugin reads the software-adapter switch when it is registered, once
a process, and a test must see a process that never set it."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from moepass.core.errors import MoepassError
from moepass.runtime import load

PLUGIN = importlib.util.find_spec("onnxruntime_ep_webgpu") is not None
needs_plugin = pytest.mark.skipif(
    not PLUGIN, reason="onnxruntime-ep-webgpu is not installed (pip install 'moepass[webgpu]'; .ci/run's WebGPU step)"
)
SOFTWARE = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"
PROMPT = [1, 2, 3, 4, 5, 6, 7]
NEW_TOKENS = 6
# every architecture the converter takes, in the float-activation form (the exact arithmetic on the CPU)
ARCHITECTURES = ["qwen3moe", "llama", "qwen2moe", "olmoe", "granitemoe", "phimoe", "deepseek2", "gpt-oss"]


def greedy_steps(model: str, device: str, prompt: list[int], n: int, forced: list[int] | None = None) -> dict:
    """Greedy decoding with each step's logits, on `device`: {"provider", "tokens", "logits"
    [step][vocab], "prompt_session"}; `forced`: these tokens fed in place of the greedy ones. Run as
    it is in a subprocess for WebGPU (its source is sent)."""
    import numpy as np

    from moepass.runtime import load
    from moepass.runtime.kv_cache import KVCache

    d = load(model, device=device)
    cache = KVCache(d, len(prompt) + n)
    logits = [cache.run_rows(prompt, 1)[-1]]
    tokens: list[int] = []
    for step in range(n):
        tokens.append(forced[step] if forced else int(np.argmax(logits[-1])))
        logits.append(cache.run_rows([tokens[-1]], 1)[-1])
    return {"provider": d.plan.provider, "tokens": tokens, "logits": [x.tolist() for x in logits[:-1]],
            "prompt_session": d.prompt_session is not None}


def run_python(code: str, *args: str, software: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    """`code` in a fresh Python, with the software-adapter switch set or not."""
    env = {k: v for k, v in os.environ.items() if k != SOFTWARE}
    if software:
        env[SOFTWARE] = "1"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, cwd="/", timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}: {done.stderr[-3000:]}")
    return done


def greedy(model, device: str) -> dict:
    """greedy_steps of PROMPT; on WebGPU in a process of its own."""
    if device != "webgpu":
        return greedy_steps(str(model), device, PROMPT, NEW_TOKENS)
    code = (inspect.getsource(greedy_steps) + "\nimport json, sys\n"
            "print(json.dumps(greedy_steps(sys.argv[1], 'webgpu', json.loads(sys.argv[2]), int(sys.argv[3]))))")
    done = run_python(code, str(model), json.dumps(PROMPT), str(NEW_TOKENS))
    return json.loads(done.stdout.strip().splitlines()[-1])


def int8_error(converted, arch: str, preset: str = "q4_0") -> float:
    """The CPU's own error of int8 activations on this fixture: its int8-activation form against its
    float form, the largest logit difference over the greedy steps of the float form's tokens."""
    exact = greedy(converted(preset, arch=arch, activations="float"), "cpu")
    quantized = greedy_steps(str(converted(preset, arch=arch, activations="int8")), "cpu", PROMPT, NEW_TOKENS,
                             forced=exact["tokens"])
    return float(np.abs(np.asarray(exact["logits"]) - np.asarray(quantized["logits"])).max())


def test_webgpu_is_refused_in_one_line_without_the_plugin(converted, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", None)  # import fails as where not installed
    with pytest.raises(MoepassError, match=r"not installed: pip install 'moepass\[webgpu\]'"):
        load(converted("q4_0"), device="webgpu")


@needs_plugin
def test_a_software_adapter_runs_only_where_asked_for(converted):
    model = converted("q4_0")
    code = "import sys; from moepass.runtime import load; print(load(sys.argv[1], device=sys.argv[2]).plan.provider)"
    refused = run_python(code, str(model), "webgpu", software=False, check=False)
    assert refused.returncode != 0
    assert f"finds no adapter: no GPU with a Vulkan, Metal or D3D12 driver; {SOFTWARE}=1 accepts" in refused.stderr
    # asked for by the variable, but "auto" never takes a software adapter: the CPU EP is faster
    assert run_python(code, str(model), "auto").stdout.split()[-1] == "CPUExecutionProvider"
    assert run_python(code, str(model), "webgpu").stdout.split()[-1] == "WebGpuExecutionProvider"


@needs_plugin
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_the_cpu_within_int8_activations_error(converted, arch):
    model = converted(arch=arch, activations="float")
    cpu, webgpu = greedy(model, "cpu"), greedy(model, "webgpu")
    assert webgpu["provider"] == "WebGpuExecutionProvider"
    bound = 2 * int8_error(converted, arch)
    same = 0
    while same < NEW_TOKENS and cpu["tokens"][same] == webgpu["tokens"][same]:
        same += 1
    # each step both ran on the same tokens: logits within the bound
    difference = np.abs(np.asarray(cpu["logits"][: same + 1]) - np.asarray(webgpu["logits"][: same + 1])).max()
    assert difference <= bound, (arch, difference, bound)
    if same < NEW_TOKENS:  # tokens part only at a near tie of the CPU's, within the same error
        top = np.sort(np.asarray(cpu["logits"][same]))[-2:]
        assert top[1] - top[0] <= bound, (arch, same, cpu["tokens"], webgpu["tokens"], top, bound)


PLACEMENT = """
import json, sys
from moepass.runtime import load
from moepass.runtime.providers import node_placement
d = load(sys.argv[1], device="webgpu")
print(json.dumps({"model": {n: ep for n, (op, ep) in d.node_placement.items() if op.endswith("QMoE")},
                  "prompts": None if d.prompt_session is None else
                  {n: ep for n, (op, ep) in node_placement(d.prompt_session, d.plan).items() if op.endswith("QMoE")}}))
"""


@needs_plugin
def test_prompts_run_their_moe_on_the_cpu_and_single_tokens_on_the_device(converted):
    """The plugin's QMoE computes wrong rows at times in calls of several tokens (docs/webgpu.md): a
    second session with every MoE node on the CPU runs them."""
    done = run_python(PLACEMENT, str(converted("q4_0", activations="float")))
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(placed["model"].values()) == {"WebGpuExecutionProvider"} and len(placed["model"]) == 2
    assert set(placed["prompts"].values()) == {"CPUExecutionProvider"}
    assert "computes wrong rows at times in calls of several tokens: prompts run their 2 device MoE layers" in (
        done.stderr)


@needs_plugin
def test_forms_the_plugin_cannot_run_stay_on_the_cpu(converted):
    """Q4_K_M's 8-bit and block-sum forms hold float16 scales in a float32 graph, which the plugin's
    QMoE fails on at run time (`raw_hash_map::at`): those nodes run on the CPU, said in one line, and
    the answer is the CPU's within the int8-activation error of the rest on WebGPU."""
    model = converted("q4_k_m", activations="float")
    done = run_python(PLACEMENT, str(model))
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(placed["model"].values()) == {"CPUExecutionProvider"} and placed["prompts"] is None
    assert "2 of 2 MoE layers run on the CPU: the WebGPU EP's QMoE cannot run blk.0.moe (its fc1 scales are " \
           "float16 in a float32 graph)" in done.stderr
    cpu, webgpu = greedy(model, "cpu"), greedy(model, "webgpu")
    bound = 2 * int8_error(converted, "qwen3moe", "q4_k_m")
    assert np.abs(np.asarray(cpu["logits"][:1]) - np.asarray(webgpu["logits"][:1])).max() <= bound


@needs_plugin
def test_serve_answers_on_webgpu_as_run_does(converted, tmp_path, monkeypatch):
    pytest.importorskip("fastapi", reason="moepass serve needs the serve extra")
    import httpx

    from support.serving import ServeProcess

    model = converted("q4_0", activations="float")
    expected = greedy(model, "webgpu")["tokens"]
    monkeypatch.setenv(SOFTWARE, "1")  # the server's process only: this one registers no plugin
    server = ServeProcess(model, tmp_path / "server.log", "--device", "webgpu")
    try:
        answer = httpx.post(f"{server.base}/completion", timeout=300,  # llama-server's, with the token ids
                            json={"prompt": PROMPT, "n_predict": NEW_TOKENS, "temperature": 0,
                                  "cache_prompt": False, "return_tokens": True}).json()
        chat = httpx.post(f"{server.base}/v1/chat/completions", timeout=300,
                          json={"messages": [{"role": "user", "content": "the other one"}], "max_tokens": 4}).json()
    finally:
        assert server.stop() == 0, server.log.read_text()
    log = server.log.read_text()
    assert "on WebGpuExecutionProvider" in log and "nodes: " in log, log
    assert answer["tokens"] == expected, answer
    assert chat["choices"][0]["finish_reason"] in ("length", "stop") and chat["usage"]["completion_tokens"] >= 1


ONE_NODE = """
import sys, numpy as np, onnxruntime as ort
from moepass.runtime.providers import _webgpu_devices
options = ort.SessionOptions()
options.add_provider_for_devices(_webgpu_devices(ort, required=True), {})
session = ort.InferenceSession(sys.argv[1], options)
x, r = np.load(sys.argv[2]), np.load(sys.argv[3])
np.save(sys.argv[4], np.concatenate([session.run(None, {"x": x[i:i + 1], "r": r[i:i + 1]})[0] for i in range(len(x))]))
"""


@needs_plugin
def test_a_qmoe_node_on_webgpu_is_within_the_int8_activation_error_of_the_cpus(converted, tmp_path):
    """One QMoE node of the fixture, one token a call (the path decoding takes), 24 random rows:
    WebGPU's rows against the CPU's exact (float activation) ones, within twice the CPU's own int8
    activation error on the same rows."""
    import onnx
    from onnx import helper

    import onnxruntime as ort

    source = onnx.load(str(converted("q4_0", activations="float") / "model.onnx"))
    node = next(n for n in source.graph.node if n.op_type == "QMoE")
    weights = [i for i in source.graph.initializer if i.name in node.input]
    experts, hidden = next(i.dims[:2] for i in weights if i.name.endswith("fc2.q"))

    def model(accuracy_level: int) -> str:
        moe = helper.make_node("QMoE", ["x", "r", *node.input[2:]], ["y"], domain="com.microsoft", name="moe")
        moe.attribute.extend(a for a in node.attribute if a.name != "accuracy_level")
        moe.attribute.append(helper.make_attribute("accuracy_level", accuracy_level))
        graph = helper.make_graph([moe], "one", [helper.make_tensor_value_info("x", 1, ["T", hidden]),
                                                 helper.make_tensor_value_info("r", 1, ["T", experts])],
                                  [helper.make_tensor_value_info("y", 1, ["T", hidden])], weights)
        path = tmp_path / f"qmoe-{accuracy_level}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                          helper.make_opsetid("com.microsoft", 1)]), path)
        return str(path)

    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, hidden)).astype(np.float32)
    r = rng.standard_normal((24, experts)).astype(np.float32)
    np.save(tmp_path / "x.npy", x), np.save(tmp_path / "r.npy", r)
    run_python(ONE_NODE, model(0), str(tmp_path / "x.npy"), str(tmp_path / "r.npy"), str(tmp_path / "y.npy"))
    webgpu = np.load(tmp_path / "y.npy")

    def cpu(accuracy_level: int) -> np.ndarray:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(model(accuracy_level), options, providers=["CPUExecutionProvider"])
        return np.concatenate([session.run(None, {"x": x[i : i + 1], "r": r[i : i + 1]})[0] for i in range(len(x))])

    exact = cpu(0)
    bound = 2 * np.abs(cpu(4) - exact).max()
    assert 0 < np.abs(webgpu - exact).max() <= bound, (np.abs(webgpu - exact).max(), bound)


@needs_plugin
def test_bench_profiles_both_sessions(converted):
    """bench --profile on WebGPU: the prefill's kernels from the prompt session's profile (its MoE on
    the CPU), the decode step's from the model's session."""
    code = "import sys; from moepass.cli import main; main(sys.argv[1:])"
    done = run_python(code, "bench", str(converted("q4_0", activations="float")), "-p", "8", "-n", "4", "-r", "1",
                      "--device", "webgpu", "--profile", check=False)
    assert done.returncode == 0, done.stderr
    assert "a prefill of 8 tokens under the profiler" in done.stdout + done.stderr
    assert "a decode step under the profiler" in done.stdout + done.stderr
