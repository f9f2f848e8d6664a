"""The hostile-input corpus: damaged GGUF and ONNX files, bad options, bad output paths, bad profiles.

Every case runs the CLI in-process and holds it to the README's promise: bad input ends with exit
status 2 and one line `moepass: error: ...` naming the culprit (valid input: exit 0, warnings
allowed), never a traceback; nothing is left beside the output path, and an output that existed
before is unchanged. The corpus is built from the test fixtures at test time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from support.hostile import V, f16, f32, patch, remake, tensor_info_offset, u32, u64, value_offset
from moepass.cli import main

ARCH = "qwen3moe"


@dataclasses.dataclass
class Env:
    """What a case can build from: the fixture GGUF, its conversion, a profile, a scratch folder."""

    tmp: Path
    gguf: Path
    model: Path
    profile: Path
    tiny96: Path  # a GGUF whose hidden size (96) the prepacked offload layout cannot tile

    def bad_gguf(self, **remake_args) -> Path:
        return remake(self.gguf, self.tmp / "bad.gguf", **remake_args)

    def copy_gguf(self, name: str = "bad.gguf") -> Path:
        return Path(shutil.copy(self.gguf, self.tmp / name))

    def copy_model(self) -> Path:
        return Path(shutil.copytree(self.model, self.tmp / "model"))

    def write(self, name: str, data: bytes | str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
        return path


@dataclasses.dataclass
class Case:
    id: str
    args: Callable[[Env], list[str]]
    says: tuple[str, ...] = ()
    exit: int = 2
    out: str | None = None   # the output path (relative to the case folder) that must not appear or change


CASES: list[Case] = []


def case(id: str, args: Callable[[Env], list[str]], *says: str, exit: int = 2, out: str | None = None) -> None:
    CASES.append(Case(id, args, tuple(says), exit, out))


def convert_case(id: str, make_input: Callable[[Env], Path], *says: str, exit: int = 2, extra=()) -> None:
    case(id, lambda env: ["convert", str(make_input(env)), "-o", str(env.tmp / "out"), "-q", *extra], *says,
         exit=exit, out="out")


# ---- 1. metadata of the wrong type or out of range -----------------------------------------------

INT_KEYS = ["block_count", "embedding_length", "context_length", "attention.head_count", "attention.head_count_kv",
            "expert_count", "expert_used_count", "expert_feed_forward_length"]
BAD_INTS = {"string": ("8", V.STRING), "float": (2.5, V.FLOAT32), "bool": (True, V.BOOL), "zero": (0, V.UINT32),
            "huge": (1 << 40, V.UINT64), "negative": (-1, V.INT32), "array": ([8], V.ARRAY, V.UINT32)}
for _key in INT_KEYS:
    for _what, _value in BAD_INTS.items():
        _full = f"{ARCH}.{_key}"
        convert_case(f"meta-{_key}-{_what}", lambda env, k=_full, v=_value: env.bad_gguf(set_kv={k: v}), f"'{_full}'")

FLOAT_KEYS = {"attention.layer_norm_rms_epsilon": [math.nan, math.inf, -1e-6, 2.0],
              "rope.freq_base": [math.nan, math.inf, 0.0, -1e4, 1.4e-45, 0.5]}
for _key, _values in FLOAT_KEYS.items():
    _full = f"{ARCH}.{_key}"
    for _value in _values:
        convert_case(f"meta-{_key}-{_value}", lambda env, k=_full, v=_value: env.bad_gguf(set_kv={k: (v, V.FLOAT32)}),
                     f"'{_full}'")
    convert_case(f"meta-{_key}-string", lambda env, k=_full: env.bad_gguf(set_kv={k: ("1e-6", V.STRING)}), f"'{_full}'")
convert_case("meta-context-2^30", lambda env: env.bad_gguf(set_kv={f"{ARCH}.context_length": (1 << 30, V.UINT32)}),
             f"'{ARCH}.context_length'")
convert_case("meta-context-tables-outweigh-the-model",
             lambda env: env.bad_gguf(set_kv={f"{ARCH}.context_length": (16_000_000, V.UINT32)}), "--context N")
convert_case("meta-context-chosen-by-the-user",
             lambda env: env.bad_gguf(set_kv={f"{ARCH}.context_length": (16_000_000, V.UINT32)}), exit=0,
             extra=("--context", "1024"))
convert_case("meta-more-blocks-than-tensors",
             lambda env: env.bad_gguf(set_kv={f"{ARCH}.block_count": (458_754, V.UINT32)}), "tensors for 2 blocks")
convert_case("meta-used-more-than-experts",
             lambda env: env.bad_gguf(set_kv={f"{ARCH}.expert_used_count": (9, V.UINT32)}), "expert_used_count 9")
convert_case("meta-kv-heads-not-divisor",
             lambda env: env.bad_gguf(set_kv={f"{ARCH}.attention.head_count_kv": (3, V.UINT32)}), "kv heads")
convert_case("meta-architecture-int", lambda env: env.bad_gguf(set_kv={"general.architecture": (7, V.UINT32)}),
             "'general.architecture'")
for _what, _value in {"zero": (0, V.UINT32), "three": (3, V.UINT32), "string": ("32", V.STRING),
                      "huge": (1 << 31, V.UINT32)}.items():
    convert_case(f"meta-alignment-{_what}", lambda env, v=_value: env.bad_gguf(set_kv={"general.alignment": v}),
                 "'general.alignment'")
convert_case("meta-valid-alignment-64", lambda env: env.bad_gguf(alignment=64), exit=0)
convert_case("option-threads-zero", lambda env: env.gguf, "--threads", extra=("--threads", "0"))
convert_case("option-threads-capped", lambda env: env.gguf, exit=0, extra=("--threads", "100000"))
convert_case("meta-unknown-extra-key", lambda env: env.bad_gguf(set_kv={"x.y": ([1.5], V.ARRAY, V.FLOAT32)}), exit=0)


# ---- 2. structural damage -------------------------------------------------------------------------

def _tensor_patch(name: str, part: str, data: Callable[[int], bytes]):
    def make(env: Env) -> Path:
        bad = env.copy_gguf()
        at, size = tensor_info_offset(bad, name, part)
        current = int.from_bytes(bad.read_bytes()[at:at + size], "little")
        return patch(bad, at, data(current))
    return make


def _truncated(fraction: float | None = None, size: int | None = None):
    def make(env: Env) -> Path:
        data = env.gguf.read_bytes()
        n = size if size is not None else int(len(data) * fraction)
        return env.write("cut.gguf", data[:n])
    return make


EXPERT = "blk.0.ffn_up_exps.weight"
convert_case("struct-offset-misaligned", _tensor_patch(EXPERT, "offset", lambda o: u64(o + 1)), f"'{EXPERT}'",
             "alignment")
convert_case("struct-offset-overlaps", _tensor_patch(EXPERT, "offset", lambda o: u64(o + 32)), "overlap")
convert_case("struct-offset-into-next", _tensor_patch(EXPERT, "offset", lambda o: u64(max(o - 32, 0))), "overlap")
convert_case("struct-offset-huge", _tensor_patch(EXPERT, "offset", lambda o: u64(1 << 62)), f"'{EXPERT}'")
convert_case("struct-ndims-zero", _tensor_patch(EXPERT, "n_dims", lambda n: u32(0)), "bad.gguf")
convert_case("struct-ndims-nine", _tensor_patch(EXPERT, "n_dims", lambda n: u32(9)), "bad.gguf")
convert_case("struct-dim-zero", _tensor_patch(EXPERT, "dims", lambda d: u64(0) * 3), f"'{EXPERT}'")
convert_case("struct-type-unknown", _tensor_patch(EXPERT, "type", lambda t: u32(99)), f"'{EXPERT}'", "type 99")
convert_case("struct-type-swapped", _tensor_patch(EXPERT, "type", lambda t: u32(8)), f"'{EXPERT}'")  # Q4_0 -> Q8_0
convert_case("struct-duplicate-name", _tensor_patch("blk.0.attn_q.weight", "name", lambda n: b"blk.0.attn_k.weight"),
             "'blk.0.attn_k.weight'", "twice")
convert_case("struct-name-not-utf8", _tensor_patch("blk.0.attn_q.weight", "name", lambda n: b"\xff" * 19), "bad.gguf")
convert_case("struct-version-99", lambda env: patch(env.copy_gguf(), 4, u32(99)), "version 99")
convert_case("struct-version-1", lambda env: patch(env.copy_gguf(), 4, u32(1)), "version 1")
convert_case("struct-tensor-count-huge", lambda env: patch(env.copy_gguf(), 8, u64(1 << 40)), "bad.gguf")
convert_case("struct-tensor-count-plus-one",
             lambda env: patch(env.copy_gguf(), 8, u64(int.from_bytes(env.gguf.read_bytes()[8:16], "little") + 1)),
             "bad.gguf")
convert_case("struct-kv-count-huge", lambda env: patch(env.copy_gguf(), 16, u64(1 << 40)), "bad.gguf")
convert_case("struct-key-length-huge", lambda env: patch(env.copy_gguf(), 24, u64(1 << 50)), "bad.gguf")
convert_case("struct-value-type-unknown",
             lambda env: patch(env.copy_gguf(), value_offset(env.gguf, "general.name")[0] - 12, u32(99)), "bad.gguf")
def _merges_array(item_type: int, count):
    def make(env: Env) -> Path:
        import struct
        bad = env.copy_gguf()
        at = _array_header(env.gguf, "tokenizer.ggml.merges")
        data = bad.read_bytes()
        return patch(bad, at, struct.pack("<IQ", item_type, count(len(data) - at)))
    return make


def _array_header(path: Path, key: str) -> int:
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    part = reader.fields[key].parts[2]  # key length, key, value type, then item type and count
    return int(part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]) + 4


convert_case("struct-array-count-huge", _merges_array(0, lambda left: 1 << 31), "corrupt array length")
convert_case("struct-array-count-beyond-file", _merges_array(8, lambda left: left // 8 + 1), "corrupt array length")
convert_case("struct-array-uint8-to-the-end", _merges_array(0, lambda left: left - 200), "bad.gguf")


def _token_length(length):
    def make(env: Env) -> Path:
        bad = env.copy_gguf()
        at = _array_header(env.gguf, "tokenizer.ggml.tokens") + 12   # the first token's length
        return patch(bad, at, u64(length(len(bad.read_bytes()) - at)))
    return make


convert_case("struct-string-past-the-end", _token_length(lambda left: left), "corrupt string length")
convert_case("struct-string-huge", _token_length(lambda left: 1 << 62), "corrupt string length")
for _n in (0, 3, 8, 20, 100, 1000):
    convert_case(f"struct-truncated-{_n}-bytes", _truncated(size=_n), "cut.gguf")
for _f in (0.1, 0.5, 0.9, 0.999):
    convert_case(f"struct-truncated-{_f}", _truncated(fraction=_f), "cut.gguf")
convert_case("struct-empty-file", lambda env: env.write("empty.gguf", b""), "empty.gguf")
convert_case("struct-directory-named-gguf", lambda env: (env.tmp / "dir.gguf").mkdir() or env.tmp / "dir.gguf",
             "dir.gguf")
convert_case("struct-trailing-garbage", lambda env: env.write("long.gguf", env.gguf.read_bytes() + b"\0" * 100),
             exit=0)


# ---- 3. non-finite weights ------------------------------------------------------------------------

def _raw_edit(name: str, at: int, data: bytes):
    def edit(raw: np.ndarray) -> np.ndarray:
        raw = raw.copy()
        raw[at:at + len(data)] = np.frombuffer(data, np.uint8)
        return raw
    return lambda env: env.bad_gguf(tensors={name: edit})


for _name, _at, _data, _what in [
        ("blk.0.attn_norm.weight", 4, f32(math.nan), "nan-f32"),
        ("output_norm.weight", 0, f32(math.inf), "inf-f32"),
        ("blk.1.ffn_gate_inp.weight", 40, f32(-math.inf), "inf-router"),
        ("blk.0.ffn_up_exps.weight", 18 * 5, f16(math.nan), "nan-q4_0-scale"),
        ("blk.1.ffn_down_exps.weight", 0, f16(math.inf), "inf-q4_0-scale"),
        ("output.weight", 34 * 3, f16(math.nan), "nan-q8_0-scale"),
        ("token_embd.weight", 0, f16(-math.inf), "inf-embedding-scale")]:
    convert_case(f"finite-{_what}", _raw_edit(_name, _at, _data), f"'{_name}'", "non-finite")
convert_case("finite-allowed-on-request", _raw_edit("blk.0.attn_norm.weight", 4, f32(math.nan)), exit=0,
             extra=("--allow-non-finite",))
convert_case("finite-nan-in-q4_0-codes-is-fine", _raw_edit("blk.0.ffn_up_exps.weight", 2, b"\xff\xff"), exit=0)


# ---- 4. tokenizer problems: the weights still convert, the tokenizer is repaired or skipped ------

def _merges(env: Env) -> list[str]:
    from gguf import GGUFReader
    return list(GGUFReader(str(env.gguf)).fields["tokenizer.ggml.merges"].contents())


TOKENIZER_CASES = {
    "merge-result-unknown": lambda env: {"tokenizer.ggml.merges": (_merges(env) + ["zz qq"], V.ARRAY, V.STRING)},
    "merge-without-space": lambda env: {"tokenizer.ggml.merges": (_merges(env) + ["nospace"], V.ARRAY, V.STRING)},
    "bos-id-string": lambda env: {"tokenizer.ggml.bos_token_id": ("1", V.STRING)},
    "eos-id-out-of-vocab": lambda env: {"tokenizer.ggml.eos_token_id": (1 << 30, V.UINT32)},
    "add-bos-string": lambda env: {"tokenizer.ggml.add_bos_token": ("false", V.STRING)},
    "tokens-not-strings": lambda env: {"tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY, V.UINT32)},
    "token-type-short": lambda env: {"tokenizer.ggml.token_type": ([1, 1], V.ARRAY, V.INT32)},
    "model-unknown": lambda env: {"tokenizer.ggml.model": ("wordpiece9", V.STRING)},
    "pre-unknown": lambda env: {"tokenizer.ggml.pre": ("nobody", V.STRING)},
    "model-not-string": lambda env: {"tokenizer.ggml.model": (5, V.UINT32)},
    "template-not-string": lambda env: {"tokenizer.chat_template": (5, V.UINT32)},
}
for _what, _kv in TOKENIZER_CASES.items():
    convert_case(f"tokenizer-{_what}", lambda env, kv=_kv: env.bad_gguf(set_kv=kv(env)), "tokenizer", exit=0)


def _token_list(env: Env, change: int) -> dict:
    """The fixture's token list `change` tokens shorter (negative) or longer, with its types."""
    from gguf import GGUFReader
    fields = GGUFReader(str(env.gguf)).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    tokens = tokens[:change] if change < 0 else tokens + [f"<extra_{i}>" for i in range(change)]
    types = types[:change] if change < 0 else types + [1] * change
    return {"tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING), "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32)}


