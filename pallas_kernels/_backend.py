"""Backend choice for the kernels, and the few JAX-version differences they depend on.

`backend=None` picks by `jax.default_backend()`: TPU -> "pallas_tpu", GPU -> "pallas_gpu", anything else
(CPU) -> "xla". "reference" is the pure-jnp oracle. "pallas_mosaic_gpu" (the Mosaic GPU / TMA kernel,
never run on a GPU) is only used when asked for by name. A Pallas backend away from its own platform runs in
interpret mode; `interpret=None` chooses that automatically.
"""

from __future__ import annotations

import functools

import jax

BACKENDS = ("reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")
_NATIVE_PLATFORMS = {
    "pallas_tpu": ("tpu",),
    "pallas_gpu": ("gpu", "cuda", "rocm"),
    "pallas_mosaic_gpu": ("gpu", "cuda"),  # Mosaic GPU targets NVIDIA Hopper+ only
}


def resolve_backend(backend: str | None) -> str:
    """The backend name to run: `backend` itself, or the default for `jax.default_backend()`."""
    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu":
            return "pallas_tpu"
        if platform in ("gpu", "cuda", "rocm"):
            return "pallas_gpu"
        return "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def resolve_interpret(backend: str, interpret) -> bool | object:
    """Interpret-mode setting for a Pallas backend.

    None: interpret exactly when the default platform is not the backend's own (so the TPU kernel runs on
    CPU under the TPU interpreter). True: the backend's most faithful interpreter (for TPU,
    `pltpu.InterpretParams()`, which simulates DMAs and raises on out-of-bounds reads; for Mosaic GPU,
    `InterpretGPUParams()`, which simulates TMA copies and barriers). False: compile
    natively. Anything else (e.g. an `InterpretParams`) is passed through to `pallas_call`.
    """
    if interpret is None:
        interpret = jax.default_backend() not in _NATIVE_PLATFORMS[backend]
    if interpret is True and backend == "pallas_tpu":
        return tpu_interpret_params()
    if interpret is True and backend == "pallas_mosaic_gpu":
        from .decode_mosaic_gpu import gpu_interpret_params

        params = gpu_interpret_params()
        if params is None:
            raise NotImplementedError("backend 'pallas_mosaic_gpu': this JAX has no Mosaic GPU interpret mode")
        return params
    return interpret


@functools.cache
def tpu_interpret_params():
    """`pltpu.InterpretParams()` where this JAX has it (0.6+), else plain `True`."""
    from jax.experimental.pallas import tpu as pltpu

    params_cls = getattr(pltpu, "InterpretParams", None)
    return params_cls() if params_cls is not None else True


def tpu_compiler_params(dimension_semantics):
    """Mosaic compiler params across versions (`CompilerParams`, formerly `TPUCompilerParams`)."""
    from jax.experimental.pallas import tpu as pltpu

    params_cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return params_cls(dimension_semantics=tuple(dimension_semantics))


def triton_compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Pallas Triton compiler params, or None when this JAX no longer ships the Triton backend."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # removed in a future JAX
        return None
    params_cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams", None)
    if params_cls is None:
        return None
    return params_cls(num_warps=num_warps, num_stages=num_stages)


def any_memory_space():
    """The "leave it where it is" (HBM) memory space: `pl.ANY`, or `pltpu.ANY` in JAX versions without it."""
    from jax.experimental import pallas as pl

    space = getattr(pl, "ANY", None)
    if space is None:
        from jax.experimental.pallas import tpu as pltpu

        space = pltpu.ANY
    return space
