"""Serving: the batch engine (`batch_engine.BatchEngine`), which serves every policy with `generate`'s own
prefill, step, state and decode loop, and the OpenAI-compatible HTTP server over it (`http`).

`batch_engine` imports jax and is loaded on first use.
"""

_BATCH_ENGINE_NAMES = ("BatchEngine", "BatchRequest")


def __getattr__(name: str):
    if name in _BATCH_ENGINE_NAMES:
        from kvjax.serving import batch_engine

        return getattr(batch_engine, name)
    raise AttributeError(f"module 'kvjax.serving' has no attribute {name!r}")


__all__ = [*_BATCH_ENGINE_NAMES]
