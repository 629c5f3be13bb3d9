"""Joining JAX's multi-process runtime from the environment, before any JAX computation.

Notes: docs/modules.md (`kvjax/distributed/runtime.py`)."""

from __future__ import annotations

import os

COORDINATOR, NUM_PROCESSES, PROCESS_ID, AUTO = (
    "KVJAX_COORDINATOR", "KVJAX_NUM_PROCESSES", "KVJAX_PROCESS_ID", "KVJAX_DISTRIBUTED",
)


def initialize(timeout_s: int = 120) -> bool:
    """Join the multi-process runtime the environment describes (module docstring); returns whether it
    did. Must run before any JAX computation. CPU collectives go over gloo (the CPU backend's
    multi-process transport; GPUs and TPUs use their own)."""
    import jax

    if os.environ.get(COORDINATOR):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ[COORDINATOR], num_processes=int(os.environ[NUM_PROCESSES]),
            process_id=int(os.environ[PROCESS_ID]), initialization_timeout=timeout_s,
        )
        return True
    if os.environ.get(AUTO) == "auto":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
        return True
    return False
