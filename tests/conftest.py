import atexit
import os
import shutil
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Eight virtual CPU devices for the tensor-parallel tests (set before JAX initialises; the default device, and so
# every other test, stays device 0).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Tests never write the user's persistent compilation cache. They share one for the session, in a temporary
# directory removed at exit: many tests build engines over the same golden models, and on the CPU compiling their
# steps is most of a test's time (a prefix-caching test: 56 s with an empty cache, 18 s with its steps cached). Tests of the
# cache give their own directory; APRIEL2_JAX_CACHE_DIR set by the caller (e.g. "off") is kept.
if "APRIEL2_JAX_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="apriel2-jax-test-xla-")
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
    os.environ["APRIEL2_JAX_CACHE_DIR"] = _SESSION_CACHE

from apriel2_jax.compilation_cache import enable_compilation_cache  # noqa: E402  (after XLA_FLAGS)

enable_compilation_cache()  # also for tests that compile without an engine (parity runners, tensor parallelism)

GOLDENS = os.environ.get("APRIEL2_GOLDENS", os.path.join(REPO, "..", "shared", "goldens"))


def golden_cases() -> list[str]:
    """Every goldens-format case directory. Missing goldens are an error, never a silent skip."""
    if not os.path.isdir(GOLDENS):
        raise RuntimeError(f"golden fixtures not found at {GOLDENS}; set APRIEL2_GOLDENS")
    cases = sorted(d for d in os.listdir(GOLDENS) if os.path.exists(os.path.join(GOLDENS, d, "golden.safetensors")))
    if not cases:
        raise RuntimeError(f"no golden cases under {GOLDENS}")
    return cases


@pytest.fixture(scope="session")
def goldens_dir() -> str:
    golden_cases()
    return GOLDENS
