"""The OpenAI-compatible HTTP API over one ``LLM`` (FastAPI; served by uvicorn).

    app = create_app(llm, model_name="apriel2")           # the engine thread starts with the app (lifespan)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events with ``"stream": true``), ``GET /health`` and ``GET /metrics`` (Prometheus text).

Every admitted request is answered or aborted: a handler closes its engine requests whatever happens (finished,
client gone, handler cancelled); closing an unfinished one aborts it in the engine, which frees its pages and
slot. Errors are OpenAI-style bodies: 400 naming the bad field, 404 for another model, 429 when the queue is
full, 500 when the engine failed on the request, 503 when the engine is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, AsyncIterator, Callable

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm import LLM, StreamEvent
from .engine_loop import EngineError, EngineLoop, EngineUnavailable, QueueFull
from .formatting import Choice, Detokenizer, Responder, sse
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, EngineView, PreparedRequest, error_body,
                       parse_body, prepare_chat, prepare_completion)

__all__ = ["BackgroundServer", "create_app", "DEFAULT_MAX_QUEUED_REQUESTS"]

DEFAULT_MAX_QUEUED_REQUESTS = 1024
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, _ERROR_TYPES.get(status, "invalid_request_error"), param, code),
                        status_code=status)


def create_app(llm: LLM, *, model_name: str | None = None, max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
               log: Callable[[str], None] | None = None) -> FastAPI:
    """The app serving ``llm``, which it owns from start-up to shutdown (the engine thread runs it; nothing else
    may call it meanwhile). ``app.state.engine`` is the :class:`EngineLoop`; ``log`` receives the engine thread's
    messages (failed steps with their tracebacks; default: the engine's log)."""
    if jax.process_count() > 1:
        # Requests reach this host only, while every process of a mesh must run the same steps.
        raise ValueError(f"the server runs on one host; this process is one of {jax.process_count()} joined "
                         "processes (tensor parallelism across hosts runs through apriel2-generate or LLM)")
    model_name = model_name or "apriel2"
    engine = EngineLoop(llm, max_queued_requests=max_queued_requests, metrics=ServerMetrics(), log=log)
    view = EngineView(model_name, llm.config.vocab_size, llm.max_model_len, tuple(llm.config.eos_token_ids),
                      llm.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            # A step may be running: wait for it off the event loop, so open streams still get their errors.
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="apriel2-jax", lifespan=lifespan)
    app.state.engine = engine
    app.state.view = view

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return _error_response(err.status_code, str(err.detail))

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error_response(503, f"the engine is not running ({engine.failed or 'stopped'})")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(engine.snapshot, engine.in_flight, model_name)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(_STARTED), "owned_by": "apriel2-jax",
            "max_model_len": view.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await request.body())
        return await _serve(request, engine, prepare_completion(body, view), chat=False, model=model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await request.body())
        return await _serve(request, engine, prepare_chat(body, view), chat=True, model=model_name)

    return app


_STARTED = time.time()


# ------------------------------------------------------------------------------------------------------------
# Serving one request
# ------------------------------------------------------------------------------------------------------------


