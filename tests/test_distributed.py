"""Several processes as one mesh (apriel2_jax/distributed.py): the settings' checks, the command-line flags, and
the same command run as two processes of two virtual CPU devices each (a TP=4 mesh across processes, collectives
through gloo): golden parity, and generation from a converted checkpoint with only process 0 writing."""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest

from apriel2_jax.cli import check_parity, generate
from apriel2_jax.distributed import DistributedError, check_settings
from apriel2_jax.parity import load_case
from tests.conftest import GOLDENS, REPO

CASE = os.path.join(GOLDENS, "hybrid_all_mixers")  # every mixer kind in one model


def test_settings_must_be_complete_and_consistent():
    check_settings("host0:1234", 2, 1)
    with pytest.raises(DistributedError, match="missing num_processes, process_id"):
        check_settings("host0:1234", None, None)
    with pytest.raises(DistributedError, match="HOST:PORT.*'host0'"):
        check_settings("host0", 2, 0)
    with pytest.raises(DistributedError, match=r"process_id must be in \[0, 2\).*got 2"):
        check_settings("host0:1234", 2, 2)
    check_settings(None, None, None)  # a cluster manager supplies them (initialize says so if none does)


def test_no_cluster_manager_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "apriel2_jax.cli.check_parity", CASE, "--distributed",
                           "--tensor-parallel", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "could not join the other processes (from the cluster manager's environment)" in done.stderr
    assert "give --coordinator-address, --num-processes and --process-id" in done.stderr


