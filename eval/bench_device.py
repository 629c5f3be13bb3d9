"""One call that measures a GPU or TPU: native kernel tests, the benchmark suite on the device, the same suite
on the host's CPU, and their comparison, within a time budget (10 minutes by default).

    kvjax bench device --out results/suite/h100       # on the lent machine, from the repository root
    kvjax bench device --dry-run                           # print the plan and exit

Steps, each in its own process with what is left of the budget as its time limit (a step that runs out is
recorded as timed out, and the rest still run):
  1. `pytest tests/test_kernels_native.py` and the kernel test files: the Pallas kernels compiled natively
     on the device (Triton, Mosaic GPU on Hopper, or Mosaic TPU) against their references, and the whole
     decode step through the default kernels (skipped on a CPU);
  2. the suite on the device (`kvjax bench suite`, `--members` below, `--quick` unless `--full`);
  3. the same suite with `JAX_PLATFORMS=cpu` on the host;
  4. `kvjax bench compare` of the two runs (the CPU run first).
DIR/device.json records the device, the JAX version, each step's command, status, seconds and the last
lines of its output, the kernel tests' pass/fail/skip counts, and DIR/device.md shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from .lib.report import default_out, machine_info, markdown_table, write_outputs

KERNEL_TESTS = ("tests/test_kernels_native.py", "tests/test_kernels_decode.py", "tests/test_kernels_quest.py",
                "tests/test_kernels_int8.py", "tests/test_kernels_mosaic_gpu.py")
DEFAULT_MEMBERS = ("attention", "decode", "dispatch")
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors)")


def plan(args, platform: str = "cpu") -> list[dict]:
    """The steps: name, argv, extra environment. On a GPU the kernel tests run on 4 processes that share the
    card (no process takes most of its memory up front); a TPU takes one process only."""
    python = sys.executable
    workers = ["-n", "4"] if platform == "gpu" else ["-n", "0"]
    shared_gpu = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if platform == "gpu" else {}
    suite = [python, "-m", "kvjax.eval.suite", "--members", *args.members] + ([] if args.full else ["--quick"])
    device_run, cpu_run = os.path.join(args.out, "device"), os.path.join(args.out, "cpu")
    return [
        # KVJAX_TEST_REQUIRE=native: the native kernel tests skipping (no GPU or TPU seen) fails the step
        {"name": "kernel tests (native)", "argv": [python, "-m", "pytest", "-rfE", "--tb=short", "-p",
                                                    "no:cacheprovider", *workers, *KERNEL_TESTS],
         "env": {"KVJAX_TEST_REQUIRE": "native", **shared_gpu}},
        {"name": "suite on the device", "argv": suite + ["--out", device_run, "--label", "device"], "env": {}},
        {"name": "suite on the CPU", "argv": suite + ["--out", cpu_run, "--label", "cpu"],
         "env": {"JAX_PLATFORMS": "cpu"}},
        {"name": "compare", "argv": [python, "-m", "kvjax.eval.compare", cpu_run, device_run, "--out",
                                     os.path.join(args.out, "compare")], "env": {}},
    ]


_PROGRESS = re.compile(r"^([.FsExX]+)\s+\[\s*\d+%\]$")
_PROGRESS_WORDS = {".": "passed", "F": "failed", "s": "skipped", "E": "errors", "x": "xfailed", "X": "xpassed"}


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing counts (`3 passed, 1 skipped`) from its output; where the summary line is missing
    (pytest run with -qq prints none), the progress lines' characters counted instead."""
    counts: dict[str, int] = {}
    lines = [line for line in output.splitlines() if " in " in line and _SUMMARY.search(line)]
    for number, word in _SUMMARY.findall(lines[-1] if lines else ""):
        counts["errors" if word.startswith("error") else word] = int(number)
    if not counts:
        for line in output.splitlines():
            match = _PROGRESS.match(line.strip())
            for char in match.group(1) if match else "":
                counts[_PROGRESS_WORDS[char]] = counts.get(_PROGRESS_WORDS[char], 0) + 1
    return counts


def run_step(step: dict, deadline: float, log_dir: str | None = None) -> dict:
    """Run one step with what is left of the budget; its whole output goes to LOG_DIR/<step>.log."""
    left = deadline - time.monotonic()
    record = {"name": step["name"], "command": " ".join(step["argv"]), "env": step["env"]}
    if left < 5:
        return {**record, "status": "not run (budget spent)", "seconds": 0.0}
    start = time.monotonic()
    try:
        done = subprocess.run(step["argv"], env={**os.environ, **step["env"]}, capture_output=True, text=True,
                              timeout=left)
        stdout, stderr = done.stdout, done.stderr
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        stdout, stderr = (_text(expired.stdout), _text(expired.stderr))
        status = "timed out"
    output = stdout + stderr
    record.update(status=status, seconds=time.monotonic() - start, tail=output.splitlines()[-15:])
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        record["log"] = os.path.join(log_dir, re.sub(r"[^a-z0-9]+", "_", step["name"].lower()).strip("_") + ".log")
        with open(record["log"], "w") as handle:
            handle.write(output)
    if step["name"].startswith("kernel tests"):
        record["tests"] = pytest_counts(stdout)  # pytest's summary is on stdout; stderr may end with other lines
    return record


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def device_info() -> dict:
    import jax

    devices = jax.devices()
    return {"platform": jax.default_backend(), "jax": jax.__version__, "devices": len(devices),
            "device_kind": devices[0].device_kind,
            "compute_capability": getattr(devices[0], "compute_capability", None)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out("device"))
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall time for all steps (default 9 minutes)")
    parser.add_argument("--members", nargs="+", default=list(DEFAULT_MEMBERS), help="suite members to run")
    parser.add_argument("--full", action="store_true", help="the suite's default sizes instead of --quick")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and exit")
    args = parser.parse_args(argv)
    info = device_info()
    steps = plan(args, info["platform"])
    if args.dry_run:
        for step in steps:
            env = " ".join(f"{k}={v}" for k, v in step["env"].items())
            print(f"{step['name']}: {env + ' ' if env else ''}{' '.join(step['argv'])}")
        return {"steps": steps}
    deadline = time.monotonic() + args.budget_s
    records = []
    for step in steps:
        records.append(run_step(step, deadline, os.path.join(args.out, "logs")))
        print(f"{records[-1]['name']}: {records[-1]['status']} ({records[-1]['seconds']:.0f} s)", file=sys.stderr)
    payload = {"benchmark": "bench_device", "machine": machine_info(), "device": info, "budget_s": args.budget_s,
               "steps": records}
    text = device_markdown(payload)
    write_outputs(args.out, "device", payload, text)
    print(text)
    return payload


def device_markdown(payload: dict) -> str:
    """DIR/device.md: one row per step, then the device."""
    rows = [[r["name"], r["status"], f"{r['seconds']:.0f}", json.dumps(r.get("tests", ""))] for r in payload["steps"]]
    info = payload["device"]
    return markdown_table(["step", "status", "seconds", "tests"], rows) + (
        f"\nDevice: {info['device_kind']} ({info['platform']}, JAX {info['jax']}). The suite runs are under "
        f"device/ and cpu/, their comparison under compare/.\n")


if __name__ == "__main__":
    main()
