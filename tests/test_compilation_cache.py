"""The persistent compilation cache: directory choice (argument, environment, per-user default, off) and a
compiled function written there."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from apriel2_jax.compilation_cache import ENV, default_cache_dir, enable_compilation_cache


@pytest.fixture
def restore_jax_cache():
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    jax_cache.reset_cache()


def test_default_directory_is_per_user(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "apriel2-jax", "xla")


@pytest.mark.parametrize("value", ["off", "OFF", "none", "0", ""])
def test_off_leaves_jax_alone(monkeypatch, restore_jax_cache, value):
    monkeypatch.setenv(ENV, value)
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache() is None
    assert enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before


def test_environment_and_argument_choose_the_directory_and_compiles_land_there(monkeypatch, tmp_path,
                                                                               restore_jax_cache):
    monkeypatch.setenv(ENV, str(tmp_path / "from_env"))
    assert enable_compilation_cache() == str(tmp_path / "from_env")
    chosen = enable_compilation_cache(tmp_path / "given")  # an argument beats the environment
    assert chosen == str(tmp_path / "given") == jax.config.jax_compilation_cache_dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 1.0)(jnp.arange(7.0)).block_until_ready()
    assert os.listdir(chosen), "the compiled executable was not written to the cache directory"


def test_unwritable_directory_says_what_to_do(tmp_path, restore_jax_cache):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # The fix names where the directory came from: the argument, or the environment variable.
    with pytest.raises(OSError, match="give a writable directory, or 'off'"):
        enable_compilation_cache(blocker / "xla")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, str(blocker / "xla"))
        with pytest.raises(OSError, match=f"set {ENV} to a writable directory"):
            enable_compilation_cache()
