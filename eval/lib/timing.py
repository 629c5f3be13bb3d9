"""The one decode timer the benchmarks share: `DecodeRun` (decode steps timed one at a time, compile apart),
`round_robin` over runs, and the large read and matmul a step is held to, measured in the same process."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

COMPILE_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
_compile_seconds = collections.Counter()


def _on_event(name, duration, **kwargs):
    if name.rsplit("/", 1)[-1] in COMPILE_EVENTS:
        _compile_seconds["total"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def timed(run: Callable[[], Any]) -> tuple[Any, float, float]:
    """`(result, wall seconds, of which JAX spent compiling)` of `run()`, its result blocked on."""
    _compile_seconds.clear()
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    return out, time.perf_counter() - start, _compile_seconds["total"]


def median_seconds(run: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `run()` (its result blocked on) over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    return statistics.median(timed(run)[1] for _ in range(repeats))


def large_read(num_bytes: int, repeats: int = 7, warmup: int = 2, torch: bool = False) -> dict[str, Any]:
    """Read bandwidth: a jitted `jnp.sum` over a float32 buffer of `num_bytes` built on the device (and with
    `torch`, `torch.sum` over a CPU tensor of the same size). `gbps` is the faster median: the bound a decode
    step is held to. On CPU size it at several times the last-level cache so it measures memory."""
    if num_bytes < 4:
        raise ValueError(f"large read of {num_bytes} bytes: give at least one float32")
    n = num_bytes // 4
    data = jax.jit(lambda: jnp.full((n,), 0.5, jnp.float32))()
    read = jax.jit(jnp.sum)
    for _ in range(warmup):
        jax.block_until_ready(read(data))
    times = [timed(lambda: read(data))[1] for _ in range(repeats)]
    median, best = statistics.median(times), min(times)
    out = {"bytes": n * 4, "repeats": repeats, "median_s": median, "min_s": best,
           "median_gbps": n * 4 / median / 1e9, "best_gbps": n * 4 / best / 1e9}
    out["jax_sum_gbps"] = out["gbps"] = out["median_gbps"]
    if torch:
        import torch as th

        y = th.ones(n)
        out["torch_sum_gbps"] = n * 4 / median_seconds(y.sum, repeats, warmup) / 1e9
        out["gbps"] = max(out["gbps"], out["torch_sum_gbps"])
    return out


def matmul_gflops(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """FLOP rate of a large float32 matmul (`size` square, jax and torch, median of `repeats`); `gflops` is the
    faster, the compute bound a batched decode step is held to."""
    import torch

    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax_rate = 2 * size**3 / median_seconds(lambda: matmul(a, a), repeats) / 1e9
    b = torch.ones(size, size)
    torch_rate = 2 * size**3 / median_seconds(lambda: b @ b, repeats) / 1e9
    return {"size": size, "jax_gflops": jax_rate, "torch_gflops": torch_rate, "gflops": max(jax_rate, torch_rate)}


class DecodeRun:
    """One (model, state, policy) decoded greedily one `kvjax.decode_step` at a time; each step's seconds are
    kept. The first step (which compiles) is timed apart. `DecodeRun.prefilled` prefills first and times
    the prefill with its compile apart."""

    def __init__(self, model, state, logits, policy=None, prefill: dict | None = None):
        self.model, self.state, self.logits, self.policy = model, state, logits, policy
        self.batch = int(logits.shape[0])
        self.times: list[float] = []
        self.tokens: list[np.ndarray] = []  # int32[B] fed at each step, the first (compiling) one included
        self.prefill = prefill or {}
        _, self.first_step_s, self.decode_compile_s = timed(self._decode)

    @classmethod
    def prefilled(cls, model, prompt, policy=None, max_new_tokens: int = 64,
                  describe: Callable[[Any], dict] | None = None) -> "DecodeRun":
        """Prefill `prompt` (timed, its compile apart), then the first step. `describe(state)` adds what it
        reads of the prefilled state (pages in use, ...) to the result."""
        import kvjax

        (state, logits), wall, compile_s = timed(
            lambda: kvjax.prefill(model, prompt, policy=policy, max_new_tokens=max_new_tokens))
        prefill = {"prefill_s": wall - compile_s, "prefill_compile_s": compile_s, **(describe(state) if describe else {})}
        return cls(model, state, logits, policy, prefill)

    def _decode(self):
        import kvjax

        token = np.asarray(jnp.argmax(self.logits, -1))
        self.tokens.append(token)
        self.logits, self.state = kvjax.decode_step(self.model, self.state, token, policy=self.policy)
        return self.logits

    def step(self) -> float:
        seconds = timed(self._decode)[1]
        self.times.append(seconds)
        return seconds

    def run(self, steps: int) -> dict:
        for _ in range(steps):
            self.step()
        return self.result()

    def result(self) -> dict:
        step = statistics.median(self.times)
        return {**self.prefill, "decode_compile_s": self.decode_compile_s, "first_decode_step_s": self.first_step_s,
                "decode_step_s": step, "decode_tokens_per_s": self.batch / step}


def round_robin(runs: list[DecodeRun], steps: int) -> list[dict]:
    """Decode `steps` steps of every run round-robin (step r of every run, then step r + 1): a change of load
    on a shared machine, or of the memory system's speed, hits every run alike, so ratios between runs hold
    even where absolute figures drift (timed one run after another, the same config measured 19.5 and 40
    tok/s in two runs minutes apart)."""
    for _ in range(steps):
        for run in runs:
            run.step()
    return [run.result() for run in runs]
