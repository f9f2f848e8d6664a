"""moepass.runtime: generation against llama.cpp, tokenizers against llama.cpp's, sampling, execution
provider choice with every fallback and refusal, onnxruntime-genai on the same files, CLI."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import types

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

import moepass
from moepass.cli import main
from moepass.core.gguf_reader import GGUFModel
from moepass.runtime import Sampling, choose_token, load
from moepass.runtime.providers import PLUGIN_EP, SessionPlan, offload_violations, plan_session, provider_in_effect
from moepass.pipeline.tokenizer import tokenizer_from_gguf
from support.bounds import assert_within, float_rounding_bound, int8_rerun_bound
from support.oracle import llama_cpp_module

TEXTS = ["Hello world, this is the test 123!\n  spaces", "then the other one's there", "éü 你好 🙂",
         " leading space", "<|im_start|>user\nhi<|im_end|>"]


def _llama(path, **kw):
    return llama_cpp_module().Llama(str(path), n_ctx=128, type_k=0, type_v=0, n_threads=2, verbose=False, **kw)


def test_greedy_generation_and_text_match_llama_cpp(make_gguf, converted):
    prompt = "the other one"
    llm = _llama(make_gguf("f32"))
    try:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        theirs = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            theirs.append(int(token))
            if len(theirs) == 40:
                break
        their_text = llm.detokenize(theirs).decode("utf-8", errors="replace")
    finally:
        llm.close()
    decoder = load(converted("f32"))
    assert decoder.encode(prompt) == ids
    ours = list(decoder.generate(ids, max_new_tokens=40, stop_ids=()))
    assert ours == theirs and len(ours) == 40
    assert decoder.decode(ours) == their_text


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_matches_llama_cpp(kind, make_gguf):
    path = make_gguf("q4_0", tokenizer=kind)
    tokenizer = tokenizer_from_gguf(GGUFModel(path)).tokenizer
    llm = llama_cpp_module().Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            ours = tokenizer.encode(text, add_special_tokens=False).ids
            assert ours == llm.tokenize(text.encode(), add_bos=False, special=True), text
            assert tokenizer.decode(ours, skip_special_tokens=False) == text
    finally:
        llm.close()


ADD_BOS = "tokenizer.ggml.add_bos_token"
ADD_EOS = "tokenizer.ggml.add_eos_token"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("add_bos", [True, False, None])  # None: no key, llama.cpp's default for the model
@pytest.mark.parametrize("add_eos", [False, True])
def test_prompt_tokens_add_bos_and_eos_as_llama_cpp_does(kind, add_bos, add_eos, make_gguf, tmp_path):
    """What llama-cli and llama-server feed the model for a text prompt (llama_tokenize with
    add_special and parse_special): the BOS and EOS where the GGUF (or llama.cpp's default for its
    tokenizer model) says so, and what encode gives for the same text."""
    from gguf import GGUFValueType as V
    from support.hostile import remake

    from moepass.runtime.decoder import added_tokens

    set_kv = {ADD_EOS: (add_eos, V.BOOL)}
    if add_bos is not None:
        set_kv[ADD_BOS] = (add_bos, V.BOOL)
    path = remake(make_gguf("q4_0", tokenizer=kind), tmp_path / "m.gguf", set_kv=set_kv,
                  drop_kv=() if add_bos is not None else (ADD_BOS,))
    files = tokenizer_from_gguf(GGUFModel(path))
    bos, eos = added_tokens(files.config, files.tokenizer, path)
    llm = llama_cpp_module().Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            ours = [*bos, *files.tokenizer.encode(text, add_special_tokens=False).ids, *eos]
            assert ours == llm.tokenize(text.encode(), add_bos=True, special=True), (text, bos, eos)
    finally:
        llm.close()
    assert bool(bos) == (add_bos if add_bos is not None else kind == "llama") and bool(eos) == add_eos


def test_a_text_prompt_of_a_bos_model_starts_with_its_bos(converted):
    """moepass run --prompt and the server's text prompts: the BOS that llama.cpp adds (here a
    SentencePiece vocabulary, add_bos_token true), once, also where a chat template writes it."""
    decoder = load(converted("q4_0", tokenizer="llama"))
    bos = decoder.tokenizer.token_to_id("<s>")
    ids = decoder.encode("then the other one")
    assert ids[0] == bos and ids[1:] == decoder.encode("then the other one", special=False)
    assert decoder.encode_chat("<s>then the other one") == ids


def test_sampling():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 2.9, -1.0])
    assert choose_token(logits, Sampling(), rng) == 1
    assert choose_token(logits, Sampling(temperature=1.0, top_k=1), rng) == 1
    assert choose_token(logits, Sampling(temperature=1.0, top_p=0.01), rng) == 1
    draws = [choose_token(logits, Sampling(temperature=1.0, top_k=2), rng) for _ in range(400)]
    assert set(draws) == {1, 2} and 150 < draws.count(2) < 250  # p(2) = 1 / (1 + e^0.1) = 0.475
    with pytest.raises(moepass.MoepassError, match="invalid sampling settings"):
        Sampling(top_p=0)


def test_seeded_sampling_repeats_and_stops(converted):
    decoder = load(converted("q4_0"))
    settings = Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    first = list(decoder.generate([1, 2, 3], 20, stop_ids=(), sampling=settings))
    assert first == list(decoder.generate([1, 2, 3], 20, stop_ids=(), sampling=settings))
    assert first != list(decoder.generate([1, 2, 3], 20, stop_ids=(), sampling=Sampling(0.9, 20, 0.95, seed=8)))
    greedy = list(decoder.generate([1, 2, 3], 10, stop_ids=()))
    stopped = list(decoder.generate([1, 2, 3], 10, stop_ids=(greedy[3],)))
    assert stopped == greedy[: greedy.index(greedy[3]) + 1]
    # the fixture's <|endoftext|> and <|im_end|> (tokenizer.ggml.eos_token_id): llama.cpp's end of generation
    assert decoder.stop_ids == (317, 319)


def test_text_and_chat_cli(converted):
    runner = CliRunner()
    result = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt", "the other one", "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    decoder = load(converted("q4_0"))
    assert result.stdout == "".join(decoder.generate_text("the other one", 6)) + "\n"
    chat = decoder.apply_chat_template("hi")
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    result = runner.invoke(main, ["run", str(converted("q4_0")), "--prompt", "hi", "--chat", "--max-new-tokens", "4",
                                  "--temperature", "0.7", "--seed", "3"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["run", str(converted("q4_0")), "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "exactly one of --prompt TEXT (or --prompt-file) or --prompt-ids" in result.stderr


def test_bench_cli(converted):
    result = CliRunner().invoke(main, ["bench", str(converted("q4_0")), "--prompt-tokens", "16", "--new-tokens", "4",
                                       "--repeats", "1", "--threads", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("prefill") and "tokens/s" in lines[0] and lines[2].startswith("peak RSS")
    result = CliRunner().invoke(main, ["bench", str(converted("q4_0")), "--prompt-tokens", "8", "--new-tokens", "2",
                                       "--depth", "20", "--repeats", "2", "--threads", "2", "--json", "--profile"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["decode"]["depth"] == 20 and report["prefill"]["prompt_tokens"] == 8
    assert report["decode"]["seconds_min"] <= report["decode"]["seconds_median"] <= report["decode"]["seconds_max"]
    assert report["activations"] == "int8" and report["threads"] == 2 and report["n_params"] > 0
    # llama-bench's avg_ts / stddev_ts over the two runs, recomputed from the runs' seconds
    decode = report["decode"]
    rates = [decode["tokens"] / decode["seconds_min"], decode["tokens"] / decode["seconds_max"]]
    assert decode["avg_ts"] == pytest.approx(statistics.fmean(rates))
    assert decode["stddev_ts"] == pytest.approx(statistics.stdev(rates))
    assert decode["tokens_per_s"] == pytest.approx(max(rates))
    for phase, runs in (("prefill", 3), ("decode", 16)):  # three prefills of -p tokens, 16 decode steps
        shares = report[f"{phase}_operator_shares"]
        assert {"QMoE", "MatMulNBits", "GroupQueryAttention"} <= set(shares)
        assert sum(shares.values()) == pytest.approx(1)
        where = report[f"{phase}_profile"]
        assert where["runs"] == runs  # the profiler's runs of this phase alone: one a prefill of 8 tokens
        # the parts add up: kernels by operator, by node and by layer; the executor's share is the rest
        assert sum(v["ms"] for v in where["operators"].values()) == pytest.approx(where["nodes_ms"])
        assert sum(where["node_ms"].values()) == pytest.approx(where["nodes_ms"])
        assert sum(where["layers"].values()) == pytest.approx(where["nodes_ms"])
        assert 0 < where["nodes_ms"] < where["step_ms"]
        assert where["framework_ms"] == pytest.approx(where["step_ms"] - where["nodes_ms"])
        assert where["operators"]["QMoE"]["nodes"] == pytest.approx(2)  # one a layer, two layers, per unit
        assert set(where["layers"]) == {"-1", "0", "1"} and where["node_ms"]["blk.1.moe"] > 0
    assert report["prefill_profile"]["prompt_tokens"] == 8
    assert report["decode_profile"]["steps"] == 16 and report["decode_profile"]["depth"] == 20


def test_a_model_larger_than_memory_is_refused_before_onnx_runtime_packs_it(converted, monkeypatch, tmp_path):
    """The CPU EP prepacks every QMoE node's experts into anonymous memory at 1.03-2x their bytes:
    a model past MemAvailable is refused in one line before the session (which the kernel would
    kill while packing), and loads with MOEPASS_SKIP_MEMORY_CHECK=1."""
    from moepass.core.errors import MoepassError
    from moepass.core.moe_nodes import QMOE_SLOTS, moe_nodes
    from moepass.core.quants import QMOE_CPU_HELD
    from moepass.runtime import host_memory

    model_dir = converted("q4_0")
    model = ir.load(str(model_dir / "model.onnx"))
    nodes = list(moe_nodes(model.graph))
    # Q4_0 at block 32: float32 scales everywhere (float16 ones would be held twice), no Casts
    assert {m.node.inputs[QMOE_SLOTS["fc1"][1]].dtype for m in nodes} == {ir.DataType.FLOAT}
    assert not any(n.op_type == "Cast" and n.inputs[0].is_initializer() for n in model.graph)
    experts = sum(m.bytes_per_expert * m.experts * QMOE_CPU_HELD[(m.form, "float32")][0] for m in nodes)
    need = host_memory.cpu_held_bytes(model)
    assert need == pytest.approx(experts, rel=0.01) and need > 0
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need - 1)
    with pytest.raises(MoepassError, match=r"model\.onnx: ONNX Runtime's CPU kernels would hold at least .* GiB"):
        load(model_dir, device="cpu", threads=2)
    for yes in ("1", "true", "TRUE", "yes", "on"):  # the usual spellings of true
        monkeypatch.setenv(host_memory.SKIP_ENV, yes)
        assert load(model_dir, device="cpu", threads=2).vocab_size > 0
    monkeypatch.setenv(host_memory.SKIP_ENV, "0")
    with pytest.raises(MoepassError, match="would hold at least"):
        load(model_dir, device="cpu", threads=2)
    monkeypatch.delenv(host_memory.SKIP_ENV)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need)
    assert load(model_dir, device="cpu", threads=2).vocab_size > 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1234 kB\n")
    monkeypatch.undo()
    no_cgroup = {"cgroups": tmp_path / "absent", "own": tmp_path / "absent"}
    assert host_memory.available_bytes(meminfo, **no_cgroup) == 1234 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert host_memory.available_bytes(meminfo, **no_cgroup) is None
    assert host_memory.available_bytes(tmp_path / "absent", **no_cgroup) is None


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_memory_check_reads_the_containers_limit(tmp_path, version):
    """Inside a container MemAvailable shows the host's memory: the cgroup's limit, less what it
    uses beyond reclaimable page cache, is what the process can take (the least over its parents)."""
    from moepass.runtime import host_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   20000000 kB\n")  # the host's 19 GiB
    root = tmp_path / "cgroup"
    names = host_memory._CGROUP_FILES[0 if version == "v2" else 1]
    own = tmp_path / "own"
    if version == "v2":
        own.write_text("0::/pod/box\n")
        base = root
    else:
        own.write_text("4:memory:/pod/box\n3:cpu:/x\n")
        base = root / "memory"
    for folder, limit in ((base / "pod", 3 << 30), (base / "pod" / "box", "max" if version == "v2" else 1 << 62)):
        folder.mkdir(parents=True)
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{2 << 30}\n")
        (folder / "memory.stat").write_text(f"anon 1\n{names[2]} {512 << 20}\n")
    # the pod's 3 GiB, of which 2 GiB used, 512 MiB of them page cache: 1.5 GiB left
    assert host_memory.available_bytes(meminfo, root, own) == (3 << 30) - (2 << 30) + (512 << 20)
    assert host_memory.available_bytes(meminfo, root, tmp_path / "absent") == 20000000 * 1024


def test_the_memory_check_counts_block_sum_experts_by_their_bits_and_block(converted):
    """Block-sum forms (Q4_K's int4 form: int4/b32 with its sums as extra inputs, float16 scales)
    are held as their plain form's blocks are: a 48-layer one was killed while loading (24.3 GB)
    where the check, which knew no such form, had counted its bytes once."""
    from moepass.core.moe_nodes import QMOE_SLOTS, moe_nodes
    from moepass.core.quants import QMOE_CPU_HELD
    from moepass.runtime import host_memory

    model = ir.load(str(converted("q4_k_m", expert_format="int4") / "model.onnx"))
    nodes = list(moe_nodes(model.graph))
    assert nodes and all(m.form.sums for m in nodes)
    kinds = {m.node.inputs[QMOE_SLOTS["fc1"][1]].dtype for m in nodes}
    assert kinds == {ir.DataType.FLOAT16}
    stored = sum(m.bytes_per_expert * m.experts for m in nodes)
    experts = sum(m.bytes_per_expert * m.experts * QMOE_CPU_HELD[(m.form.plain, "float16")][0] for m in nodes)
    assert host_memory.cpu_held_bytes(model) >= experts - len(nodes) and experts > 1.4 * stored  # int() per node


# ---- execution providers, offload options: every fallback and refusal ---------------------------

@pytest.fixture(scope="module")
def partitioned(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("placed") / "model"
    moepass.partition(converted("q4_0"), out, "1G", target="offload")
    return out


def test_offload_options_accepted_on_cpu(partitioned, caplog):
    with caplog.at_level(logging.WARNING, logger="moepass"):
        decoder = load(partitioned)   # mode from onnxruntime_options.json: auto
    assert decoder.plan.provider == "CPUExecutionProvider"
    assert decoder.plan.config_entries["session.moe.offload.mode"] == "auto"
    assert "session.moe.offload.node_overrides" in decoder.plan.config_entries
    assert [r.getMessage() for r in caplog.records] == ["no CUDA plugin EP: all 2 MoE layers run on the CPU"]
    logits, _ = decoder.forward(np.array([[1, 2, 3]]), decoder.empty_cache())
    assert np.isfinite(logits).all()
    plain = load(partitioned, mode="disabled")
    assert not any(k.startswith("session.moe.offload.") for k in plain.plan.config_entries)


def test_required_offload_refused_without_plugin(partitioned):
    with pytest.raises(moepass.MoepassError, match="expert offload required, but no CUDA plugin EP"):
        load(partitioned, mode="required")


def test_cuda_that_onnx_runtime_cannot_create_is_not_reported_as_cuda(converted, monkeypatch):
    """ONNX Runtime makes the session on the CPU when it cannot create the CUDA EP (a [gpu] install
    without its CUDA libraries; here: the CPU build told that the CUDA EP is available, which ends
    the same way): device='cuda' refuses, auto says so and its plan names the CPU."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(moepass.MoepassError, match="device='cuda' but ONNX Runtime could not create CUDAExecution"):
        load(converted("q4_0"), device="cuda")
    decoder = load(converted("q4_0"))
    assert decoder.session.get_providers() == ["CPUExecutionProvider"]
    assert decoder.plan.provider == "CPUExecutionProvider" and decoder.plan.providers == ["CPUExecutionProvider"]
    assert any("could not create CUDAExecutionProvider" in w for w in decoder.plan.warnings)


@pytest.fixture(scope="session")
def gpu_wheel_python(tmp_path_factory):
    """The Python of a throwaway venv holding the real onnxruntime-gpu wheel (the [gpu] extra's
    module, without its CUDA libraries; no GPU here) and moepass: the path by which ONNX Runtime
    fails to create its CUDA EP on a machine that lacks them. Skipped, saying so, where the wheel
    cannot be installed (no package index)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    venv = tmp_path_factory.mktemp("onnxruntime-gpu") / "venv"
    python = venv / "bin" / "python"
    root = Path(__file__).resolve().parents[1]
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", "onnxruntime-gpu==1.31.1", "numpy", "onnx", "onnx-ir", "gguf",
              "click", "tokenizers", "numba"],
             [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(root)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if done.returncode:
            pytest.skip(f"onnxruntime-gpu could not be installed here: {done.stderr.strip().splitlines()[-1:]}")
    yield python
    shutil.rmtree(venv, ignore_errors=True)  # 0.8 GB: not kept to the session's end


def test_a_cuda_ep_that_fails_to_load_is_refused_or_reported(gpu_wheel_python, converted, tmp_path):
    """Through the real onnxruntime-gpu 1.31.1 wheel, whose CUDA EP cannot load here: --device cuda
    exits 2 naming the library the loader could not find; auto warns and says CPUExecutionProvider."""
    import subprocess

    probe = ("import onnxruntime as o, onnx\n"
             "from onnx import helper as h, TensorProto as T\n"
             "g = h.make_graph([h.make_node('Relu', ['x'], ['y'])], 'g', [h.make_tensor_value_info('x', T.FLOAT, [1])],"
             " [h.make_tensor_value_info('y', T.FLOAT, [1])])\n"
             "m = h.make_model(g, opset_imports=[h.make_opsetid('', 17)], ir_version=10)\n"
             "print(o.InferenceSession(m.SerializeToString(), providers=['CUDAExecutionProvider']).get_providers())")
    loads = subprocess.run([str(gpu_wheel_python), "-c", probe], capture_output=True, text=True, timeout=300)
    if "CUDAExecutionProvider" in loads.stdout:
        pytest.skip("the CUDA EP loads on this machine: there is no failure to report")
    model = converted("q4_0")
    run = [str(gpu_wheel_python), "-m", "moepass.cli", "run", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    refused = subprocess.run([*run, "--device", "cuda"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    line = [x for x in refused.stderr.splitlines() if x.startswith("moepass: error:")]
    assert refused.returncode == 2 and line, refused.stderr
    assert "device='cuda' but ONNX Runtime could not create CUDAExecutionProvider (" in line[0]
    assert "cannot open shared object file" in line[0] and "made the session on the CPU" in line[0]
    ran = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "could not create CUDAExecutionProvider" in ran.stderr and "on CPUExecutionProvider" in ran.stderr
    assert "on CUDAExecutionProvider" not in ran.stderr


def test_required_layer_plan_refuses_a_cpu_fallback():
    cuda, cpu = "CUDAExecutionProvider", "CPUExecutionProvider"
    plan = SessionPlan("auto", cuda, [cuda, cpu], [], {}, "disabled", [], layer_mode="required")
    on_cpu = types.SimpleNamespace(get_providers=lambda: [cpu])
    with pytest.raises(moepass.MoepassError, match="per-layer placement required, but ONNX Runtime could not"):
        provider_in_effect(on_cpu, plan)
    assert provider_in_effect(types.SimpleNamespace(get_providers=lambda: [cuda, cpu]), plan) is plan


def test_device_and_plugin_errors(converted, tmp_path, monkeypatch):
    with pytest.raises(moepass.MoepassError, match="device='cuda' but no CUDA EP is available"):
        load(converted("q4_0"), device="cuda")
    with pytest.raises(moepass.MoepassError, match=r"nope.so: no such file or directory \(the CUDA plugin EP library\)"):
        load(converted("q4_0"), cuda_plugin=str(tmp_path / "nope.so"))
    junk = tmp_path / "libjunk.so"
    junk.write_bytes(b"not a shared library")
    monkeypatch.setenv("MOEPASS_CUDA_PLUGIN", str(junk))
    with pytest.raises(moepass.MoepassError, match=f"libjunk.so: ONNX Runtime cannot register it as {PLUGIN_EP}"):
        load(converted("q4_0"))
    assert load(converted("q4_0"), device="cpu").plan.provider == "CPUExecutionProvider"  # cpu ignores the plugin
    with pytest.raises(moepass.MoepassError, match="device must be one of auto, cpu, cuda"):
        load(converted("q4_0"), device="tpu")


def test_eligibility_rules_name_node_and_rule(converted):
    rules = [rule for node, rule in offload_violations(ir.load(converted("q4_0") / "model.onnx")) if node == "blk.0.moe"]
    assert rules == ["int4 experts need weights_prepacked=1 and block_size 32 (has weights_prepacked=0, block_size 32)",
                     "activations must be float16 or bfloat16 (are FLOAT)"]
    violations = offload_violations(ir.load(converted("f32") / "model.onnx"))
    assert violations[0] == ("blk.0.moe", "only QMoE nodes are offloaded (this is a float MoE node)")
    q8 = [rule for node, rule in offload_violations(ir.load(converted("q8_0") / "model.onnx")) if node == "blk.1.moe"]
    assert any("int8 experts are not offloaded" in r for r in q8)
    assert any("activations must be float16 or bfloat16 (are FLOAT)" in r for r in q8)


def _fake_ort(version="1.32.0", plugin=True):
    """Just enough of onnxruntime for plan_session: a plugin EP that reports one GPU device."""
    device = types.SimpleNamespace(ep_name=PLUGIN_EP)
    return types.SimpleNamespace(
        __version__=version, register_execution_provider_library=lambda name, path: None,
        get_ep_devices=lambda: [device] if plugin else [], get_available_providers=lambda: ["CPUExecutionProvider"])


def test_plugin_path_required_and_auto(converted, tmp_path, caplog):
    library = tmp_path / "libonnxruntime_providers_cuda_plugin.so"
    library.write_bytes(b"")
    model = ir.load(converted("q4_0") / "model.onnx")
    with pytest.raises(moepass.MoepassError,
                       match="node blk.0.moe cannot be offloaded: int4 experts need weights_prepacked=1"):
        plan_session(_fake_ort(), model, {}, cuda_plugin=str(library), mode="required")
    with caplog.at_level(logging.WARNING, logger="moepass"):
        plan = plan_session(_fake_ort(), model, {}, cuda_plugin=str(library), mode="auto")
    assert plan.provider == PLUGIN_EP and plan.config_entries["session.moe.offload.mode"] == "auto"
    assert caplog.records[-1].getMessage().startswith("2 of 2 MoE layers cannot be offloaded (blk.0.moe: int4 experts")
    with pytest.raises(moepass.MoepassError, match="registered as CudaPluginExecutionProvider, but it reports no device"):
        plan_session(_fake_ort(plugin=False), model, {}, cuda_plugin=str(library))


def test_old_onnxruntime(converted, caplog):
    model = ir.load(converted("q4_0") / "model.onnx")
    entries = {"session.moe.offload.mode": "auto", "session.moe.offload.placement": "static"}
    with pytest.raises(moepass.MoepassError, match="ONNX Runtime 1.31.1 predates the session.moe.offload"):
        plan_session(_fake_ort("1.31.1"), model, entries, mode="required")
    with caplog.at_level(logging.WARNING, logger="moepass"):
        plan = plan_session(_fake_ort("1.31.1"), model, entries)
    assert plan.config_entries == {}
    assert "predates the session.moe.offload.* options (needs 1.32): all 2 MoE layers run on the CPU" in \
        caplog.records[-1].getMessage()


# ---- onnxruntime-genai -----------------------------------------------------------------------------

def _genai_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime-genai's greedy tokens after `prompt` (an og.Model)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


@pytest.mark.parametrize("preset,arch", [("f32", "qwen3moe"), ("q4_0", "qwen3moe"), ("q4_0", "gpt-oss"),
                                         ("q4_0", "deepseek2"), ("q4_0", "deepseek2-kv_b")])
def test_onnxruntime_genai_generates_the_same_tokens(preset, arch, converted):
    """genai_config.json describes the KV cache as the graph holds it (deepseek2: the compressed one)."""
    import onnxruntime_genai as og

    theirs = _genai_greedy(og.Model(str(converted(preset, arch=arch))), [5, 77, 200], 20)
    assert theirs == list(load(converted(preset, arch=arch)).generate([5, 77, 200], 20, stop_ids=()))


def test_onnxruntime_genai_takes_the_offload_options(partitioned):
    import onnxruntime_genai as og

    config = json.loads((partitioned / "genai_config.json").read_text())
    session = config["model"]["decoder"]["session_options"]
    assert session["session.moe.offload.mode"] == "auto" and "session.moe.offload.node_overrides" in session
    og.Model(str(partitioned))  # ONNX Runtime validates the entries as genai passes them on


def test_a_per_layer_plans_genai_config_names_cuda(converted, tmp_path):
    """onnxruntime-genai-cuda puts a per-layer plan on the GPU from its genai_config.json; on a CPU
    build (here) the same folder runs once its providers are cleared, with the plan's entries, and
    gives the source's greedy tokens."""
    import onnxruntime_genai as og

    placed = moepass.partition(converted("q4_0"), tmp_path / "placed", "8G", target="layers",
                               calibrate=False).output_dir
    session = json.loads((placed / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert session["provider_options"] == [{"cuda": {}}] and "session.layer_assignment_settings" in session
    config = og.Config(str(placed))
    config.clear_providers()
    tokens = _genai_greedy(og.Model(config), [5, 77, 200], 20)
    assert tokens == list(load(converted("q4_0")).generate([5, 77, 200], 20, stop_ids=()))
    offload = json.loads((moepass.partition(converted("q4_0"), tmp_path / "offload", "8G", target="offload",
                                            calibrate=False).output_dir / "genai_config.json").read_text())
    assert offload["model"]["decoder"]["session_options"]["provider_options"] == []


def test_io_bound_generation_equals_plain_forward_steps(converted):
    decoder = load(converted("q4_0"))
    logits, cache = decoder.forward(np.array([[5, 77, 200]]), decoder.empty_cache())
    plain = []
    for _ in range(12):
        plain.append(int(np.argmax(logits[0, -1])))
        logits, cache = decoder.forward(np.array([[plain[-1]]]), cache)
    assert list(decoder.generate([5, 77, 200], 12, stop_ids=())) == plain
    # the growing cache other execution providers keep (present bound as the next past): the same
    decoder.plan = dataclasses.replace(decoder.plan, provider="OtherExecutionProvider")
    assert list(decoder.generate([5, 77, 200], 12, stop_ids=())) == plain


def test_long_prompts_are_prefilled_in_chunks(converted, monkeypatch):
    """A prompt longer than PREFILL_CHUNK goes in several steps into the shared KV cache: the same
    next-token logits as one plain forward over the whole prompt, to float32 rounding in float
    arithmetic (attention adds each chunk's scores and values in another order; measured 1e-6)
    and within tests/support/bounds.py's int8 rerun bound with int8 activations."""
    import moepass.runtime as runtime
    import moepass.runtime.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "PREFILL_CHUNK", 16)
    calls = []
    original = runtime.KVCache._step
    monkeypatch.setattr(runtime.KVCache, "_step", lambda self, ids, keep: calls.append(len(ids)) or original(self, ids, keep))
    last = {}
    for activations in ("float", "int8"):
        decoder = load(converted("q4_0", activations=activations))
        prompt = np.random.default_rng(0).integers(0, decoder.vocab_size, 40).tolist()
        whole, _ = decoder.forward(np.array([prompt]), decoder.empty_cache())
        last[activations] = whole[0, -1], runtime.KVCache(decoder, capacity=41).run(prompt)
    assert calls == [16, 16, 8] * 2
    (whole_f, chunked_f), (whole_8, chunked_8) = last["float"], last["int8"]
    float_bound = float_rounding_bound(whole_f, stages=3)
    assert_within(chunked_f, whole_f, float_bound, "float activations")
    assert_within(chunked_8, whole_8, int8_rerun_bound(whole_8, whole_f, float_bound), "int8 activations")


def test_text_refusals(make_gguf, tmp_path):
    spm = moepass.convert(make_gguf("q4_0", tokenizer="llama"), tmp_path / "spm").output_dir
    with pytest.raises(moepass.MoepassError, match="the model has no chat template"):
        load(spm).apply_chat_template("hi")
    bare = moepass.convert(make_gguf("q4_0", omit_keys=("tokenizer.ggml.model",)), tmp_path / "bare")
    assert bare.tokenizer["reason"] == "the GGUF has no tokenizer metadata"
    assert "none written: the GGUF has no tokenizer metadata (token ids only)" in "\n".join(bare.summary_lines())
    with pytest.raises(moepass.MoepassError, match="tokenizer.json: no tokenizer beside the model; use token ids"):
        load(bare.output_dir).encode("hello")


@pytest.mark.parametrize("template,why", [
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),      # reaching Python's internals
    ("{{ ''.__class__.__base__.__subclasses__() }}", "SecurityError"),
    ("{% for m in messages %}{{ m.content.__class__ }}{% endfor %}", "SecurityError"),
    ("{{ messages.append('x') }}", "SecurityError"),                                   # mutation
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),                  # broken
    ("{{ no_such_variable.field }}", "UndefinedError"),                              # reaching into nothing
])
def test_chat_templates_render_in_a_sandbox(template, why, converted, tmp_path):
    """A GGUF's chat template is the model file's code: rendered in jinja2's immutable sandbox, and
    anything it may not do, or a broken template, is one clear error naming the file."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(converted("q4_0"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    with pytest.raises(moepass.MoepassError, match=f"tokenizer_config.json: the chat template cannot be rendered "
                                                   f"\\({why}"):
        load(folder).apply_chat_template("hi")


def test_generation_stops_at_the_context_length(converted, caplog):
    decoder = load(converted("q4_0"))
    context = decoder.context_length
    assert context == 512
    with pytest.raises(moepass.MoepassError, match=f"the prompt has {context} tokens; the model's context holds 512"):
        list(decoder.generate([5] * context, 4))
    with caplog.at_level(logging.WARNING, logger="moepass"):
        tokens = list(decoder.generate([5] * (context - 3), 10, stop_ids=()))
    assert len(tokens) == 3 and "generation stops after 3 new tokens, at the model's (512)" in caplog.text


def test_run_prints_prompt_and_generation_rates_as_llama_cli(converted):
    """llama-cli's two lines after a generation: the prompt's computation and the tokens after the
    first, each with ms, ms per token and tokens per second, for text and token-id prompts."""
    import re

    line = r"{what}\s+[\d.]+ ms /\s+{n} {unit}\s+\(\s*[\d.]+ ms per token,\s+[\d.]+ tokens per second\)"
    model = converted("q4_0")
    for prompt in (["--prompt-ids", "1,2,3"], ["--prompt", "the other one"]):
        result = CliRunner().invoke(main, ["run", str(model), *prompt, "-n", "5"])
        assert result.exit_code == 0, result.output
        generated = int(re.search(r"(\d+) tokens in", result.stderr).group(1))
        prompt_n = 3 if prompt[0] == "--prompt-ids" else len(load(model).encode("the other one"))
        assert re.search(line.format(what="prompt eval", n=prompt_n, unit="tokens"), result.stderr), result.stderr
        if generated > 1:
            assert re.search(line.format(what="eval", n=generated - 1, unit="runs"), result.stderr), result.stderr
