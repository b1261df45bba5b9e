"""``apriel2-convert``: HF -> orbax round trips (every golden case), thinning, tensor-parallel layouts, and every
bad input failing with an error that names the problem and leaving nothing behind."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from apriel2_jax.checkpoint import load_model
from apriel2_jax.engine.llm import LLM
from apriel2_jax.orbax_checkpoint import is_converted
from apriel2_jax.parity import load_case
from apriel2_jax.placement import active_mixer, load_placements, resolve_placement
from apriel2_jax.safetensors_io import CheckpointError
import convert.cli
from convert.cli import main
from tests.conftest import GOLDENS, golden_cases
from tests.engine.test_llm import GREEDY, SMALL, _prompts
from tests.helpers import random_weights, tiny_config, write_checkpoint


def _forward(model, ids, placement):
    return np.asarray(jax.jit(lambda x: model(x, placement)[0])(ids))


def _ids(case):
    return np.asarray(case.input_ids[:, : case.prompt_len], np.int32)


def _convert(*args) -> None:
    assert main([str(a) for a in args]) == 0


@pytest.mark.parametrize("case_name", golden_cases())
def test_round_trip_equals_loading_the_hf_checkpoint(case_name, tmp_path):
    source = os.path.join(GOLDENS, case_name)
    case = load_case(source)
    _convert(source, tmp_path / "out", "--verify")
    hf, converted = load_model(source, "float32"), load_model(tmp_path / "out", "float32")
    for name in case.placements:
        placement = resolve_placement(hf.config, name, case.placements)
        np.testing.assert_array_equal(_forward(converted, _ids(case), placement), _forward(hf, _ids(case), placement))


def test_tensor_parallel_layout_loads_each_device_its_rows(tmp_path):
    source = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(source)
    _convert(source, tmp_path / "tp2", "--tp", 2)
    _convert(source, tmp_path / "tp1")
    from_hf = load_model(source, "float32", tensor_parallel=2)
    for directory in ("tp2", "tp1"):  # a --tp 1 conversion loads at any size
        model = load_model(tmp_path / directory, "float32", tensor_parallel=2)
        for key, a, b in zip(model.keys, model.param_leaves, from_hf.param_leaves):
            assert a.sharding == b.sharding, key
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=key)
    placement = resolve_placement(from_hf.config, "mamba", case.placements)
    np.testing.assert_array_equal(np.asarray(model.forward(_ids(case), placement)),
                                  np.asarray(from_hf.forward(_ids(case), placement)))
    with pytest.raises(CheckpointError, match="converted for tensor_parallel=2: load it with tensor_parallel=2"):
        load_model(tmp_path / "tp2", "float32")
    with pytest.raises(CheckpointError, match="converted for tensor_parallel=2, not 4"):
        load_model(tmp_path / "tp2", "float32", tensor_parallel=4)


def test_thinning_keeps_the_placements_mixers_and_their_outputs(tmp_path):
    source = os.path.join(GOLDENS, "supernet_fixed")
    case = load_case(source)
    _convert(source, tmp_path / "thin", "--placement", "every2_kda")
    with open(tmp_path / "thin" / "config.json") as f:
        config = json.load(f)
    assert config["decoder"]["pattern"] == ["kda", "gdn", "kda", "gdn"]
    assert all(b["mixer"]["type"] in ("kda", "gdn") for b in config["decoder"]["blocks"].values())
    # No stochastic layer is left, but the placement's name still selects the thinned model.
    assert load_placements(tmp_path / "thin") == {"every2_kda": {}}
    supernet, thinned = load_model(source, "float32"), load_model(tmp_path / "thin", "float32")
    placement = resolve_placement(supernet.config, "every2_kda", case.placements)
    assert resolve_placement(thinned.config, "every2_kda", load_placements(tmp_path / "thin")) == (None,) * 4
    np.testing.assert_array_equal(_forward(thinned, _ids(case), (None,) * 4), _forward(supernet, _ids(case), placement))
    llm = LLM(tmp_path / "thin", dtype="float32", placement="every2_kda", **SMALL)
    tokens = [o.token_ids for o in llm.generate(_prompts(case), GREEDY)]
    np.testing.assert_array_equal(tokens, case.greedy_ids["every2_kda"])


def test_thinning_to_several_placements_keeps_their_union(tmp_path, capsys):
    source = os.path.join(GOLDENS, "supernet_swa")
    case = load_case(source)
    _convert(source, tmp_path / "two", "--placement", "mixed", "--placement", "main", "--dtype", "bfloat16")
    with open(tmp_path / "two" / "placements.json") as f:
        kept = json.load(f)
    assert sorted(kept) == ["main", "mixed"]  # all_swa and mixed2 need mixers that were dropped
    with open(tmp_path / "two" / "apriel2_jax.json") as f:
        manifest = json.load(f)
    dtypes = {k: m["dtype"] for k, m in manifest["tensors"].items()}
    assert dtypes["model.decoder.blocks.2.mixer.mixers.gdn.A_log"] == "float32"  # gate parameters stay fp32
    assert dtypes["model.decoder.blocks.2.mixer.mixers.gdn.in_proj_qkvz.weight"] == "bfloat16"
    assert "model.decoder.blocks.1.mixer.q_proj.weight" in dtypes  # layer 1 keeps only attention: a plain mixer
    llm = LLM(tmp_path / "two", dtype="float32", **SMALL)
    for name in ("main", "mixed"):
        llm.set_placement(name)
        assert len(llm.generate(_prompts(case), GREEDY)) == 2
    assert "converting [" in capsys.readouterr().err


def test_thinned_checkpoint_selects_each_kept_placement_by_name(tmp_path):
    """Layer 0 keeps only sliding_window (a fixed layer), layers 1 and 2 two mixers each: both names still select,
    on the converted model, the mixers they select on the supernet, and compute the same logits."""
    source = os.path.join(GOLDENS, "supernet_swa")
    case = load_case(source)
    _convert(source, tmp_path / "thin", "--placement", "mixed", "--placement", "all_swa")
    named = load_placements(tmp_path / "thin")
    assert sorted(named) == ["all_swa", "mixed"]  # main and mixed2 need mixers that were dropped
    supernet, thinned = load_model(source, "float32"), load_model(tmp_path / "thin", "float32")
    for name in ("mixed", "all_swa"):
        original = resolve_placement(supernet.config, name, case.placements)
        placement = resolve_placement(thinned.config, name, named)
        for layer in range(3):
            assert active_mixer(thinned.config, placement, layer) == active_mixer(supernet.config, original, layer)
        np.testing.assert_array_equal(_forward(thinned, _ids(case), placement),
                                      _forward(supernet, _ids(case), original))
    # Written over the converted model's stochastic layers: layer 0 is a fixed sliding-window layer there.
    assert all("0" not in spec and sorted(spec) == ["1", "2"] for spec in named.values()), named


def test_sharded_source_with_untied_head(tmp_path):
    config = tiny_config()
    weights = random_weights(config, seed=3)
    source = write_checkpoint(str(tmp_path / "src"), config, weights, shards=3)
    _convert(source, tmp_path / "out", "--verify")
    hf, converted = load_model(source), load_model(tmp_path / "out")
    ids = np.arange(1, 13, dtype=np.int32)[None]
    placement = resolve_placement(hf.config)
    np.testing.assert_array_equal(_forward(converted, ids, placement), _forward(hf, ids, placement))


def _source(tmp_path, mutate=None, **write_args):
    config = tiny_config()
    weights = random_weights(config)
    if mutate:
        mutate(weights)
    return write_checkpoint(str(tmp_path / "src"), config, weights, **write_args)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)


def _corrupt_header(path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")


def _set(key, value):
    return lambda w: w.__setitem__(key, value)


BAD_INPUTS = {
    "missing": (lambda w: w.pop("model.decoder.blocks.1.mixer.A_log"), None, "missing (1)", "blocks.1.mixer.A_log"),
    "unexpected": (_set("model.extra.weight", np.zeros(3, np.float32)), None, "unexpected (1)", "model.extra.weight (in model.safetensors)"),
    "wrong shape": (_set("model.decoder.blocks.0.mixer.q_proj.weight", np.zeros((32, 31), np.float32)), None,
                    "wrong shape (1)", "checkpoint [32, 31], model expects [32, 32]"),
    "wrong dtype": (_set("model.norm.weight", np.ones(32, np.int32)), None, "wrong dtype (1)", "model.norm.weight (in model.safetensors): int32"),
    "truncated": (None, _truncate, "model.safetensors", "inconsistent offsets (truncated file?)"),
    "corrupt header": (None, _corrupt_header, "model.safetensors", "cannot read safetensors header"),
    "non-finite": (_set("model.norm.weight", np.full(32, np.nan, np.float32)), None, "model.safetensors", "tensor model.norm.weight holds NaN"),
}


@pytest.mark.parametrize("problem", sorted(BAD_INPUTS))
def test_bad_input_fails_with_its_error_and_writes_nothing(problem, tmp_path, capsys):
    mutate, damage, *needles = BAD_INPUTS[problem]
    source = _source(tmp_path, mutate)
    if damage:
        damage(os.path.join(source, "model.safetensors"))
    out = tmp_path / "converted"
    assert main([source, str(out)]) == 2
    err = capsys.readouterr().err
    assert "apriel2-convert: error:" in err and all(n in err for n in needles), err
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no partial output


def test_placement_errors_and_existing_target(tmp_path, capsys):
    source = os.path.join(GOLDENS, "supernet_swa")
    out = tmp_path / "out"
    assert main([source, str(out), "--placement", "attention,kda,gdn"]) == 2
    assert "--placement 'attention,kda,gdn' does not fit" in capsys.readouterr().err
    assert main([source, str(out), "--placement", "nope"]) == 2
    assert "unknown placement 'nope'" in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == []
    _convert(source, out)
    assert main([source, str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    _convert(source, out, "--force", "--placement", "main")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the replaced conversion is gone, nothing half-done is left
    assert load_placements(out) == {"main": {}}  # every layer fixed: the name still selects the (only) mixers
    (tmp_path / "empty").mkdir()
    assert main([source, str(tmp_path / "empty")]) == 2
    _convert(source, tmp_path / "empty", "--force")  # an empty directory has nothing to lose
    assert sorted(os.listdir(tmp_path)) == ["empty", "out"]


def _tree(root):
    """Every path under ``root`` with its file contents: what a refused conversion must leave as it was."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            out[os.path.relpath(path, root)] = None if not os.path.isfile(path) else open(path, "rb").read()
    return out


