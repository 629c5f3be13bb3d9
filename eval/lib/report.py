"""Output plumbing the programs share: JSON, a Markdown table, the machine they ran on and its load."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Sequence


RESULTS_ROOT = "kvjax-results"  # benchmarks write under ./kvjax-results/<name> unless told --out DIR
RUN_KIND = "kvjax-suite-run"  # the suite's run.json "kind" (eval/suite.py writes it, eval/compare.py checks it)


def default_out(name: str) -> str:
    """Where a program writes when no `--out` is given: `./kvjax-results/<name>` in the working directory
    (never beside the installed package). The committed results live under `results/<name>`."""
    return os.path.join(RESULTS_ROOT, name)


def machine_info() -> dict[str, Any]:
    import jax

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, name: str, payload: dict, table_md: str) -> dict[str, str]:
    """Writes `payload` as NAME.json and `table_md` as NAME.md under `out_dir`. Every run records whether the
    machine was quiet or shared: the load average when this module was imported (the program's start) and
    now, unless the program recorded its own, and the Markdown prints them."""
    if "cpu_load_before" not in payload and "load_before" not in payload and "load_start" not in payload:
        payload["cpu_load_before"] = LOAD_AT_START
    if "cpu_load_after" not in payload and "load_after" not in payload and "load_end" not in payload:
        payload["cpu_load_after"] = cpu_load()
    if "others_cpu" not in payload:
        payload["others_cpu"] = others_cpu()
    if "Load" not in table_md:
        before = payload.get("cpu_load_before", payload.get("load_before", payload.get("load_start")))
        after = payload.get("cpu_load_after", payload.get("load_after", payload.get("load_end")))
        table_md = table_md.rstrip("\n") + f"\n\nLoad average before/after: {before} / {after}.\n"
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
    with open(paths["json"], "w") as f:
        json.dump(payload, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(table_md)
    return paths


def write_and_print(out: str, name: str, result: dict, text: str, plot_result=None) -> dict:
    """`write_outputs` (JSON and Markdown, and a plot when `plot_result(result, path)` is given), then print the
    table and the paths."""
    paths = write_outputs(out, name, result, text)
    if plot_result is not None:
        paths["png"] = plot_result(result, os.path.join(out, f"{name}.png"))
    with open(paths["md"]) as f:
        print(f.read())
    print(json.dumps(paths))
    return paths


# --- the large read and device tags, shared by the suite and the comparison (eval/suite.py, eval/compare.py) ---

def last_level_cache_bytes() -> int | None:
    """The largest CPU cache this machine reports (sysfs), or None where it says nothing."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def measure_large_read(num_bytes: int, repeats: int = 7, warmup: int = 2) -> dict[str, Any]:
    """The default device's read bandwidth (`eval.lib.timing.large_read`, jax only)."""
    from .timing import large_read

    return large_read(num_bytes, repeats, warmup)


def share_of_large_read(gbps: float | None, large_read: dict[str, Any]) -> float | None:
    """A bandwidth figure as a share of the run's large read (its median GB/s)."""
    if gbps is None or not large_read.get("median_gbps"):
        return None
    return gbps / large_read["median_gbps"]


def cpu_load() -> list[float] | None:
    """The 1/5/15-minute load averages, or None off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


LOAD_AT_START = cpu_load()  # when a program first imports this module: its load "before"


def cpu_seconds() -> tuple[float, float, float] | None:
    """(monotonic wall seconds, the machine's busy CPU seconds summed over its cores since boot (/proc/stat),
    this process's CPU seconds with its reaped children's), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except OSError:
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, own_cpu_seconds()


def own_cpu_seconds() -> float:
    """This process's CPU seconds with its reaped children's (the workers it waited for)."""
    own = os.times()
    return own.user + own.system + own.children_user + own.children_system


CPU_AT_START = cpu_seconds()  # when a program first imports this module


def others_cpu(start: tuple[float, float, float] | None = CPU_AT_START) -> dict[str, float] | None:
    """What other processes took of the cores since `start` (the program's start): the average number of
    cores busy with work that is not this program's nor its reaped children's, over `wall_s`. A quiet run
    has about 0 (a child still running when this is read counts as other work)."""
    now = cpu_seconds()
    if start is None or now is None or now[0] <= start[0]:
        return None
    wall = now[0] - start[0]
    others = (now[1] - start[1]) - (now[2] - start[2])
    return {"cores": round(max(others, 0.0) / wall, 3), "wall_s": round(wall, 1)}


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_tag(dtype: str, threads: int | None = None) -> dict[str, Any]:
    """What a run ran on: device kind and count, platform, jax/jaxlib versions, CPU model, threads, dtype."""
    import jax
    import jaxlib

    devices = jax.devices()
    info = machine_info()
    return {
        "device_kind": devices[0].device_kind, "platform": devices[0].platform, "device_count": len(devices),
        "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None) or jaxlib.version.__version__,
        "cpu_model": info.get("cpu_model", info["processor"]), "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else usable_cpus(), "dtype": dtype,
        "llc_bytes": last_level_cache_bytes(), "os": info["platform"],
    }


def rss_mib(field: str) -> float:
    """This process's `field` of /proc/self/status (VmRSS, VmHWM, ...) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: `5` to /proc/self/clear_refs); False where the
    kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def load_line(payload: dict) -> str:
    """The machine's load as the run recorded it: load average (1, 5, 15 min) before and after, or that it
    did not record it (runs from before the programs recorded load; their text once called them quiet)."""
    before = payload.get("cpu_load_before", payload.get("load_before"))
    after = payload.get("cpu_load_after", payload.get("load_after"))
    if before is None and after is None:
        return "Load: not recorded by this run."
    return f"Load average before/after: {before} / {after}."
