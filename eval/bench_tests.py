"""How long the test suite takes: the README's `python -m pytest` (quick) or CI's whole set, timed in a fresh process.

    python -m eval.bench_tests --out results/tests               # the quick suite
    python -m eval.bench_tests --whole --out results/tests       # KVJAX_TEST_HEAVY=1 (CI's set)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

from .lib.report import cpu_load, default_out, machine_info, markdown_table, write_outputs

# pytest's summary ("802 passed, 17 skipped, 1 failed, 60 deselected in 1106.3s") and its --durations rows
# ("12.34s call     tests/test_x.py::test_y[case]")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(output: str) -> dict:
    """pytest's counts and per-file seconds (setup, call and teardown summed; `--durations=0`) from its output."""
    summary = [line for line in output.splitlines() if _COUNT.search(line) and " in " in line]
    counts = {}
    if summary:
        for number, word in _COUNT.findall(summary[-1]):
            counts[word.rstrip("s") if word.startswith(("error", "warning")) else word] = int(number)
    by_file: dict[str, float] = collections.defaultdict(float)
    tests = []
    for line in output.splitlines():
        m = _DURATION.match(line)
        if m:
            seconds, phase, test = float(m.group(1)), m.group(2), m.group(3)
            by_file[test.split("::")[0]] += seconds
            tests.append({"test": test, "phase": phase, "s": seconds})
    tests.sort(key=lambda t: -t["s"])
    return {"counts": counts, "files_s": dict(sorted(by_file.items(), key=lambda kv: -kv[1])),
            "slowest": tests[:15]}


def cpu_by_file(cpu_log: str) -> dict:
    """Per-file CPU seconds (the test processes' own and their reaped worker processes') from the log
    tests/conftest.py writes, their sum (what the 2 cores spent, where wall seconds overlap), and the 60
    costliest tests."""
    by_file: dict[str, float] = collections.defaultdict(float)
    by_test: dict[str, float] = {}
    with open(cpu_log) as log:
        for line in log:
            cpu, _, test = line.rstrip("\n").split("\t")
            by_file[test.split("::")[0]] += float(cpu)
            by_test[test] = by_test.get(test, 0.0) + float(cpu)
    costliest = sorted(by_test.items(), key=lambda kv: -kv[1])[:60]
    return {"cpu_s": round(sum(by_file.values()), 1),
            "files_cpu_s": {f: round(s, 1) for f, s in sorted(by_file.items(), key=lambda kv: -kv[1])},
            "tests_cpu_s": {t: round(s, 1) for t, s in costliest}}


def run(whole: bool) -> dict:
    """Run the suite in a fresh process from the repository root; its wall time, counts and durations."""
    env = dict(os.environ)
    env.pop("KVJAX_TEST_HEAVY", None)
    if whole:
        env["KVJAX_TEST_HEAVY"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--durations=0", "--durations-min=0.5"]
    cpu_log = tempfile.NamedTemporaryFile(prefix="kvjax-test-cpu-", suffix=".tsv", delete=False).name
    env["KVJAX_TEST_CPU_LOG"] = cpu_log  # tests/conftest.py appends each test's CPU seconds
    load_before = cpu_load()
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    parsed = parse(proc.stdout)
    parsed.update(cpu_by_file(cpu_log))
    os.unlink(cpu_log)
    return {"set": "whole (KVJAX_TEST_HEAVY=1)" if whole else "quick (python -m pytest)",
            "command": " ".join(["KVJAX_TEST_HEAVY=1"] * whole + ["python -m pytest"]),
            "returncode": proc.returncode, "wall_s": round(wall, 1), "cpu_load_before": load_before,
            "cpu_load_after": cpu_load(), "machine": machine_info(), **parsed,
            "failures": [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))],
            "tail": proc.stdout.splitlines()[-3:]}


def render(payload: dict) -> str:
    counts = ", ".join(f"{n} {word}" for word, n in payload["counts"].items())
    lines = [f"**{payload['set']}**: {payload['wall_s'] / 60:.1f} minutes ({payload['wall_s']:.0f} s), {counts}; "
             f"exit status {payload['returncode']}. {payload['machine'].get('cpu_model', '')}, "
             f"{payload['machine']['cpu_count']} cores; load average (1, 5, 15 min) before / after: "
             f"{payload['cpu_load_before']} / {payload['cpu_load_after']}.", ""]
    if "files_cpu_s" in payload:  # runs since the CPU log: the files that cost the cores most
        cpu = payload["files_cpu_s"]
        lines[0] += f" CPU time of the test processes and their workers: {payload['cpu_s'] / 60:.1f} minutes."
        lines.append(markdown_table(
            ["the ten costliest files", "CPU seconds (the test process and the workers it waited for)", "share",
             "wall seconds (setup + call + teardown)"],
            [(f"`{f}`", round(s), f"{s / payload['cpu_s']:.0%}", round(payload["files_s"].get(f, 0)))
             for f, s in list(cpu.items())[:10]]))
        return "\n".join(lines)
    files = list(payload["files_s"].items())[:10]
    total = sum(payload["files_s"].values())
    lines.append(markdown_table(["the ten slowest files", "seconds (setup + call + teardown, summed over the "
                                 "workers)", "share"], [(f"`{f}`", round(s), f"{s / total:.0%}") for f, s in files]))
    return "\n".join(lines)


def ci_runs(payload: dict) -> str:
    """The line docs/testing.md shows for CI's recorded runs (results/tests/ci_runs.json)."""
    runs = "; ".join(f"stop {run['stop']}: {run['result']} in {run['wall_s'] / 60:.1f} minutes ({run['wall_s']} s)"
                     for run in payload["runs"])
    return (f"CI's whole run (set-up and the whole set) as CI recorded it: {runs}; its budget "
            f"{payload['budget_s'] / 60:.0f} minutes. Source: {payload['source']}.")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whole", action="store_true", help="CI's whole set (KVJAX_TEST_HEAVY=1), not the quick suite")
    parser.add_argument("--out", default=default_out("tests"))
    args = parser.parse_args(argv)
    payload = run(args.whole)
    name = "whole_set" if args.whole else "quick_suite"
    write_outputs(args.out, name, payload, render(payload))
    print(render(payload))
    return payload


if __name__ == "__main__":
    main()
