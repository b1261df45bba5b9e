"""Concurrency and failure paths of the live server: 64 concurrent streams against the offline engine's tokens,
clients that disconnect mid-stream (or before a non-streamed answer), malformed bodies, a full queue and an
engine step that raises. After each, nothing may be left queued, running or referenced in the caches."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import numpy as np
import pytest

from apriel2_jax.engine.sampling import SamplingParams
from tests.server.conftest import ENGINE_LOG, MODEL, engine_idle, metric, wait_until

STREAMS = 64


def _sse_data(lines) -> list[dict]:
    """The JSON events of an SSE body, checking that it ends with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics").text


@pytest.fixture(scope="module")
def workload():
    """64 token-id prompts of 2-45 tokens (some chunked at 32) with 1-20 greedy tokens each; a few share prefixes."""
    rng = np.random.default_rng(17)
    prompts = [[int(t) for t in rng.integers(3, 128, size=int(n))] for n in rng.integers(2, 46, size=STREAMS)]
    for i in range(0, STREAMS, 8):  # shared prefixes exercise the prefix cache under load
        prompts[i + 1] = prompts[i][:20] + prompts[i + 1][:10]
    max_tokens = [int(m) for m in rng.integers(1, 21, size=STREAMS)]
    return prompts, max_tokens


def test_concurrent_streams_match_offline_generate(server, engine, workload):
    prompts, max_tokens = workload
    expected = engine.call(lambda llm: llm.generate(
        prompts, [SamplingParams.greedy(max_new_tokens=m, ignore_eos=True) for m in max_tokens])).result(timeout=600)
    before = _metrics(server)

    async def one(client, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = _sse_data([line async for line in r.aiter_lines()])
        ids = [t for e in events for t in e["choices"][0].get("token_ids", [])]
        return ids, events[-1]["choices"][0]["finish_reason"], len(events)

    async def run():
        limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))

    results = asyncio.run(run())
    for i, ((ids, reason, _), out) in enumerate(zip(results, expected)):
        assert ids == out.token_ids, f"stream {i}"
        assert reason == "length"
    assert max(n for *_, n in results) > 1  # tokens did arrive in several chunks, not only at the end
    wait_until(lambda: engine_idle(engine), message="every page and slot to be freed")
    after = _metrics(server)
    finished = 'finish_reason="length"'
    assert (metric(after, "apriel2_requests_finished_total", finished)
            - metric(before, "apriel2_requests_finished_total", finished)) == STREAMS
    assert (metric(after, "apriel2_generation_tokens_total")
            - metric(before, "apriel2_generation_tokens_total")) == sum(max_tokens)
    assert metric(after, "apriel2_time_to_first_token_seconds_count") >= STREAMS
    assert metric(after, "apriel2_requests_running") == 0 and metric(after, "apriel2_requests_waiting") == 0
    assert metric(after, "apriel2_cache_used", 'family="full"') == 0
    assert metric(after, "apriel2_prefix_cache_family_hit_rate", 'family="full"') > 0


def test_streams_complete_while_others_disconnect_mid_stream(server, engine, workload):
    """32 concurrent streams on shared keep-alive connections, every fourth closed by its client after its first
    chunk: the others finish with [DONE] and the offline engine's tokens; every request ends (length or abort)
    and nothing stays referenced."""
    prompts, max_tokens = workload[0][:32], workload[1][:32]
    quits = set(range(0, 32, 4))
    keep = [i for i in range(32) if i not in quits]
    expected = engine.call(lambda llm: llm.generate(
        [prompts[i] for i in keep],
        [SamplingParams.greedy(max_new_tokens=max_tokens[i], ignore_eos=True) for i in keep])).result(timeout=600)
    before = _metrics(server)

    async def one(client, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 400 if i in quits else max_tokens[i],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
        lines = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                lines.append(line)
                if i in quits and line.startswith("data: "):
                    return None  # leaving the block closes the connection mid-stream
        events = _sse_data(lines)
        return [t for e in events for t in e["choices"][0].get("token_ids", [])]

    async def run():
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    for i, out in zip(keep, expected):
        assert results[i] == out.token_ids, f"stream {i}"
    wait_until(lambda: engine_idle(engine), message="every page and slot to be freed")
    after = _metrics(server)

    def ended(reason):
        label, name = f'finish_reason="{reason}"', "apriel2_requests_finished_total"
        return metric(after, name, label) - metric(before, name, label)
    assert ended("length") + ended("abort") == 32
    assert ended("abort") >= 1  # 400 tokens take many dispatches: at least one closed stream was aborted


LONG = {"model": MODEL, "prompt": "hello world", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


class StepGate:
    """Holds the engine thread before each step while closed, so a test decides when requests may progress (a
    request cannot finish behind the test's back, whatever the machine's speed)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._budget: int | None = None  # steps still allowed; None: no limit

    def allow(self, steps: int | None) -> None:
        with self._cond:
            self._budget = steps
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._budget == 0:
                self._cond.wait()
            if self._budget is not None:
                self._budget -= 1


@pytest.fixture
def gate(engine):
    """The engine's steps pass through a StepGate (installed and removed on the engine thread)."""
    gate = StepGate()

    def install(llm):
        real = llm.step

        def gated():
            gate.wait()
            return real()
        llm.step = gated

    def remove(llm):
        del llm.step

    engine.call(install).result(timeout=60)
    yield gate
    gate.allow(None)
    engine.call(remove).result(timeout=60)


def _aborts(server) -> float:
    return metric(_metrics(server), "apriel2_requests_finished_total", 'finish_reason="abort"')


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {**{k: v for k, v in LONG.items() if k != "prompt"},
                              "messages": [{"role": "user", "content": "hello world"}]}),
])
def test_stream_disconnect_aborts_the_request(server, engine, gate, endpoint, body):
    aborts = _aborts(server)
    gate.allow(1)  # the prefill (the first token), then the engine holds with 479 tokens to go
    with httpx.Client(base_url=server.url, timeout=300) as client:
        with client.stream("POST", endpoint, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": ""' not in line:  # past chat's role chunk
                    break
            assert '"finish_reason": null' in line
    # The server notices the disconnect and lets go of the request while the engine holds it; the engine aborts
    # it at its next look at the inbox.
    wait_until(lambda: engine.in_flight == 0, message="the server to see the disconnect")
    gate.allow(None)
    wait_until(lambda: _aborts(server) == aborts + 1, message="the abort")
    wait_until(lambda: engine_idle(engine), message="the aborted request's pages and slot to be freed")


def test_non_streamed_disconnect_aborts_the_request(server, engine, gate):
    aborts = _aborts(server)
    gate.allow(1)  # the prefill only
    payload = json.dumps(LONG).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: engine.in_flight == 1, message="the request to be admitted")
    wait_until(lambda: engine.in_flight == 0, message="the server to see the disconnect")
    gate.allow(None)
    wait_until(lambda: _aborts(server) == aborts + 1, message="the abort")
    wait_until(lambda: engine_idle(engine), message="the aborted request's pages and slot to be freed")


