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
import pytest

from apriel2_jax.cli.serve import bind_sockets, main
from tests.server.conftest import CASE, wait_until


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


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if main() gets as far as loading the model (serve.py imports LLM when it runs)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("apriel2_jax.engine.llm.LLM", refuse)


@pytest.mark.parametrize("port", ["70000", "-1", "65536", "http"])
def test_port_out_of_range_is_a_usage_error(text_ckpt, no_model_load, port):
    # 70000 used to be truncated by the OS to 4464, and -1 failed only after the model loaded.
    code, err = _run([text_ckpt, "--port", port])
    assert code == 2 and "argument --port" in err and "0-65535" in err, err


def test_busy_port_fails_before_the_model_loads(text_ckpt, no_model_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = _run([text_ckpt, "--host", "127.0.0.1", "--port", str(port)])
    assert code == 2 and f"127.0.0.1:{port}" in err and "in use" in err, err


def test_unknown_host_fails_before_the_model_loads(text_ckpt, no_model_load):
    code, err = _run([text_ckpt, "--host", "no-such-host.invalid", "--port", "0"])
    assert code == 2 and "--host 'no-such-host.invalid'" in err, err


def test_missing_config_is_reported_before_the_tokenizer(tmp_path, no_model_load):
    code, err = _run([str(tmp_path), "--port", "0"])
    assert code == 2 and "config.json" in err and "tokenizer" not in err, err


def test_no_tokenizer_says_what_the_server_accepts(tmp_path, monkeypatch):
    for name in ("config.json", "placements.json"):
        shutil.copy(os.path.join(CASE, name), tmp_path / name)

    def stop(*args, **kwargs):  # the tokenizer message comes before the model loads; stop there
        raise ValueError("stopped before loading")
    monkeypatch.setattr("apriel2_jax.engine.llm.LLM", stop)
    code, err = _run([str(tmp_path), "--port", "0"])
    assert code == 2 and "stopped before loading" in err, err
    # Not apriel2-generate's hint: this command has no --prompt-ids.
    assert "--prompt-ids" not in err and "token-id arrays only" in err and "chat completions are unavailable" in err


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


def test_bound_port_is_held_while_the_model_loads():
    """The sockets listen as soon as they are bound: another server using SO_REUSEADDR (as uvicorn and asyncio do)
    cannot take the port in the minutes the model takes to load."""
    sockets = bind_sockets("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with pytest.raises(OSError, match=f"--port {port}"):
            bind_sockets("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()