async def _serve(request: Request, engine: EngineLoop, prepared: PreparedRequest, chat: bool, model: str):
    queue: asyncio.Queue = asyncio.Queue()
    try:
        tickets = engine.submit(prepared.prompts, prepared.params, queue)
    except QueueFull as err:
        raise APIError(429, str(err), type="rate_limit_error", code="queue_full") from None
    except EngineUnavailable as err:
        raise APIError(503, str(err), type="service_unavailable") from None
    tokenizer = engine.llm.tokenizer
    choices = [Choice(i, ids, Detokenizer(tokenizer) if prepared.logprobs else None)
               for i, ids in enumerate(prepared.prompts)]
    responder = Responder(chat, model, prepared.logprobs, prepared.return_token_ids)

    def close() -> None:
        for ticket in tickets:
            engine.close(ticket)

    if prepared.stream:
        return _EventStream(_stream(queue, choices, responder, prepared.include_usage, close), on_close=close,
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        collect = asyncio.ensure_future(_collect(queue, choices))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
        if not collect.done():  # the client went away: close() aborts its requests; nobody reads an answer
            return Response(status_code=499)
        error = collect.result()
        if error is not None:
            raise _engine_api_error(error, chat)
        return JSONResponse(responder.response(choices))
    finally:
        close()


def _engine_api_error(error: EngineError, chat: bool) -> APIError:
    param = ("messages" if chat else "prompt") if error.status == 400 else None
    return APIError(error.status, error.message, param=param, type=_ERROR_TYPES.get(error.status, "server_error"))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _apply(choice: Choice, event: StreamEvent, logprobs: list[float] | None) -> tuple[list[str], list[float]]:
    """Add one event to ``choice``; the new tokens' texts and log-probabilities (when asked for)."""
    choice.token_ids += event.new_token_ids
    choice.text += event.new_text
    pieces, lps = [], []
    if choice.detokenizer is not None:
        pieces = choice.detokenizer.add(event.new_token_ids)
        lps = list(logprobs or [])
        choice.pieces += pieces
        choice.logprobs += lps
    if event.finished:
        choice.finish_reason = event.output.finish_reason
        if event.output.text is not None:
            choice.text = event.output.text
    return pieces, lps


async def _collect(queue: asyncio.Queue, choices: list[Choice]) -> EngineError | None:
    """Wait for every choice to finish; the first engine error instead, if one fails."""
    while not all(c.finished for c in choices):
        tag, item, logprobs = await queue.get()
        if isinstance(item, EngineError):
            return item
        _apply(choices[tag], item, logprobs)
    return None


async def _stream(queue: asyncio.Queue, choices: list[Choice], responder: Responder, include_usage: bool,
                  close: Callable[[], None]) -> AsyncIterator[str]:
    try:
        if responder.chat:  # the assistant role first, as OpenAI does, so clients see the stream start at once
            for c in choices:
                yield sse(responder.chunk(c, "", [], [], [], 0, None))
        while not all(c.finished for c in choices):
            # Everything already delivered goes out as one chunk per choice (a decode dispatch brings several).
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            new: dict[int, list[Any]] = {}
            for tag, item, logprobs in items:
                if isinstance(item, EngineError):
                    yield sse(_engine_api_error(item, responder.chat).body())
                    yield sse("[DONE]")
                    return
                choice = choices[tag]
                offset = len(choice.text)
                pieces, lps = _apply(choice, item, logprobs)
                text = choice.text[offset:] if item.finished else item.new_text
                entry = new.setdefault(tag, ["", [], [], [], offset])
                entry[0] += text
                entry[1] += item.new_token_ids
                entry[2] += pieces
                entry[3] += lps
            for tag, (text, ids, pieces, lps, offset) in sorted(new.items()):
                choice = choices[tag]
                if text or ids or choice.finished:
                    yield sse(responder.chunk(choice, text, ids, pieces, lps, offset, choice.finish_reason))
        if include_usage:
            yield sse(responder.usage_chunk(choices))
        yield sse("[DONE]")
    finally:
        close()  # also when the client disconnected and the response task was cancelled


class _EventStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (even cancelled before its first chunk)."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ------------------------------------------------------------------------------------------------------------
# Running a server in a thread (tests, benchmarks)
# ------------------------------------------------------------------------------------------------------------


class BackgroundServer:
    """uvicorn serving ``app`` on its own thread and event loop; ``start()`` returns once it accepts requests.

        with BackgroundServer(create_app(llm), port=0) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app = app
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                     timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 600.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, name="apriel2-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited before it started (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout}s")
            time.sleep(0.01)
        # Port 0 asks the OS for a free port: read back the one bound.
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
