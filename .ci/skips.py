"""The suite's skips, held to a short list of reasons a skip may have on a CI machine: any other skip
fails the run (a skip is what many regressions look like: a converter that fails, a model that
stops early, an oracle that did not install).

    python -m pytest -q -rs | tee suite.log; python .ci/skips.py suite.log
    python .ci/skips.py --none suite.log   # a run where every test can run: no skip at all

Reads pytest's short summary (`-rs`: `SKIPPED [N] path:line: reason`) and prints each skip with the
rule that allows it; exits 1 naming the first skip no rule allows, or when the log has no summary
line at all (pytest did not finish).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# reason pattern -> why such a skip is no regression on some machine CI may run on
ALLOWED = {
    r"no AVX2-only run here": "the AVX2-kernel rerun needs an AVX-512 CPU with CPUID faulting; step 4 says why not",
    r"the CUDA EP loads on this machine": "the failure-report test needs a machine without a GPU driver",
    r"giving files to another user needs root": "the foreign-owner cache test needs chown (CI runs as root)",
    r"this file system refuses O_DIRECT": "tmpfs and overlay file systems refuse O_DIRECT; the buffered path ran",
    r"no /dev/shm": "a container without /dev/shm",
    r"O_DIRECT is Linux's": "not Linux",
    r"the text fixture was measured on Python": "the trained model's text digests are recorded for some Pythons",
    r"GiB free: the GPU wheels need about 8 GiB": "a small disk",
    r"no NVIDIA driver \(libcuda.so.1\) here": "onnxruntime-gpu lists its CUDA kernels only where its CUDA provider loads",
    r"onnxruntime-ep-webgpu is not installed": "the suite's install lacks the WebGPU plugin; .ci/run's step 5 has it",
}
SKIPPED = re.compile(r"^SKIPPED \[(?P<count>\d+)\] (?P<where>\S+?):? (?P<reason>.*)$")
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)[, ]*)+")


def check(log: str) -> list[str]:
    """The skips of `log` no rule allows (each as pytest printed it)."""
    refused = []
    for line in log.splitlines():
        m = SKIPPED.match(line.strip())
        if m and not any(re.search(pattern, m["reason"]) for pattern in ALLOWED):
            refused.append(line.strip())
    return refused


def main() -> int:
    strict = "--none" in sys.argv[1:]
    path = [a for a in sys.argv[1:] if a != "--none"][0]
    log = Path(path).read_text(errors="replace")
    if not any(SUMMARY.match(line.strip()) for line in log.splitlines()):
        print(f"{path}: no pytest summary line: the suite did not finish")
        return 1
    refused = [line.strip() for line in log.splitlines() if SKIPPED.match(line.strip())] if strict else check(log)
    for line in log.splitlines():
        if SKIPPED.match(line.strip()) and line.strip() not in refused:
            print(f"allowed: {line.strip()}")
    for line in refused:
        why = "--none: this run allows no skip" if strict else "a skip no rule in .ci/skips.py explains"
        print(f"not allowed ({why}): {line}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
