"""Start `kvllm serve` (or vLLM's own API server) as a child process and wait until it
answers (demos and tests)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvllm.vllm.engine import API_SERVER_MODULE


def start_server(
    model: str, port: int, flags: list[str], log: Path | None = None, env: dict | None = None, vllm: bool = False
):
    """Spawn ``kvllm serve MODEL FLAGS`` on 127.0.0.1:``port``; returns the process and base URL.

    With ``vllm=True``, vLLM's own API server (``vllm serve``) with only ``FLAGS``; the
    plugin still loads, through its entry point.
    """
    command = ["-m", API_SERVER_MODULE, "--model", model] if vllm else ["-m", "kvllm.cli", "serve", model]
    args = [sys.executable, *command, *flags, "--host", "127.0.0.1", "--port", str(port)]
    out = subprocess.DEVNULL if log is None else log.open("w")
    process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, base: str, timeout: float) -> float:
    """Seconds until ``/health`` answered 200; raises if the server exits or times out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
