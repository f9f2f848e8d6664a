"""`moepass serve MODEL` started as a user starts it: a subprocess on a free local port, up once
/health answers; stopped as Ctrl-C stops it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """The server on `model`, its stderr in `log`, `args` after the command's own."""

    def __init__(self, model: Path, log: Path, *args: str):
        import httpx

        self.port = free_port()
        self.log = log
        self.base = f"http://127.0.0.1:{self.port}"
        # cwd: `-m` puts the working directory first on sys.path (tests/conftest.py says why not the repository)
        self.process = subprocess.Popen([sys.executable, "-m", "moepass.cli", "serve", str(model), "--port",
                                         str(self.port), "--threads", "1", *args],
                                        stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=model.parent,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up:\n" + log.read_text()
            time.sleep(0.1)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=60)