# DST (relative to tmp_path; the source is a/src), whether --force is given, and what the error says.
DANGEROUS_TARGETS = {
    "the source": ("a/src", True, ["a/src is the source checkpoint"]),
    "the source's parent": ("a", True, ["contains the source checkpoint", "would delete the source"]),
    "a folder above it": (".", True, ["contains the source checkpoint"]),
    "inside the source": ("a/src/out", False, ["a/src/out is inside the source checkpoint"]),
    "inside the source, forced": ("a/src/out", True, ["is inside the source checkpoint"]),
    "a file": ("notes.txt", True, ["notes.txt exists and is not a directory", "only an earlier conversion"]),
    "another directory": ("data", True, ["data exists and is not an apriel2-jax conversion", "no apriel2_jax.json"]),
    "a link": ("link", True, ["link is a symbolic link"]),
    "a missing parent": ("typo/out", False, ["the parent directory of DST", "typo, does not exist"]),
}


@pytest.mark.parametrize("problem", sorted(DANGEROUS_TARGETS))
def test_target_that_could_lose_data_is_refused_even_with_force(problem, tmp_path, capsys):
    target, force, needles = DANGEROUS_TARGETS[problem]
    config = tiny_config()
    write_checkpoint(str(tmp_path / "a" / "src"), config, random_weights(config))
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "results.csv").write_text("keep me too")
    os.symlink(tmp_path / "data", tmp_path / "link")
    before = _tree(tmp_path)
    assert main([str(tmp_path / "a" / "src"), str(tmp_path / target)] + ["--force"] * force) == 2
    err = capsys.readouterr().err
    assert "apriel2-convert: error: DST" in err or "apriel2-convert: error: the parent" in err, err
    assert all(n in err for n in needles), err
    assert _tree(tmp_path) == before


