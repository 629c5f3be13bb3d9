"""The multi-process runs of tests/test_multiprocess.py, each started through `kvjax.distributed.launch`
(2 processes x 2 CPU devices joined on a free localhost port) beside its one-process reference. Prints one
JSON object; the test asserts on it.

    python tests/_multiprocess_runs.py generate OUT    # _multiprocess_worker.py, and `kvjax generate --mesh 2x2`
    python tests/_multiprocess_runs.py train OUT       # `kvjax train locret --mesh 4x1`, checkpoints both ways
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from kvjax.distributed.launch import launch, simulated_cpu_xla_flags  # noqa: E402

PROCESSES, CPU_DEVICES, TIMEOUT = 2, 2, 600
# compile time dominates these tiny runs; every side of every comparison uses the same flags
from _simulated_devices import FAST_COMPILE as FLAGS  # noqa: E402
# with the model axis inside a process: a selector (the quick suite; the CLI run below decodes H2O on the 2x2
# mesh), and with KVJAX_TEST_HEAVY=1 (CI) the full cache, H2O, a prefill compressor, Ada-SnapKV and Locret too;
# across processes, Ada-SnapKV's budget split over all heads (its decisions read every head's scores over gloo).
# Each case costs ~25 CPU-seconds (2 processes).
HEAVY = os.environ.get("KVJAX_TEST_HEAVY") == "1"
INSIDE = ("quest",) + (("full", "h2o", "snapkv", "ada_snapkv", "locret") if HEAVY else ())
GENERATE = ["inside=" + ",".join(INSIDE), "spans=ada_snapkv"]
PROMPT = "the quick brown fox jumps over the lazy dog and then the sky is blue while the grass is green"
CLI = ["-m", "kvjax.cli", "generate", "--prompt", PROMPT, "--max-new-tokens", "5", "--json", "--policy", "h2o",
       "--policy-option", "token_budget=12"]


def die_with_parent() -> None:
    """Kill this run's process group (its launchers and every process they started) if the test process
    that started it goes away without cleaning up (killed by a timeout, say)."""
    import signal
    import threading
    import time

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def two_processes(command: list[str], log: str) -> int:
    with open(log, "w") as out:
        return launch(command, PROCESSES, CPU_DEVICES, TIMEOUT, stdout=out, stderr=subprocess.STDOUT)


def one_process(command: list[str], log: str, devices: int = 1) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=simulated_cpu_xla_flags(devices, os.environ.get("XLA_FLAGS", "")))
    return subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)


def wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def last_json(log: str) -> dict | None:
    """The last JSON line of a log (gloo writes its own lines to stdout)."""
    with open(log) as f:
        lines = [line for line in f if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def generate(out: str) -> dict:
    single = one_process([sys.executable, *CLI], os.path.join(out, "cli_single.log"))
    codes = {"worker": two_processes([sys.executable, os.path.join(HERE, "_multiprocess_worker.py"), out, *GENERATE],
                                     os.path.join(out, "worker.log"))}
    codes["cli_mesh"] = two_processes([sys.executable, *CLI, "--mesh", "2x2"], os.path.join(out, "cli_mesh.log"))
    codes["cli_single"] = wait(single)
    processes = []
    for i in range(PROCESSES):
        path = os.path.join(out, f"process{i}.json")
        processes.append(json.load(open(path)) if os.path.exists(path) else None)
    return {"codes": codes, "processes": processes, "cli_mesh": last_json(os.path.join(out, "cli_mesh.log")),
            "cli_single": last_json(os.path.join(out, "cli_single.log"))}


def _write_rows(path: str) -> None:
    """Eight passkey rows of different lengths: Locret's loss weighs tokens, so a batch split into other
    microbatches (or doubled) gives another loss."""
    import numpy as np

    from kvjax.tasks.synthetic import digits, passkey_sample

    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(8):
            sample = passkey_sample(rng, 50 + 13 * i)
            f.write(json.dumps({"instruction": sample.prompt, "output": digits(sample.answer) + " ."}) + "\n")


def _train(out: str, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvjax.train.locret", "--model", os.path.join(ROOT, "kvjax", "assets", "tiny-llama"),
            "--data", os.path.join(out, "rows.jsonl"), "--steps", "3", "--warmup", "1", "--lr", "1e-2", "--hidden", "16",
            "--chunk-size", "64", "--save-every", "2", "--batch-size", "4", "--export-dtype", "float32",
            "--no-progress", "--mesh", "4x1", "--out", os.path.join(out, name), *extra]


def _read_run(out: str, name: str) -> dict:
    from safetensors.numpy import load_file

    folder = os.path.join(out, name)
    metrics = os.path.join(folder, "metrics.jsonl")
    heads = os.path.join(folder, "heads.safetensors")
    return {
        "losses": [json.loads(line)["loss"] for line in open(metrics)] if os.path.exists(metrics) else [],
        "heads": {k: v.tolist() for k, v in load_file(heads).items()} if os.path.exists(heads) else None,
    }


def _copy_run(out: str, source: str, name: str) -> None:
    """`source`'s folder as `name`, to resume from its checkpoints (its own heads set aside)."""
    shutil.copytree(os.path.join(out, source), os.path.join(out, name))
    os.remove(os.path.join(out, name, "heads.safetensors"))


def train(out: str) -> dict:
    """Data-parallel Locret training, 3 steps of a 4-sequence batch on a 4x1 mesh: over 2 processes and over
    1 process (4 devices) at once; then each run's last checkpoint is resumed by the other layout, which
    restores it and writes its heads without another step (what it restored is what was saved)."""
    _write_rows(os.path.join(out, "rows.jsonl"))
    one = one_process(_train(out, "one", []), os.path.join(out, "one.log"), devices=4)
    codes = {"two": two_processes(_train(out, "two", []), os.path.join(out, "two.log")), "one": wait(one)}
    _copy_run(out, "two", "two_then_one")
    resumed = one_process(_train(out, "two_then_one", []), os.path.join(out, "two_then_one.log"), devices=4)
    names = ["one", "two", "two_then_one"]
    if HEAVY:  # the reverse too in the whole set: one process's checkpoint resumed by two
        _copy_run(out, "one", "one_then_two")
        codes["one_then_two"] = two_processes(_train(out, "one_then_two", []), os.path.join(out, "one_then_two.log"))
        names.append("one_then_two")
    codes["two_then_one"] = wait(resumed)
    return {"codes": codes, **{name: _read_run(out, name) for name in names}}


if __name__ == "__main__":
    die_with_parent()
    os.environ["XLA_FLAGS"] = FLAGS  # inherited by every process started from here
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kind, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    print(json.dumps({"generate": generate, "train": train}[kind](out)))
