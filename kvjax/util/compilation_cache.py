"""JAX's persistent compilation cache for kvjax's programs, so a second run of a command does not compile again."""

from __future__ import annotations

import os


def enable_compilation_cache() -> str | None:
    """Point JAX's persistent cache at `$KVJAX_COMPILATION_CACHE` (default `~/.cache/kvjax/jax`); returns the
    folder, or None when the variable is `off` (the test suite: a process-wide switch)."""
    import jax

    default = os.path.join(os.path.expanduser("~"), ".cache", "kvjax", "jax")
    cache_dir = os.environ.get("KVJAX_COMPILATION_CACHE", default)
    if cache_dir.lower() == "off":
        return None
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir
