"""Which x86-64 kernel family this machine runs, and an AVX2-only run on an AVX-512 machine.

ONNX Runtime's MLAS (and numpy, torch, MKL) pick their kernels by CPUID when they load: on an
AVX-512 / VNNI CPU other int8 kernels than on an AVX2-only one (an AMD EPYC of the Zen 2/3
generations), whose roundings differ. The suite must pass on both, so it is run on both:

    python tests/cpu_family.py              # one line: the CPU model and its AVX flags
    python tests/cpu_family.py --preload    # the AVX2-only shim's path (exit 1, saying why, if none)
    LD_PRELOAD=$(python tests/cpu_family.py --preload) AVX2ONLY_VENDOR=AMD python -m pytest -q

The shim (tests/avx2_only.c, built here with the C compiler) traps CPUID through Linux's CPUID
faulting and hides AVX-512, AVX-VNNI and AMX, so every library in the process takes its AVX2 code
paths at native speed. Where the CPU has no AVX-512 there is nothing to hide, and where the kernel
or hypervisor offers no CPUID faulting the shim cannot work: `avx2_only_preload` says which.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("avx2_only.c")
# The flags that decide which kernels MLAS and llama.cpp take, in the order printed.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_int8")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def avx2_only_active() -> bool:
    """Whether this process runs under the AVX2-only shim."""
    return "avx2_only" in os.environ.get("LD_PRELOAD", "")


def kernel_family() -> str:
    """"AVX-512" or "AVX2": the int8 kernel family MLAS picks in this process."""
    _, flags = _cpuinfo()
    return "AVX-512" if "avx512f" in flags and not avx2_only_active() else "AVX2"


def describe() -> str:
    """One line: the CPU model, its kernel flags, and the family this process's kernels come from."""
    model, flags = _cpuinfo()
    shown = " ".join(f for f in KERNEL_FLAGS if f in flags) or "no AVX flags"
    hidden = " (AVX-512, AVX-VNNI and AMX hidden by tests/avx2_only.c)" if avx2_only_active() else ""
    return f"{model}; {shown}; kernels: {kernel_family()}{hidden}"


def avx2_only_preload() -> tuple[Path | None, str]:
    """(path of the built shim, "") or (None, why there is none): built once per source version into
    the temporary directory, and checked to hide AVX-512 from a child process."""
    _, flags = _cpuinfo()
    if "avx512f" not in flags:
        return None, "this CPU has no AVX-512: its kernels are the AVX2 ones already"
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    library = Path(tempfile.gettempdir()) / f"moepass-avx2_only-{digest}.so"
    if not library.exists():
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(SHIM_SOURCE), "-o", str(partial), "-ldl"],
                               capture_output=True, text=True)
        if built.returncode:
            return None, f"cannot build {SHIM_SOURCE.name}: {built.stderr.strip().splitlines()[-1:]}"
        os.replace(partial, library)
    probe = subprocess.run([sys.executable, "-c", "from numpy._core._multiarray_umath import __cpu_features__ as f; "
                            "print(int(f['AVX512F']), int(f['AVX2']))"],
                           env={**os.environ, "LD_PRELOAD": str(library)}, capture_output=True, text=True)
    if probe.stdout.split() != ["0", "1"]:
        return None, ("the kernel or hypervisor offers no CPUID faulting (arch_prctl ARCH_SET_CPUID): "
                      f"AVX-512 stays visible ({probe.stdout.strip() or probe.stderr.strip()[-200:]})")
    return library, ""


def avx2_only_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the AVX2-only shim preloaded, as an AMD
    EPYC; raises RuntimeError saying why when the shim cannot work here."""
    library, why = avx2_only_preload()
    if library is None:
        raise RuntimeError(why)
    return {**(os.environ if base is None else base), "LD_PRELOAD": str(library), "AVX2ONLY_VENDOR": "AMD"}


if __name__ == "__main__":
    if sys.argv[1:] == ["--preload"]:
        path, reason = avx2_only_preload()
        print(path if path else reason, file=sys.stdout if path else sys.stderr)
        sys.exit(0 if path else 1)
    print(describe())
