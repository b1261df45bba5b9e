"""Serving engine: cache families, host-side cache manager, scheduler, jitted step, sampling, LLM API."""
