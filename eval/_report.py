"""Shared output plumbing for benchmarks: JSON, a Markdown table and the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
from typing import Any, Sequence


RESULTS_ROOT = "kvjax-results"  # benchmarks write under ./kvjax-results/<name> unless told --out DIR


def default_out(name: str) -> str:
    """Where a program writes when no `--out` is given: `./kvjax-results/<name>` in the working directory
    (never beside the installed package). The committed results live under `eval/results/<name>`."""
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
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
    with open(paths["json"], "w") as f:
        json.dump(payload, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(table_md)
    return paths
