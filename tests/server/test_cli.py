"""``apriel2-serve``: flag errors exit 2 before anything loads; the entry point serves /health and /v1/models."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
from contextlib import redirect_stderr

import httpx

from apriel2_jax.cli.serve import main
from tests.server.conftest import wait_until


def _run(argv):
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_usage_errors_exit_2(text_ckpt, tmp_path):
    code, err = _run([str(tmp_path / "missing")])
    assert code == 2 and "does not exist" in err
    code, err = _run([text_ckpt, "--kv-connector-path", str(tmp_path)])
    assert code == 2 and "--kv-connector" in err
    code, err = _run([text_ckpt, "--max-queued-requests", "-1"])
    assert code == 2 and "--max-queued-requests" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_console_script_serves(text_ckpt):
    script = os.path.join(os.path.dirname(sys.executable), "apriel2-serve")
    command = [script] if os.path.exists(script) else (
        [shutil.which("apriel2-serve")] if shutil.which("apriel2-serve") else
        [sys.executable, "-m", "apriel2_jax.cli.serve"])
    port = _free_port()
    proc = subprocess.Popen([*command, text_ckpt, "--port", str(port), "--dtype", "float32", "--warm-up", "none",
                             "--max-num-seqs", "2", "--page-size", "4", "--placement", "mamba",
                             "--served-model-name", "cli-model", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(healthy, timeout=300, interval=0.2, message="apriel2-serve to start")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["cli-model"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
