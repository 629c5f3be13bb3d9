"""Count the programs JAX builds while a block runs, from its own monitoring events.

Notes: docs/modules.md (`kvjax/util/compile_count.py`)."""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator

import jax

LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_open: list["Compiles"] = []
_lock = threading.Lock()
_registered = False


class Compiles:
    """Programs built while the block was open, by jitted function name (`jit(append_chunk)` -> `append_chunk`);
    `backend` counts the ones the backend compiled (not read from the persistent cache)."""

    def __init__(self):
        self.by_name: collections.Counter = collections.Counter()
        self.backend: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def of(self, name: str) -> int:
        """Programs built for jitted functions named `name` (the Python function's name)."""
        return self.by_name[name]

    def __repr__(self) -> str:
        return f"Compiles({dict(self.by_name)})"


def _name(fun_name: str) -> str:
    return fun_name[4:-1] if fun_name.startswith("jit(") and fun_name.endswith(")") else fun_name


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event not in (LOWER_EVENT, COMPILE_EVENT):
        return
    name = _name(str(kwargs.get("fun_name", "?")))
    with _lock:
        for block in _open:
            (block.by_name if event == LOWER_EVENT else block.backend)[name] += 1


def _ensure_listener() -> None:
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True


@contextlib.contextmanager
def count_compiles() -> Iterator[Compiles]:
    """A `Compiles` counter of the backend compilations that happen inside the block."""
    _ensure_listener()
    block = Compiles()
    with _lock:
        _open.append(block)
    try:
        yield block
    finally:
        with _lock:
            _open.remove(block)


__all__ = ["COMPILE_EVENT", "LOWER_EVENT", "Compiles", "count_compiles"]