def test_the_current_directory_is_never_replaced(tmp_path, monkeypatch, capsys):
    config = tiny_config()
    write_checkpoint(str(tmp_path / "src"), config, random_weights(config))
    (tmp_path / "here").mkdir()  # empty: --force could replace it, were it not the shell's directory
    monkeypatch.chdir(tmp_path / "here")
    assert main([str(tmp_path / "src"), ".", "--force"]) == 2
    assert "is the current directory or holds it" in capsys.readouterr().err
    assert os.listdir(tmp_path / "here") == [] and sorted(os.listdir(tmp_path)) == ["here", "src"]


def test_already_converted_source_and_bad_placements_file(tmp_path, capsys):
    source = tmp_path / "src"
    shutil.copytree(os.path.join(GOLDENS, "supernet_swa"), source)
    (source / "placements.json").write_text("{main: [}")
    assert main([str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{source / 'placements.json'}: not valid JSON" in err, err
    (source / "placements.json").unlink()
    _convert(source, tmp_path / "out")
    assert main([str(tmp_path / "out"), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "is already a converted apriel2-jax checkpoint" in err and "load it directly" in err, err
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_exit_status_tells_user_errors_from_internal_ones(tmp_path, monkeypatch, capsys):
    source = _source(tmp_path)
    assert main([source]) == 2  # argparse: DST missing
    assert main([source, str(tmp_path / "out"), "--tp", "0"]) == 2
    assert "apriel2-convert: error:" in capsys.readouterr().err
    monkeypatch.setattr(convert.cli, "source_key", lambda key, renames: "nowhere." + key)  # a thinning bug
    assert main([source, str(tmp_path / "out")]) == 1
    assert "apriel2-convert: internal error: no source tensor" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_console_script_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "convert.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--placement" in proc.stdout and "--tp" in proc.stdout


# The child converts with a writer that stops after the first tensor group, as a long conversion would be
# stopped mid-way, and says so in MARKER.
_STOPPED_CHILD = """
import os, sys, time
import convert.cli
from apriel2_jax import orbax_checkpoint
real = orbax_checkpoint.write_group
def write_group(directory, group, tensors):
    real(directory, group, tensors)
    open(sys.argv[3], "w").close()
    time.sleep(120)
convert.cli.write_group = write_group
sys.exit(convert.cli.main([sys.argv[1], sys.argv[2]]))
"""


def test_sigterm_mid_conversion_removes_the_partial_output(tmp_path):
    import signal
    import time

    source = _source(tmp_path)
    marker = tmp_path / "first-group-written"
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_CHILD, source, str(tmp_path / "out"), str(marker)],
                            stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate(timeout=5)[1] if proc.poll() is not None else "no group written"
    partial = [e for e in os.listdir(tmp_path) if e.startswith(".out.partial-") and not e.endswith(".lock")]
    assert len(partial) == 1 and os.listdir(tmp_path / partial[0])  # it was writing there
    assert os.path.exists(tmp_path / (partial[0] + ".lock"))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "apriel2-convert: terminated" in err, err
    assert sorted(os.listdir(tmp_path)) == ["first-group-written", "src"]


def test_write_group_waits_for_orbax_writers_when_interrupted(tmp_path, monkeypatch):
    from apriel2_jax import orbax_checkpoint

    calls = []

    class Checkpointer:  # save() interrupted while orbax's writer threads still run
        def save(self, path, tree):
            calls.append("save")
            raise KeyboardInterrupt

        def close(self):  # orbax's close() waits for the writers
            calls.append("close")

    monkeypatch.setattr(orbax_checkpoint, "_checkpointer", Checkpointer)
    with pytest.raises(KeyboardInterrupt):
        orbax_checkpoint.write_group(str(tmp_path), "group", {"a": np.zeros(2, np.float32)})
    assert calls == ["save", "close"]


def test_partial_output_of_a_dead_run_is_removed_by_the_next(tmp_path, capsys):
    import fcntl
    import time

    source = _source(tmp_path)

    def partial(label, lock):
        path = tmp_path / f".out.partial-{label}"
        os.makedirs(path / "params")
        if lock:
            (tmp_path / f".out.partial-{label}.lock").touch()
        return path

    dead = partial("host-1", lock=True)  # its lock file is there, nobody holds it: its run was killed
    live = partial("host-2", lock=True)  # a running conversion's (same host name and pid space or not)
    old_unlocked = partial("7", lock=False)  # an older version's, untouched for two hours
    two_hours_ago = time.time() - 7200
    os.utime(old_unlocked, (two_hours_ago, two_hours_ago))
    fresh_unlocked = partial("8", lock=False)  # no lock and recent: it may be a run that has not locked yet
    elsewhere = tmp_path / "elsewhere"
    os.makedirs(elsewhere)
    os.symlink(elsewhere, tmp_path / ".out.partial-link")  # never followed
    holder = os.open(tmp_path / ".out.partial-host-2.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file description: conflicts as another process's would
    try:
        _convert(source, tmp_path / "out")
    finally:
        os.close(holder)
    assert not dead.exists() and not (tmp_path / ".out.partial-host-1.lock").exists()
    assert not old_unlocked.exists()
    assert live.exists() and fresh_unlocked.exists() and elsewhere.exists()
    assert (tmp_path / ".out.partial-link").is_symlink()
    err = capsys.readouterr().err
    assert f"removed {dead}, the partial output of an earlier run" in err and f"removed {old_unlocked}" in err
    assert is_converted(tmp_path / "out")
    assert not any(e.endswith(".lock") and "host-2" not in e for e in os.listdir(tmp_path))  # ours is gone


class _Stream(list):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty

    def write(self, text):
        self.append(text)

    def flush(self):
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_redraws_only_on_a_terminal(tty):
    stream = _Stream(tty)
    progress = convert.cli.Progress("writing", 3, 3 * 2**20, stream)
    for _ in range(3):
        progress.update(2**20)
    text = "".join(stream)
    assert re.fullmatch(r"\r?writing \[#{24}\] 3/3 tensors, 3\.0 MiB/3\.0 MiB, \d+\.\ds\n", text), text
    assert ("\r" in text) == tty
