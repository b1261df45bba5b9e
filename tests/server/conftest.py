"""A live server for the tests of this directory: the hybrid_all_mixers golden (its 'mamba' placement: full
attention, a window of 8, GDN, KDA and Mamba layers) with a small BPE tokenizer and chat template built here,
served by uvicorn on 127.0.0.1 (a free port) from a background thread. One session-wide server: compiling the
engine's steps dominates the run time on CPU, so every test shares it and its few step shapes."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.step import Buckets
from apriel2_jax.engine.tokenizer import Tokenizer
from apriel2_jax.server import BackgroundServer, create_app
from tests.conftest import GOLDENS
from tests.engine.test_tokenizer import write_tiny_tokenizer

CASE = os.path.join(GOLDENS, "hybrid_all_mixers")
MODEL = "tiny-hybrid"
MAX_QUEUED = 128
# max_num_seqs 4: the load test's 64 streams queue. Three step shapes (decode at 4 rows; prefill of 1 or 4 rows of
# up to 32 tokens); longer prompts are prefilled in chunks of 32.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, max_chunk=32, max_prefill_rows=4,
              page_size=4, cache_bytes=4 * 2**20, warm_up=False, buckets=Buckets((4,), (1, 4), (32,)),
              log=lambda msg: None)


def wait_until(condition, timeout: float = 60.0, interval: float = 0.01, message: str = "condition"):
    """Poll ``condition()`` until it is truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve_ckpt")
    for name in ("config.json", "model.safetensors", "placements.json"):
        shutil.copy(os.path.join(CASE, name), directory / name)
    write_tiny_tokenizer(directory, vocab_size=128)  # <unk>=0, <s>=1, </s>=2: the golden's bos/eos ids
    return str(directory)


ENGINE_LOG: list[str] = []  # the engine thread's messages (a failed step logs its traceback here)


@pytest.fixture(scope="session")
def server(text_ckpt):
    llm = LLM(text_ckpt, placement="mamba", tokenizer=Tokenizer.from_dir(text_ckpt), **ENGINE)
    app = create_app(llm, model_name=MODEL, max_queued_requests=MAX_QUEUED, log=ENGINE_LOG.append)
    with BackgroundServer(app) as running:
        yield running


@pytest.fixture(autouse=True)
def no_engine_failures():
    """A test fails if the engine thread logged a failure it did not ask for (tests that inject one take their
    messages out of ENGINE_LOG)."""
    start = len(ENGINE_LOG)
    yield
    assert ENGINE_LOG[start:] == [], "engine thread failures:\n" + "\n".join(ENGINE_LOG[start:])


@pytest.fixture(scope="session")
def engine(server):
    return server.app.state.engine


def engine_idle(engine) -> bool:
    """Nothing queued, running or referenced in any cache family (read on the engine thread)."""
    def check(llm):
        return not llm.has_unfinished_requests and all(used == 0 for used, _ in llm.cache_manager.usage().values())
    return engine.in_flight == 0 and engine.call(check).result(timeout=60)


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
