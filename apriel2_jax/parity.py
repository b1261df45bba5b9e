"""Parity checks of a loaded model against a directory in the goldens format (``shared/goldens/README.md``).

A case directory holds an HF checkpoint (``config.json``, safetensors), ``placements.json`` and
``golden.safetensors`` with ``input_ids`` [B, T], and per placement P: ``P.logits`` [B, T, V] (full forward) and
``P.greedy_ids`` [B, N] (greedy continuation of the first ``prompt_len`` tokens; metadata ``prompt_len``).

Three checks per placement:
  forward  full forward of ``input_ids`` vs ``P.logits``;
  decode   prefill of the first ``prompt_len`` tokens, then one-token steps over the rest, vs ``P.logits``;
  greedy   greedy generation from the prompt vs ``P.greedy_ids``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .checkpoint import load_model
from .placement import load_placements, resolve_placement
from .runner import ModelRunner
from .safetensors_io import CheckpointError, read_header, read_tensor
from .sharding import make_mesh

FLOAT32_TOLERANCE = 1e-3
# The goldens are fp32 with weights scaled so that every parameter matters. Rounding those weights to bf16 alone
# (fp32 compute) moves the logits by up to 8% of their scale (measured 2026-11-22: 0.08-3.4 on scales 10-45), and
# bf16 activations add as much again: the worst bf16 error was 9% of scale on CPU and 19% on an H200 (KDA
# placement of hybrid_all_mixers, 2.14 on scale 11). A bf16 run can therefore only be checked for gross errors
# (a wrong dtype path gives garbage); greedy tokens may differ where the top-2 gap is about 0.01, and are
# reported, not failed. Tight bf16 parity needs bf16 goldens from the reference.
BFLOAT16_RELATIVE_TOLERANCE = 0.25


@dataclasses.dataclass
class GoldenCase:
    directory: str
    input_ids: np.ndarray
    prompt_len: int
    logits: dict[str, np.ndarray]
    greedy_ids: dict[str, np.ndarray]
    placements: dict[str, object]


def load_case(directory: str) -> GoldenCase:
    path = os.path.join(directory, "golden.safetensors")
    if not os.path.exists(path):
        raise CheckpointError(f"no golden.safetensors in {directory}: not a goldens-format case directory")
    infos, metadata = read_header(path)
    if "input_ids" not in infos or "prompt_len" not in metadata:
        raise CheckpointError(f"{path}: expected tensor 'input_ids' and metadata 'prompt_len'")
    placements_path = os.path.join(directory, "placements.json")
    placements = load_placements(placements_path) if os.path.exists(placements_path) else {"main": None}
    logits, greedy = {}, {}
    for name in placements:
        for suffix, store in (("logits", logits), ("greedy_ids", greedy)):
            key = f"{name}.{suffix}"
            if key not in infos:
                raise CheckpointError(f"{path}: placement {name!r} has no tensor {key!r}")
            store[name] = np.array(read_tensor(infos[key]))
    return GoldenCase(
        directory=directory,
        input_ids=np.array(read_tensor(infos["input_ids"])),
        prompt_len=int(metadata["prompt_len"]),
        logits=logits,
        greedy_ids=greedy,
        placements=placements,
    )


@dataclasses.dataclass
class CheckResult:
    placement: str
    check: str
    error: float  # max abs logit error (forward/decode) or number of differing tokens (greedy)
    passed: bool
    detail: str = ""
    checked: bool = True  # False: reported only (bf16 greedy tokens), so passed says nothing about it


def run_checks(
    directory: str,
    placement: str | None = None,
    dtype: str = "float32",
    checks=("forward", "decode", "greedy"),
    tensor_parallel: int | None = None,
) -> list[CheckResult]:
    """``tensor_parallel`` N (1 included) runs the tensor-parallel path over N devices: the forward check runs the
    split model, the greedy check the serving engine over it (the dense-cache decode check has no split form)."""
    case = load_case(directory)
    names = list(case.placements)
    if placement is not None:
        if placement not in case.placements:
            hint = (" (a placement here is a name: the goldens hold logits and tokens per named placement, not per "
                    "mixer list)" if "," in placement else "")
            raise ValueError(f"placement {placement!r} is not in {directory}/placements.json; known: {names}{hint}")
        names = [placement]
    if tensor_parallel is not None:
        return _run_split_checks(directory, case, names, dtype, [c for c in checks if c != "decode"], tensor_parallel)
    runner = ModelRunner(load_model(directory, dtype))
    batch, total = case.input_ids.shape
    p = case.prompt_len
    # One cache size for the decode and greedy checks, so both reuse the same compiled prefill and step.
    cache_len = max(total, p + max(g.shape[1] for g in case.greedy_ids.values()))
    results = []
    for name in names:
        resolved = resolve_placement(runner.config, name, case.placements)
        ref = case.logits[name]
        tolerance = _tolerance(case, name, dtype)

        def logit_result(check: str, ours: np.ndarray, expected: np.ndarray) -> CheckResult:
            error = float(np.abs(np.asarray(ours, np.float32) - expected).max())
            return CheckResult(name, check, error, error <= tolerance, f"tol {tolerance:.2g}")

        if "forward" in checks:
            results.append(logit_result("forward", runner.forward(case.input_ids, resolved), ref))
        if "decode" in checks:
            cache = runner.init_cache(batch, cache_len, resolved)
            logits, cache = runner.extend(case.input_ids[:, :p], 0, cache, resolved)
            pieces = [np.asarray(logits, np.float32)]
            for t in range(p, total):
                logits, cache = runner.extend(case.input_ids[:, t : t + 1], t, cache, resolved)
                pieces.append(np.asarray(logits, np.float32))
            results.append(logit_result("decode", np.concatenate(pieces, axis=1), ref))
        if "greedy" in checks:
            expected = case.greedy_ids[name]
            ours = runner.greedy(case.input_ids[:, :p], expected.shape[1], resolved, cache_len)
            results.append(_greedy_result(name, ours, expected, dtype))
    return results


def _tolerance(case, name: str, dtype: str) -> float:
    return FLOAT32_TOLERANCE if dtype == "float32" else BFLOAT16_RELATIVE_TOLERANCE * float(np.abs(case.logits[name]).max())


def _greedy_result(name: str, ours: np.ndarray, expected: np.ndarray, dtype: str) -> CheckResult:
    differ = int((ours != expected).sum())
    # In bf16 a differing greedy token is reported, not failed: see BFLOAT16_RELATIVE_TOLERANCE.
    checked = dtype == "float32"
    passed = differ == 0 or not checked
    detail = "all tokens equal" if differ == 0 else f"first difference at step {int(np.argmax((ours != expected).any(0)))}"
    return CheckResult(name, "greedy", float(differ), passed, detail, checked=checked or differ == 0)


def _run_split_checks(directory, case, names, dtype, checks, tensor_parallel) -> list[CheckResult]:
    from .engine.llm import LLM
    from .engine.sampling import SamplingParams

    model = load_model(directory, dtype, tensor_parallel=make_mesh(tensor_parallel))
    p = case.prompt_len
    llm = None
    results = []
    for name in names:
        resolved = resolve_placement(model.config, name, case.placements)
        tolerance = _tolerance(case, name, dtype)
        if "forward" in checks:
            error = float(np.abs(np.asarray(model.forward(case.input_ids, resolved), np.float32) - case.logits[name]).max())
            results.append(CheckResult(name, "forward", error, error <= tolerance, f"tol {tolerance:.2g}, tp {tensor_parallel}"))
        if "greedy" in checks:
            expected = case.greedy_ids[name]
            if llm is None:
                # A cache and token budget sized to the case: the defaults would take most of the device.
                longest = p + max(g.shape[1] for g in case.greedy_ids.values())
                llm = LLM(model=model, dtype=dtype, placements=case.placements, placement=name, warm_up="none",
                          max_num_seqs=case.input_ids.shape[0], max_model_len=longest + 1,
                          max_num_batched_tokens=max(64, case.input_ids.shape[0] * p), cache_bytes=64 * 2**20,
                          log=lambda msg: None)
            llm.set_placement(name)
            params = SamplingParams.greedy(max_new_tokens=expected.shape[1], ignore_eos=True)
            outputs = llm.generate([[int(t) for t in row[:p]] for row in case.input_ids], params)
            results.append(_greedy_result(name, np.array([o.token_ids for o in outputs]), expected, dtype))
    return results


def format_table(results: list[CheckResult]) -> str:
    rows = [("placement", "check", "max abs error / tokens differing", "result", "")]
    for r in results:
        value = f"{int(r.error)}" if r.check == "greedy" else f"{r.error:.3e}"
        result = "FAIL" if not r.passed else ("ok" if r.checked else "differs (bf16: reported, not checked)")
        rows.append((r.placement, r.check, value, result, r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
