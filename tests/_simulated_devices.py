"""Run this worker process on N simulated CPU devices: call `use(N)` before anything makes jax's backend."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# compile time dominates the workers' tiny runs; every side of every comparison uses the same flags. XLA:CPU's
# MLIR fusion emitters off: the older elemental emitters compile the same fusions in about half the time here
# (two tiny-model generates: 13.0 -> 6.7 s of CPU, backend compile 16.7 -> 6.8 s)
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")


def use(devices: int) -> None:
    """XLA_FLAGS for `devices` simulated CPU devices (with collectives' timeouts and FAST_COMPILE added to the
    inherited flags), JAX on the CPU, and the checkout importable."""
    sys.path.insert(0, ROOT)
    from kvjax.distributed.launch import simulated_cpu_xla_flags  # jax makes no backend on import

    os.environ["XLA_FLAGS"] = simulated_cpu_xla_flags(devices, f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}")
    os.environ["JAX_PLATFORMS"] = "cpu"