@pytest.mark.parametrize("command", ["generate", "check_parity"])
def test_command_lines_name_the_missing_flags(command, capsys):
    if command == "generate":
        code = generate.main([CASE, "--prompt-ids", "1,2,3", "--process-id", "1"])
    else:
        code = check_parity.main([CASE, "--process-id", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "missing --coordinator-address, --num-processes" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_gloo(stdout: str) -> str:
    """Gloo (the CPU collectives) announces its connections on stdout from C++ threads, whose lines may
    interleave; not the command's output."""
    lines = stdout.splitlines(keepends=True)
    return "".join(line for line in lines if "[Gloo]" not in line and "peer ranks" not in line)


def _prints_nothing(stdout: str) -> bool:
    """Whether a command printed nothing of its own (``stdout`` without Gloo's lines): whitespace and lone numbers
    only. Gloo writes each announcement ("[Gloo] Rank R is connected to N peer ranks. Expected number of connected
    peer ranks is : N") in pieces from several C++ threads, so another thread's line end can leave a piece, e.g.
    the last number, on a line of its own (a lone "3" failed a full run once)."""
    return re.fullmatch(r"[\d\s]*", stdout) is not None


def test_prints_nothing_tolerates_only_gloo_leftovers():
    announce = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : "
    assert _prints_nothing(_without_gloo(announce + announce + "3\n3\n"))
    assert _prints_nothing(_without_gloo("\n"))
    assert not _prints_nothing(_without_gloo(announce + "3\nmain  ok\n"))


def _run_processes(args, processes: int = 2, devices: int = 2, timeout: float = 600) -> list[tuple[int, str, str]]:
    """Run ``python args...`` as ``processes`` joined processes of ``devices`` CPU devices each: (exit code,
    stdout, stderr) per process. Output goes to files (a full pipe would block a process inside a collective);
    a coordinator port taken between choosing and binding it is retried."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONPATH=REPO,
               JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as logs:
        for _ in range(3):
            port = _free_port()
            running = []
            for i in range(processes):
                out = open(os.path.join(logs, f"{i}.out"), "w+")
                err = open(os.path.join(logs, f"{i}.err"), "w+")
                command = [sys.executable, *args, "--coordinator-address", f"127.0.0.1:{port}",
                           "--num-processes", str(processes), "--process-id", str(i)]
                running.append((subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err), out, err))
            results = []
            try:
                for process, out, err in running:
                    process.wait(timeout=timeout)
                    out.seek(0), err.seek(0)
                    results.append((process.returncode, _without_gloo(out.read()), err.read()))
            finally:
                for process, out, err in running:
                    if process.poll() is None:
                        process.kill()
                    out.close(), err.close()
            if not any("ddress already in use" in err for _, _, err in results):
                return results
    return results


def test_parity_across_two_processes():
    """Forward logits and engine greedy tokens of every mixer kind, over a TP=4 mesh whose devices belong to two
    processes; process 0 prints the table, process 1 nothing."""
    results = _run_processes(["-m", "apriel2_jax.cli.check_parity", CASE, "--tensor-parallel", "4",
                              "--placement", "main"])
    (code0, out0, err0), (code1, out1, err1) = results
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    assert "tensor parallel 4, 2 processes" in out0
    rows = [line for line in out0.splitlines() if line.startswith("main ")]
    assert len(rows) == 2 and all(" ok " in row for row in rows), out0
    assert _prints_nothing(out1), out1


def test_generate_from_a_converted_checkpoint_across_two_processes(tmp_path):
    """apriel2-convert --tp 4 output restored by two processes, each reading its own devices' rows through orbax;
    the greedy tokens are the goldens' and only process 0 writes them."""
    from convert.cli import main as convert

    out_dir = str(tmp_path / "converted")
    assert convert([CASE, out_dir, "--tp", "4", "--dtype", "float32"]) == 0
    case = load_case(CASE)
    prompt = ",".join(str(int(t)) for t in case.input_ids[0, : case.prompt_len])
    results = _run_processes(["-m", "apriel2_jax.cli.generate", out_dir, "--prompt-ids", prompt,
                              "--max-new-tokens", "8", "--ignore-eos", "--dtype", "float32", "--tensor-parallel", "4",
                              "--max-num-seqs", "2", "--max-model-len", "64", "--warm-up", "none", "--json"])
    (code0, out0, err0), (code1, out1, err1) = results
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    (record,) = json.loads(out0)
    assert record["token_ids"] == [int(t) for t in case.greedy_ids["main"][0]]
    assert _prints_nothing(out1), out1


def test_processes_agree_on_the_smallest_cache_budget():
    """Each host sizes the caches from its own free memory (here patched to differ); the processes must build the
    same shapes, so every one takes the smallest budget."""
    script = ("import sys, jax; from apriel2_jax.distributed import initialize; a = sys.argv[1:]; "
              "initialize(a[1], int(a[3]), int(a[5])); from apriel2_jax.engine.llm import LLM; "
              "LLM._local_budget = staticmethod(lambda devices, fraction: (5 - jax.process_index()) * 2**26 + 12345); "
              f"llm = LLM({CASE!r}, tensor_parallel=2, dtype='float32', max_num_seqs=2, max_model_len=32, "
              "page_size=4, warm_up='none', log=lambda msg: None); print(llm._cache_bytes)")
    results = _run_processes(["-c", script], devices=1)
    # the printed budget is the last line: Gloo's leftovers (see _prints_nothing) come before it, at the join
    assert [(code, out.split()[-1:]) for code, out, _ in results] == [(0, [str(4 * 2**26)])] * 2, results
    assert all(_prints_nothing(out.replace(str(4 * 2**26), "")) for _, out, _ in results), results


def test_a_mesh_must_span_every_process():
    """A joined process without a share of the mesh would wait forever in the others' collectives: an error on
    every process instead, as when the model is not split at all."""
    for extra, message in ((["--tensor-parallel", "2"], "takes the devices of process(es) [0] only"),
                           ([], "2 processes are joined: give --tensor-parallel")):
        results = _run_processes(["-m", "apriel2_jax.cli.check_parity", CASE, *extra])
        for code, out, err in results:
            assert code == 2 and out == "" and message in err, err[-2000:]


def test_kv_connector_is_refused_across_processes():
    """Each host's connector loads end at other steps, so the processes' schedules would part: a clear error."""
    results = _run_processes(["-m", "apriel2_jax.cli.generate", CASE, "--prompt-ids", "1,2,3", "--dtype", "float32",
                              "--tensor-parallel", "2", "--max-num-seqs", "2", "--max-model-len", "64",
                              "--kv-connector", "host", "--kv-connector-bytes", "64M"], devices=1)
    for code, out, err in results:
        assert code == 2 and out == "", err[-2000:]
        assert "--kv-connector is not supported across several processes (2 joined)" in err


def test_server_is_refused_across_processes():
    """Requests reach one host only, while every process of a mesh must run the same steps."""
    script = ("import sys; from apriel2_jax.distributed import initialize; a = sys.argv[1:]; "
              "initialize(a[1], int(a[3]), int(a[5])); from apriel2_jax.server import create_app\n"
              "try:\n    create_app(None)\nexcept ValueError as err:\n    print(err)")
    results = _run_processes(["-c", script], devices=1)
    for code, out, err in results:
        assert code == 0 and "the server runs on one host; this process is one of 2 joined" in out, err[-2000:]
