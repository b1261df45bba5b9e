"""Every golden case and placement: full forward, prefill + decode, and greedy generation in float32 against the
outputs of the original PyTorch implementation (../shared/goldens)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from apriel2_jax.parity import FLOAT32_TOLERANCE, format_table, run_checks
from tests.conftest import GOLDENS, REPO, golden_cases


def _case_placements():
    pairs = []
    for case in golden_cases():
        with open(os.path.join(GOLDENS, case, "placements.json")) as f:
            pairs.extend((case, name) for name in json.load(f))
    return pairs


@pytest.mark.parametrize("case, placement", _case_placements())
def test_golden_parity_float32(case, placement):
    results = run_checks(os.path.join(GOLDENS, case), placement, "float32")
    table = format_table(results)
    assert [r.check for r in results] == ["forward", "decode", "greedy"], table
    for r in results:
        if r.check == "greedy":
            assert r.error == 0, table
        else:
            assert r.error <= FLOAT32_TOLERANCE, table
    assert all(r.passed for r in results), table


def test_check_parity_script_reports_and_fails_on_mismatch(tmp_path):
    """The CLI prints a row per placement and check, exits 0 on the goldens and 1 when a logit is off."""
    case = os.path.join(GOLDENS, "mamba_gdn_variants")
    script = os.path.join(REPO, "scripts", "check_parity.py")
    ok = subprocess.run([sys.executable, script, case], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert sum(line.startswith("main ") for line in ok.stdout.splitlines()) == 3

    # A copy of the case whose reference logits are perturbed by 1e-2 at one position must fail.
    from safetensors.numpy import load_file, save_file

    from apriel2_jax.safetensors_io import read_header

    bad = tmp_path / "bad_case"
    bad.mkdir()
    for name in ("config.json", "model.safetensors", "placements.json"):
        os.symlink(os.path.join(case, name), bad / name)
    golden = load_file(os.path.join(case, "golden.safetensors"))
    golden["main.logits"] = golden["main.logits"].copy()
    golden["main.logits"][1, 25, 3] += np.float32(1e-2)
    _, metadata = read_header(os.path.join(case, "golden.safetensors"))
    save_file(golden, str(bad / "golden.safetensors"), metadata=metadata)
    failed = subprocess.run([sys.executable, script, str(bad)], capture_output=True, text=True)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAIL" in failed.stdout

    missing = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and "golden.safetensors" in missing.stderr
    assert missing.stderr.startswith("apriel2-check-parity: error:"), missing.stderr
    nowhere = subprocess.run([sys.executable, script, str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert nowhere.returncode == 2 and "does not exist" in nowhere.stderr, nowhere.stderr


def test_bf16_greedy_differences_read_as_reported_not_as_ok():
    from apriel2_jax.parity import _greedy_result

    expected = np.array([[1, 2, 3, 4]])
    differing = _greedy_result("main", np.array([[1, 2, 9, 4]]), expected, "bfloat16")
    assert differing.passed and not differing.checked  # not a failure in bf16, and not called ok either
    assert _greedy_result("main", np.array([[1, 2, 9, 4]]), expected, "float32").passed is False
    assert _greedy_result("main", expected, expected, "bfloat16").checked
    rows = format_table([differing, _greedy_result("main", expected, expected, "bfloat16")]).splitlines()
    assert "not checked" in rows[1] and " ok " not in rows[1] + " " and "step 2" in rows[1]
    assert rows[2].split()[3] == "ok"


def test_unknown_placement_list_says_placements_are_names():
    with pytest.raises(ValueError, match="is a name"):
        run_checks(os.path.join(GOLDENS, "supernet_swa"), "attention,attention", "float32")
