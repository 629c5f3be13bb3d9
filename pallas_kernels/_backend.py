"""Backend choice for the kernels, and the few JAX-version differences they depend on.

Notes: docs/modules.md (`pallas_kernels/_backend.py`)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import jax

BACKENDS = ("reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")
_NATIVE_PLATFORMS = {
    "pallas_tpu": ("tpu",),
    "pallas_gpu": ("gpu", "cuda", "rocm"),
    "pallas_mosaic_gpu": ("gpu", "cuda"),  # Mosaic GPU targets NVIDIA Hopper+ only
}


_TARGET: list[tuple[str, bool]] = []  # (platform, check_compiles) of the open `target_platform` blocks


@contextlib.contextmanager
def target_platform(platform: str, *, check_compiles: bool = True):
    """Pick default kernels, natively compiled, as on `platform` ("cpu", "gpu"/"cuda" or "tpu") inside the
    block: how a whole step is exported for a GPU or TPU from this machine (`jax.export` with
    `platforms=[...]`; then `check_compiles=False`, since nothing can compile for that platform here).
    JAX's jit caches do not know the target, so they are cleared on entering and leaving the block."""
    _TARGET.append(("gpu" if platform in ("cuda", "rocm") else platform, check_compiles))
    jax.clear_caches()
    try:
        yield
    finally:
        _TARGET.pop()
        jax.clear_caches()


def default_platform() -> str:
    """The platform default kernels are chosen for: `target_platform`'s, else `jax.default_backend()`."""
    return _TARGET[-1][0] if _TARGET else jax.default_backend()


def resolve_backend(backend: str | None) -> str:
    """The backend name to run: `backend` itself, or the default for the platform (`default_platform`)."""
    if backend is None:
        platform = default_platform()
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
        interpret = default_platform() not in _NATIVE_PLATFORMS[backend]
    if interpret is True and backend == "pallas_tpu":
        return tpu_interpret_params()
    if interpret is True and backend == "pallas_mosaic_gpu":
        from .decode_mosaic_gpu import gpu_interpret_params

        params = gpu_interpret_params()
        if params is None:
            raise NotImplementedError("backend 'pallas_mosaic_gpu': this JAX has no Mosaic GPU interpret mode")
        return params
    return interpret


_COMPILED: dict[Any, Exception | None] = {}  # (kernel, backend, abstract inputs) -> the compile error or None


def compiled_or_xla(kernel: str, requested: str | None, interpret, build: Callable[[str], Callable], args) -> str:
    """The backend a kernel call runs: `requested` when given, else the platform's default, unless that is
    a natively compiled Pallas kernel that fails to compile for these inputs; then "xla", with a one-line
    warning naming the kernel and the error (once per kernel and shapes). `build(backend)` is the kernel as
    a function of `args` (arrays, tracers or None); the check compiles it alone, once per shapes."""
    backend = resolve_backend(requested)
    checking = _TARGET[-1][1] if _TARGET else True
    if requested is not None or backend not in _NATIVE_PLATFORMS or not checking:
        return backend
    if resolve_interpret(backend, interpret) is not False:
        return backend
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    key = (kernel, backend, str(abstract))
    if key not in _COMPILED:
        try:
            jax.jit(build(backend)).lower(*abstract).compile()
            _COMPILED[key] = None
        except Exception as error:  # any failure to lower or compile: the XLA path computes the same
            _COMPILED[key] = error
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"kvjax: kernel {kernel} ({backend}) failed to compile ({type(error).__name__}: {reason}); "
                          "using the XLA path", RuntimeWarning, stacklevel=2)
    return backend if _COMPILED[key] is None else "xla"


def default_backend_for(kernel_fn: Callable, arrays: dict, options: dict, interpret) -> str:
    """`compiled_or_xla` for a kernel entry point called with `backend=None`: `arrays` are its array
    arguments by name (None allowed), `options` its other keyword arguments."""
    names = tuple(arrays)

    def build(backend):
        return lambda *values: kernel_fn(**dict(zip(names, values)), **options, backend=backend, interpret=interpret)

    return compiled_or_xla(kernel_fn.__name__, None, interpret, build, tuple(arrays.values()))


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