# a token list that is not one token per row of token_embd: another model's tokenizer (llama.cpp refuses it)
for _change in (-3, 50):
    convert_case(f"tokens-{_change:+d}-against-embedding-rows",
                 lambda env, c=_change: env.bad_gguf(set_kv=_token_list(env, c)),
                 "'tokenizer.ggml.tokens' lists", "'token_embd.weight' has")


# ---- 5. chat templates run in a sandbox ------------------------------------------------------------

def _chat(template: str):
    def args(env: Env) -> list[str]:
        gguf = env.bad_gguf(set_kv={"tokenizer.chat_template": (template, V.STRING)})
        out = env.tmp / "chat-model"
        result = CliRunner().invoke(main, ["convert", str(gguf), "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        return ["run", str(out), "--prompt", "hi", "--chat", "--max-new-tokens", "2"]
    return args


for _what, _template, _says in [
        ("reaches-subclasses", "{{ ''.__class__.__mro__[1].__subclasses__() }}", ("chat template", "unsafe")),
        ("reaches-globals", "{{ cycler.__init__.__globals__ }}", ("chat template",)),
        ("mutates", "{% set x = [] %}{{ x.append(1) }}", ("chat template",)),
        ("syntax-error", "{% if %}", ("chat template",)),
        ("raises", "{{ raise_exception('no system role') }}", ("chat template",)),
        ("undefined", "{{ nothing.here }}", ("chat template",)),
        ("loops-forever", "{% for i in range(10**12) %}{{ i }}{% endfor %}", ("chat template",))]:
    case(f"template-{_what}", _chat(_template), *_says)
case("template-valid", _chat("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"), exit=0)


# ---- 6. ONNX input --------------------------------------------------------------------------------

def _with_model(edit: Callable[[Env, Path], None]) -> Callable[[Env], Path]:
    def make(env: Env) -> Path:
        model = env.copy_model()
        edit(env, model)
        return model
    return make


def _external_location(location: str) -> Callable[[Env, Path], None]:
    def edit(env: Env, model: Path) -> None:
        import onnx
        proto = onnx.load(model / "model.onnx", load_external_data=False)
        for init in proto.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location
                    break
            else:
                continue
            break
        onnx.save(proto, model / "model.onnx")
    return edit


def _shorten_data(env: Env, model: Path) -> None:
    data = model / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _outside_link(env: Env, model: Path) -> None:
    outside = env.tmp / "elsewhere.data"
    shutil.copy(model / "model.onnx.data", outside)
    (model / "model.onnx.data").unlink()
    (model / "model.onnx.data").symlink_to(outside)


ONNX_DAMAGE = {
    "empty-model-file": lambda env, m: (m / "model.onnx").write_bytes(b""),
    "random-model-file": lambda env, m: (m / "model.onnx").write_bytes(np.random.default_rng(0).bytes(4096)),
    "missing-data": lambda env, m: (m / "model.onnx.data").unlink(),
    "short-data": _shorten_data,
    "location-absolute": _external_location("/etc/passwd"),
    "location-parent": _external_location("../../model.onnx.data"),
    "location-symlink-out": _outside_link,
}
for _what, _edit in ONNX_DAMAGE.items():
    for _command in ("inspect", "run", "partition", "convert", "profile"):
        def _args(env, edit=_edit, command=_command):
            model = _with_model(edit)(env)
            return {"inspect": ["inspect", str(model)],
                    "run": ["run", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "1"],
                    "partition": ["partition", str(model), "--vram", "1G", "-o", str(env.tmp / "out")],
                    "convert": ["convert", str(model), "-o", str(env.tmp / "out"), "-q"],
                    "profile": ["profile", str(model), "--prompt-ids", "1,2", "-o", str(env.tmp / "out")]}[command]
        case(f"onnx-{_what}-{_command}", _args, "model", out="out")
case("onnx-empty-onnx-file-inspect", lambda env: ["inspect", str(env.write("empty.onnx", b""))], "empty.onnx")
case("onnx-converted-folder-convert", lambda env: ["convert", str(env.model), "-o", str(env.tmp / "out"), "-q"],
     exit=0)


# ---- 7. outputs ------------------------------------------------------------------------------------

def _convert_to(make_out: Callable[[Env], str], *extra: str):
    return lambda env: ["convert", str(env.gguf), "-o", make_out(env), "-q", *extra]


def _existing_file(env: Env) -> str:
    return str(env.write("out", "user data"))


def _symlink_to_dir(env: Env) -> str:
    (env.tmp / "target").mkdir()
    (env.tmp / "target" / "mine.txt").write_text("keep")
    (env.tmp / "out").symlink_to(env.tmp / "target")
    return str(env.tmp / "out")


def _dangling(env: Env) -> str:
    (env.tmp / "out").symlink_to(env.tmp / "nowhere")
    return str(env.tmp / "out")


def _input_itself(env: Env) -> str:
    return str(shutil.copy(env.gguf, env.tmp / "out"))


def _foreign_folder(env: Env) -> str:
    env.write("out/notes.txt", "mine")
    env.write("out/sub/precious.txt", "mine too")
    return str(env.tmp / "out")


def _converted_with_a_foreign_file(env: Env) -> str:
    out = env.tmp / "out"
    result = CliRunner().invoke(main, ["convert", str(env.gguf), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    env.write("out/notes.txt", "mine")
    return str(out)


def _foreign_report(env: Env) -> str:
    env.write("out/model.onnx", "not a model")
    env.write("out/moepass.json", '{"written by": "someone else"}')
    return str(env.tmp / "out")


case("out-existing-file", _convert_to(_existing_file), "is a file, and the output is a folder", out="out")
# --force replaces a folder moepass wrote, never one holding anything else (the user's files)
case("out-foreign-folder-force", _convert_to(_foreign_folder, "--force"),
     "--force replaces only a folder that moepass wrote", "it holds 'notes.txt'", out="out")
case("out-converted-plus-foreign-file-force", _convert_to(_converted_with_a_foreign_file, "--force"),
     "it holds 'notes.txt', which moepass does not write", out="out")
case("out-foreign-report-force", _convert_to(_foreign_report, "--force"), "its moepass.json is not moepass's",
     out="out")
case("out-existing-file-force", _convert_to(_existing_file, "--force"), "is a file, and the output is a folder",
     out="out")
case("out-symlink", _convert_to(_symlink_to_dir), "already exists", out="out")
case("out-symlink-force", _convert_to(_symlink_to_dir, "--force"), "symbolic link", out="out")
case("out-dangling-symlink", _convert_to(_dangling), "already exists", out="out")
case("out-is-input", lambda env: ["convert", _input_itself(env), "-o", str(env.tmp / "out"), "-q", "--force"],
     "input", out="out")
case("out-contains-input", lambda env: ["convert", str(shutil.copy(env.gguf, env.write("sub/x", "").parent)),
                                        "-o", str(env.tmp / "sub"), "-q", "--force"], "input", out="sub")
case("out-dot", lambda env: ["convert", str(env.gguf), "-o", ".", "-q"], "current directory")
case("out-dot-force", lambda env: ["convert", str(env.gguf), "-o", ".", "-q", "--force"], "current directory")
case("out-root", lambda env: ["convert", str(env.gguf), "-o", "/", "-q", "--force"], "'/'")
case("out-grandparent-is-file", _convert_to(lambda env: str(env.write("a", "a file") / "b" / "out")),
     "is a file, not a directory")
case("out-parent-is-file", _convert_to(lambda env: str(env.write("file", "x") / "out")), "file")
case("out-unwritable", _convert_to(lambda env: "/proc/moepass-out"), "/proc/moepass-out")
case("out-empty-dir-ok", _convert_to(lambda env: (env.tmp / "out").mkdir() or str(env.tmp / "out")), exit=0)
case("out-stale-temporary-swept", lambda env: (
    (env.tmp / ".out.tmp-999999999-abc").mkdir(),
    ["convert", str(env.gguf), "-o", str(env.tmp / "out"), "-q"])[1], exit=0)
case("profile-out-is-dir", lambda env: ["profile", str(env.model), "--prompt-ids", "1,2",
                                         "-o", str((env.tmp / "d").mkdir() or env.tmp / "d")], "directory")
case("report-out-exists", lambda env: ["partition", str(env.model), "--vram", "1G", "-o", str(env.tmp / "out"),
                                       "--report", str(env.write("plan.png", b"mine"))], "already exists", out="out")


# ---- 8. partition ------------------------------------------------------------------------------------

def _partition(*extra: str, profile: Callable[[Env], str] | None = None):
    def args(env: Env) -> list[str]:
        more = ["--profile", profile(env)] if profile else []
        return ["partition", str(env.model), "-o", str(env.tmp / "out"), *extra, *more]
    return args


def _edited_profile(edit: Callable[[dict], None]) -> Callable[[Env], str]:
    def make(env: Env) -> str:
        data = json.loads(env.profile.read_text())
        edit(data)
        return str(env.write("edited.json", json.dumps(data)))
    return make


def _first_node(data: dict) -> dict:
    return data["nodes"][data["model"]["moe_nodes"][0]["node"]]


for _vram, _says in [("8", "unit"), ("1" * 400, "--vram"), ("-1G", "--vram"), ("nanG", "--vram"), ("infG", "--vram"),
                     ("1e999G", "--vram"), ("abc", "--vram"), ("0G", "--vram"), ("8XB", "--vram"), ("", "--vram")]:
    case(f"partition-vram-{_vram[:12] or 'empty'}", _partition("--vram", _vram), _says, out="out")
for _option in ("--gpu-bandwidth", "--host-bandwidth", "--pcie-bandwidth"):
    for _value in ("0", "nan", "inf", "-5"):
        case(f"partition{_option}-{_value}", _partition("--vram", "1G", _option, _value), _option, out="out")
case("partition-reserve-nonsense", _partition("--vram", "1G", "--reserve", "lots"), "--reserve", out="out")
case("partition-reserve-above-vram", _partition("--vram", "1G", "--reserve", "2G"),
     "reserve", out="out")
for _what, _edit, _says in [
        ("counts-infinite", lambda d: _first_node(d).__setitem__("weight", [math.inf] * 8), "non-finite"),
        ("counts-2^70", lambda d: _first_node(d).__setitem__("selected", [1 << 70] * 8), "malformed"),
        ("counts-edited", lambda d: _first_node(d)["selected"].__setitem__(0, _first_node(d)["selected"][0] + 5),
         "tokens"),
        ("top-k-edited", lambda d: d["model"]["moe_nodes"][0].__setitem__("top_k", 3), "profile"),
        ("counts-negative", lambda d: _first_node(d)["selected"].__setitem__(0, -1), "negative"),
        ("tokens-float", lambda d: d.__setitem__("tokens", 2.5), "tokens"),
        ("counts-strings", lambda d: _first_node(d).__setitem__("selected", ["a"] * 8), "profile"),
        ("tokens-negative", lambda d: d.__setitem__("tokens", -3), "tokens"),
        ("fingerprint-other", lambda d: d["model"].__setitem__("fingerprint", "0" * 64), "another model"),
        ("list-not-object", lambda d: d.clear(), "popularity")]:
    case(f"partition-profile-{_what}", _partition("--vram", "1G", profile=_edited_profile(_edit)), _says, out="out")
case("partition-profile-not-json", _partition("--vram", "1G", profile=lambda env: str(env.write("p.json", "{"))),
     "p.json", out="out")
case("partition-profile-array", _partition("--vram", "1G", profile=lambda env: str(env.write("p.json", "[1]"))),
     "p.json", out="out")
case("partition-data-truncated", lambda env: ["partition", str(_with_model(_shorten_data)(env)), "--vram", "1G", "-o",
                                              str(env.tmp / "out")], "model.onnx.data", out="out")
for _content in ("{", "[]", '{"model": 1}'):
    case(f"partition-genai-config-{_content}", lambda env, c=_content: [
        "partition", str(_with_model(lambda e, m: (m / "genai_config.json").write_text(c))(env)), "--vram", "1G",
        "-o", str(env.tmp / "out")], "genai_config.json", out="out")
case("partition-valid", _partition("--vram", "1G"), exit=0, out=None)


# ---- 9. run / bench / inspect ---------------------------------------------------------------------------

def _run(*extra: str, model: Callable[[Env], Path] | None = None):
    return lambda env: ["run", str(model(env) if model else env.model), "--prompt-ids", "1,2", *extra]


for _option, _value in [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
                        ("--top-p", "nan"), ("--top-p", "1.5"), ("--top-k", "-1"), ("--seed", "-2"),
                        ("--seed", str(1 << 70)), ("--max-new-tokens", "-2"), ("--threads", "0"),
                        ("--threads", "-4"), ("--device", "tpu")]:
    case(f"run{_option}-{_value}", _run(_option, _value), _option)
case("run-threads-capped", _run("--threads", "100000", "--max-new-tokens", "2"), exit=0)
case("run-prompt-past-context", lambda env: ["run", str(env.model), "--prompt-ids", ",".join(["1"] * 600)], "context")
case("run-generation-stops-at-context", _run("--max-new-tokens", "2000"), exit=0)
case("run-no-prompt", lambda env: ["run", str(env.model)], "--prompt")
case("run-both-prompts", _run("--prompt", "x"), "--prompt")
case("run-empty-prompt-ids", lambda env: ["run", str(env.model), "--prompt-ids", ","], "--prompt-ids")
case("run-negative-id", lambda env: ["run", str(env.model), "--prompt-ids", "-1"], "--prompt-ids: expected token ids")
for _name, _content in [("tokenizer.json", "{"), ("tokenizer.json", "[]"), ("tokenizer.json", '{"model": 5}'),
                        ("tokenizer_config.json", "[]"), ("moepass.json", "["), ("moepass.json", "[]"),
                        ("moepass.json", '{"tokenizer": 5}'), ("onnxruntime_options.json", "{"),
                        ("onnxruntime_options.json", "[1]"),
                        ("onnxruntime_options.json", '{"session_config_entries": [1]}'),
                        ("onnxruntime_options.json", '{"session_config_entries": {"a": 1}}'),
                        ("genai_config.json", "{")]:
    def _damaged(env, name=_name, content=_content):
        model = env.copy_model()
        (model / name).write_text(content)
        return model
    _needs_text = _name.startswith("tokenizer")
    _args = (lambda env, d=_damaged: ["run", str(d(env)), "--prompt", "hi", "--chat", "--max-new-tokens", "1"]) \
        if _needs_text \
        else _run("--max-new-tokens", "1", model=_damaged)
    _valid = _name == "genai_config.json"  # run does not read it
    case(f"run-damaged-{_name}-{_content[-12:]}", _args, *(() if _valid else (_name,)), exit=0 if _valid else 2)
case("bench-depth-past-context", lambda env: ["bench", str(env.model), "--prompt-tokens", "8", "--new-tokens", "4",
                                              "--depth", "100000", "--repeats", "1"], "context")
case("bench-prompt-past-context", lambda env: ["bench", str(env.model), "--prompt-tokens", "100000", "--repeats", "1"],
     "context")
case("bench-zero-repeats", lambda env: ["bench", str(env.model), "--repeats", "0"], "--repeats")
case("bench-threads-capped", lambda env: ["bench", str(env.model), "--prompt-tokens", "4", "--new-tokens", "2",
                                          "--repeats", "1", "--threads", "100000", "--json"], exit=0)
for _name, _data in [("empty.gguf", b""), ("empty.onnx", b""), ("empty", b""), ("random.gguf", b"GGUF" + bytes(3)),
                     ("text.onnx", b"hello world"), ("random.bin", bytes(range(256)))]:
    case(f"inspect-{_name}", lambda env, n=_name, d=_data: ["inspect", str(env.write(n, d))], _name)
case("inspect-missing", lambda env: ["inspect", str(env.tmp / "missing.gguf")], "missing.gguf")
case("inspect-directory-without-model", lambda env: ["inspect", str(env.tmp)], str("model.onnx"))
case("offload-hidden-96", lambda env: ["convert", str(env.tiny96), "-o", str(env.tmp / "out"), "-q",
                                       "--expert-format", "offload"], "96", out="out")


def _dat(nval: int, values: list[float], name: str = "blk.0.ffn_up_exps.weight") -> bytes:
    import struct
    return (struct.pack("<i", 1) + struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 10, nval)
            + np.asarray(values, "<f4").tobytes())


for _what, _data in [("empty", b""), ("negative-count", _dat(-5, [1.0])), ("huge-count", _dat(1 << 30, [1.0])),
                     ("nan", _dat(2, [1.0, math.nan])), ("negative", _dat(2, [1.0, -1.0])),
                     ("name-length-huge", b"\x01\x00\x00\x00\xff\xff\xff\x7f"), ("wrong-size", _dat(3, [1.0] * 3))]:
    case(f"imatrix-{_what}", lambda env, d=_data: ["convert", str(env.gguf), "-o", str(env.tmp / "out"), "-q",
                                                   "--expert-format", "qmoe",  # native requantizes nothing
                                                   "--imatrix", str(env.write("m.dat", d))],
         "m.dat" if _what != "wrong-size" else "importance matrix", out="out")
case("profile-prompts-missing", lambda env: ["profile", str(env.model), "--prompts", str(env.tmp / "none.txt"),
                                             "-o", str(env.tmp / "out")], "none.txt", out="out")
case("profile-prompts-binary", lambda env: ["profile", str(env.model), "--prompts", str(env.write("p.txt", b"\xff\xfe")),
                                            "-o", str(env.tmp / "out")], "p.txt", out="out")
case("merge-profiles-different", lambda env: ["merge-profiles", str(env.profile), str(env.write(
    "other.json", env.profile.read_text().replace('"fingerprint": "', '"fingerprint": "0'))),
    "-o", str(env.tmp / "out")], "other.json", out="out")


# ---- the harness ------------------------------------------------------------------------------------

def _tree_digest(path: Path) -> str | None:
    if not os.path.lexists(path):
        return None
    h = hashlib.sha256()
    if path.is_symlink():
        h.update(b"link:" + os.readlink(path).encode())
    entries = sorted(path.rglob("*")) if path.is_dir() and not path.is_symlink() else [path]
    for p in entries:
        h.update(str(p.relative_to(path.parent)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def env_sources(tmp_path_factory, make_gguf, converted):
    import make_fixtures

    gguf = make_gguf("q4_0")
    model = converted("q4_0")
    folder = tmp_path_factory.mktemp("hostile-sources")
    profile = folder / "profile.json"
    result = CliRunner().invoke(main, ["profile", str(model), "--prompt-ids", "1,2,3,4,5,6,7,8", "-o", str(profile),
                                       "-q"])
    assert result.exit_code == 0, result.output
    tiny96 = make_fixtures.write_moe_gguf(folder / "hidden96.gguf", "q4_0", dims=dataclasses.replace(
        make_fixtures.TEST_DIMS, hidden=96, head_dim=32, n_heads=4, n_kv_heads=2, expert_ff=64))
    return gguf, model, profile, tiny96


def test_corpus_is_large_enough():
    assert len(CASES) >= 150, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES), "case ids repeat"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile(case: Case, env_sources, tmp_path, monkeypatch):
    env = Env(tmp_path, *env_sources)
    monkeypatch.chdir(tmp_path)
    args = case.args(env)
    out = tmp_path / case.out if case.out else None
    before = _tree_digest(out) if out else None
    siblings_before = set(os.listdir(tmp_path))
    result = CliRunner().invoke(main, args)
    stderr = result.stderr
    assert "Traceback" not in stderr and "this is a bug" not in stderr, stderr
    assert result.exit_code == case.exit, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    errors = [line for line in stderr.splitlines() if line.startswith("moepass: error: ")]
    if case.exit == 2:
        assert len(errors) == 1, stderr
        for text in case.says:
            assert text in errors[0], errors[0]
        if out is not None:
            assert _tree_digest(out) == before, f"{out} changed"
    else:
        assert not errors, stderr
        for text in case.says:
            assert text in stderr, stderr
    leftovers = [n for n in set(os.listdir(tmp_path)) - siblings_before if ".tmp-" in n or ".old-" in n]
    assert not leftovers, leftovers
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n], os.listdir(tmp_path)


# ---- interrupted, concurrent and failing runs ------------------------------------------------------

@pytest.fixture(scope="module")
def slow_gguf(tmp_path_factory):
    """A GGUF that takes a second or more to convert on one thread (_convert_process): time to
    interrupt it after its temporary output appears, however fast the machine's cores (266 MB of
    Q4_K requantized at about 0.15 GB/s per thread: measured 1.8 s)."""
    import make_fixtures

    dims = dataclasses.replace(make_fixtures.TEST_DIMS, n_layers=8, hidden=1024, expert_ff=1024, n_experts=16)
    return make_fixtures.write_moe_gguf(tmp_path_factory.mktemp("slow") / "slow.gguf", "q4_k", dims=dims)


def _convert_process(gguf: Path, out: Path):
    import subprocess
    import sys

    import signal

    # cwd: `-m` puts the working directory first on sys.path (tests/conftest.py says why not the repository);
    # SIGINT as a terminal gives it: a suite started in the background by a shell inherits SIGINT ignored,
    # and Python keeps an ignored SIGINT ignored
    # qmoe: the requantizing conversion slow_gguf is sized for (the default keeps Q4_K's blocks, faster)
    return subprocess.Popen([sys.executable, "-m", "moepass.cli", "convert", str(gguf), "-o", str(out), "-q",
                             "--threads", "1", "--expert-format", "qmoe"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=gguf.parent,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_temporary(folder: Path, process, name: str = "out") -> None:
    import time

    deadline = time.monotonic() + 60
    while not list(folder.glob(f".{name}.tmp-*")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no temporary output appeared"
        time.sleep(0.005)


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_an_interrupt_as_the_temporary_is_made_leaves_nothing(tmp_path, monkeypatch, kind):
    """The window the signal test can hit under load: the file system has made the temporary and
    the interrupt lands before its name is returned to the code that removes it."""
    import tempfile

    from moepass.pipeline import atomic

    make = tempfile.mkdtemp if kind == "directory" else tempfile.mkstemp

    def made_then_interrupted(*args, **kwargs):
        make(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "mkdtemp" if kind == "directory" else "mkstemp", made_then_interrupted)
    writer = atomic.atomic_directory if kind == "directory" else atomic.atomic_file
    with pytest.raises(KeyboardInterrupt), writer(tmp_path / "out"):
        pass
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("signal_name,code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_interrupted_conversion_leaves_nothing(slow_gguf, tmp_path, signal_name, code):
    import signal

    out = tmp_path / "out"
    process = _convert_process(slow_gguf, out)
    _wait_for_temporary(tmp_path, process)
    process.send_signal(getattr(signal, signal_name))
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr and "nothing half-written was left" in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def test_killed_conversion_is_swept_by_the_next(slow_gguf, tmp_path):
    import signal

    out = tmp_path / "out"
    process = _convert_process(slow_gguf, out)
    _wait_for_temporary(tmp_path, process)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert list(tmp_path.glob(".out.tmp-*")), "SIGKILL left no temporary: the test proves nothing"
    result = CliRunner().invoke(main, ["convert", str(slow_gguf), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == ["out"], os.listdir(tmp_path)


def test_leftovers_of_killed_runs_are_swept_and_said_never_a_live_or_foreign_one(make_gguf, tmp_path, monkeypatch,
                                                                                 caplog):
    """Every atomic write starts by removing the temporaries of its destination that a killed run left
    (process gone, the user's own), one line each with its bytes; one whose process runs stays, and so
    does one of another user's (seen here through a uid not the owner's)."""
    import subprocess

    from moepass.pipeline import atomic

    ended = subprocess.Popen(["true"])
    ended.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        dead = tmp_path / f".out.tmp-{ended.pid}-abc"
        (dead / "sub").mkdir(parents=True)
        (dead / "model.onnx.data").write_bytes(b"x" * 1000)
        (dead / "sub" / "f").write_bytes(b"y" * 24)
        live = tmp_path / f".out.tmp-{running.pid}-def"
        live.mkdir()
        other = tmp_path / f".p.json.tmp-{ended.pid}-ghi"
        other.write_bytes(b"z" * 10)
        result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "out"), "-q"])
        assert result.exit_code == 0, result.output
        said = [line for line in result.stderr.splitlines() if "leftover" in line]
        assert said == [f"moepass: warning: removed a leftover of a killed run: {dead} (1,024 bytes)"], result.stderr
        assert not dead.exists() and live.is_dir() and other.is_file()
        real_uid = os.getuid()
        with monkeypatch.context() as m:  # the leftover, as another user would see it: kept
            m.setattr(atomic.os, "getuid", lambda: real_uid + 1)
            with atomic.atomic_file(tmp_path / "p.json") as tmp:
                tmp.write_text("{}")
        assert other.is_file()
        caplog.clear()
        with caplog.at_level("WARNING", logger="moepass"), atomic.atomic_file(tmp_path / "p.json", True) as tmp:
            tmp.write_text("{}")  # from Python: the same line, through the logger "moepass"
        assert not other.exists() and live.is_dir()
        assert [r.getMessage() for r in caplog.records] == [f"removed a leftover of a killed run: {other} (10 bytes)"]
    finally:
        running.kill()
        running.wait()


def test_output_appearing_meanwhile_is_not_replaced(make_gguf, tmp_path, monkeypatch):
    """Two runs to the same -o: the one that finishes second refuses at the rename."""
    convert_module = importlib.import_module("moepass.pipeline.conversion")

    out = tmp_path / "out"
    real_save = convert_module.save_model

    def save_while_another_run_finishes(model, path, progress):
        real_save(model, path, progress)
        out.mkdir()
        (out / "model.onnx").write_text("the other run's model")

    monkeypatch.setattr(convert_module, "save_model", save_while_another_run_finishes)
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert "appeared while this run was writing" in result.stderr and "Traceback" not in result.stderr
    assert (out / "model.onnx").read_text() == "the other run's model" and len(os.listdir(out)) == 1
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_full_disk_is_one_line_naming_the_output(make_gguf, tmp_path, monkeypatch):
    import errno

    convert_module = importlib.import_module("moepass.pipeline.conversion")

    def no_space(model, path, progress):
        (path.parent / "model.onnx.data").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path.parent / "model.onnx.data"))

    monkeypatch.setattr(convert_module, "save_model", no_space)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"moepass: error: {out}: No space left on device; nothing was written"
    assert os.listdir(tmp_path) == []


def test_a_bug_keeps_its_traceback(make_gguf, tmp_path, monkeypatch):
    """An unexpected exception is not dressed up as bad input: traceback, 'this is a bug', exit 1."""
    convert_module = importlib.import_module("moepass.pipeline.conversion")

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(convert_module, "save_model", broken)
    result = CliRunner().invoke(main, ["convert", str(make_gguf("q4_0")), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "ZeroDivisionError: a bug" in result.stderr
    assert "this is a bug in moepass" in result.stderr and "moepass: error:" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_prompt_ids_print_as_they_come(converted):
    """Generation stops at the context length with a warning, and the ids chosen so far are printed."""
    result = CliRunner().invoke(main, ["run", str(converted("q4_0")), "--prompt-ids", ",".join(["5"] * 508),
                                       "--max-new-tokens", "50"])
    assert result.exit_code == 0, result.output
    assert "generation stops after 4 new tokens" in result.stderr
    from moepass.runtime import load

    expected = list(load(converted("q4_0")).generate([5] * 508, 4))  # what the model chooses, stop token included
    assert 1 <= len(expected) <= 4 and result.stdout == ",".join(map(str, expected)) + "\n"
    assert f"{len(expected)} tokens in " in result.stderr
