"""OpenAI-compatible HTTP serving (``apriel2-serve``): the FastAPI app, the engine thread, request translation
and Prometheus metrics. Needs the ``serve`` extra (fastapi, uvicorn)."""

from .app import BackgroundServer, create_app
from .engine_loop import EngineLoop

__all__ = ["BackgroundServer", "EngineLoop", "create_app"]