MSG = [{"role": "user", "content": "hi"}]
MALFORMED = [
    # (endpoint, raw body, the field the error must name (None: the body as a whole), status)
    ("/v1/completions", b"{not json", None, 400),
    ("/v1/completions", b"", None, 400),
    ("/v1/completions", b"[1, 2]", None, 400),
    ("/v1/completions", {"model": MODEL}, "prompt", 400),
    ("/v1/completions", {"prompt": 5}, "prompt", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens", 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", 400),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k", 400),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed", 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, "logprobs", 400),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", 400),
    ("/v1/completions", {"prompt": ""}, "prompt", 400),
    ("/v1/completions", {"prompt": [5, 500]}, "prompt", 400),
    ("/v1/completions", {"prompt": [5] * 600}, "prompt", 400),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]", 400),
    ("/v1/completions", {"prompt": [[1, 2], [3, 999]]}, "prompt[1]", 400),
    ("/v1/completions", {"prompt": "hi", "model": "other"}, "model", 404),
    ("/v1/chat/completions", {"messages": []}, "messages", 400),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role", 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", 400),
    # Content may be absent only from an assistant message with tool_calls (else the template renders "None").
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", 400),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, *MSG]}, "messages[0].content", 400),
    ("/v1/chat/completions", {"messages": [*MSG, {"role": "assistant"}, *MSG]}, "messages[1].content", 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", 400),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2, "logprobs": True}, "top_logprobs", 400),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", 400),
    ("/v1/chat/completions", {"messages": MSG, "presence_penalty": 1.0}, "presence_penalty", 400),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     400),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice", 400),
    ("/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions", 400),
    ("/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}], "tool_choice": "none"}, "functions", 400),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format", 400),
]


def test_malformed_bodies_get_400_naming_the_field(server, engine):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for endpoint, body, param, status in MALFORMED:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(endpoint, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error" and error["message"], error
            if param is not None:
                assert error["message"].startswith(param.split("[")[0]), error
        r = client.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
    assert engine.in_flight == 0  # nothing was admitted


def test_full_queue_answers_429(server, engine, gate):
    limit = engine.max_in_flight
    gate.allow(0)  # admitted requests stay in flight until the end of the test
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            engine.max_in_flight = engine.in_flight + 1
            with client.stream("POST", "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
                assert r.status_code == 200
                wait_until(lambda: engine.in_flight == engine.max_in_flight, message="the request to be admitted")
                refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "queue_full"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                engine.max_in_flight += 1
                batch = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
                assert batch.status_code == 429  # all of a batch or none, even with room for one
    finally:
        engine.max_in_flight = limit
        gate.allow(None)
    assert metric(_metrics(server), "apriel2_requests_rejected_total", 'reason="queue_full"') >= 2
    wait_until(lambda: engine_idle(engine), message="the engine to drain")


def test_engine_failure_fails_requests_and_keeps_serving(server, engine):
    def break_next_step(llm):
        real = llm.step

        def failing():
            del llm.step  # back to the real method for the steps after this one
            raise RuntimeError("injected device failure")
        llm.step = failing
        return real

    with httpx.Client(base_url=server.url, timeout=300) as client:
        engine.call(break_next_step).result(timeout=60)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500
        assert "injected device failure" in r.json()["error"]["message"]
        engine.call(break_next_step).result(timeout=60)
        with client.stream("POST", "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
            events = _sse_data(list(r.iter_lines()))
        assert "injected device failure" in events[-1]["error"]["message"]
        wait_until(lambda: engine_idle(engine), message="the failed requests' pages to be freed")
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health").status_code == 200
    failures = [m for m in ENGINE_LOG if "engine step failed" in m]
    assert len(failures) == 2 and all("injected device failure" in m for m in failures)
    ENGINE_LOG[:] = [m for m in ENGINE_LOG if m not in failures]
