"""The persistent XLA compilation cache: compiled steps survive the process, so a warm start-up loads them.

On by default, in a per-user directory: ``$APRIEL2_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/apriel2-jax/xla``,
else ``~/.cache/apriel2-jax/xla``. ``APRIEL2_JAX_CACHE_DIR=off`` (or ``directory="off"``) turns it off. A cache
directory the user already gave JAX (``JAX_COMPILATION_CACHE_DIR``) is left as it is.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "APRIEL2_JAX_CACHE_DIR"
OFF = ("off", "none", "0", "false", "")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "apriel2-jax", "xla")


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Point JAX's persistent cache at ``directory`` (None: the environment or the per-user default); returns
    the directory in use, or None when the cache is off."""
    given = "directory" if directory is not None else None
    chosen = os.fspath(directory) if directory is not None else os.environ.get(ENV)
    if given is None and chosen is not None:
        given = ENV
    if chosen is not None and chosen.strip().lower() in OFF:
        return None
    if chosen is None:
        existing = jax.config.jax_compilation_cache_dir
        if existing:
            return existing
        chosen = default_cache_dir()
    chosen = os.path.abspath(os.path.expanduser(chosen))
    if jax.config.jax_compilation_cache_dir == chosen:
        return chosen
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError as error:
        fix = ("give a writable directory, or 'off'" if given == "directory" else
               f"set {ENV} to a writable directory, or to 'off'")  # where it came from is what to change
        raise OSError(f"cannot create the compilation cache directory {chosen!r} ({error.strerror}); {fix}") from error
    # Every engine step is worth keeping (even a one-second compile is much of a warm start-up); the many tiny
    # jits of model set-up are not.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    compilation_cache.reset_cache()  # a cache already initialised (e.g. without a directory) re-reads the config
    compilation_cache.set_cache_dir(chosen)
    return chosen
