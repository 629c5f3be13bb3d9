"""A launcher that starts one command as N processes of JAX's multi-process runtime on this machine.

Notes: docs/modules.md (`kvjax/distributed/launch.py`)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from kvjax.distributed.runtime import COORDINATOR, NUM_PROCESSES, PROCESS_ID


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# XLA:CPU aborts the process when a collective's threads have not all met within 40 s. Simulated devices share
# the host's cores, so a loaded machine (a test suite beside a sharded run on 2 cores) can keep one thread
# waiting that long without anything being wrong: give collectives ten minutes before XLA gives up.
CPU_COLLECTIVE_TIMEOUT_FLAGS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=120 "
                                "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
                                "--xla_cpu_collective_timeout_seconds=600")


def simulated_cpu_xla_flags(devices: int, flags: str = "") -> str:
    """XLA_FLAGS for `devices` simulated CPU devices, added to `flags` (set before jax makes its backend)."""
    return f"{flags} --xla_force_host_platform_device_count={devices} {CPU_COLLECTIVE_TIMEOUT_FLAGS}".strip()


def process_env(process_id: int, processes: int, port: int, cpu_devices: int = 0) -> dict:
    """The environment of process `process_id` of `processes` on this machine (coordinator on `port`);
    `cpu_devices` > 0 runs it on that many simulated CPU devices."""
    env = dict(os.environ, **{COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(processes),
                              PROCESS_ID: str(process_id)})
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = simulated_cpu_xla_flags(cpu_devices, env.get("XLA_FLAGS", ""))
    return env


def launch(command: list[str], processes: int, cpu_devices: int = 0, timeout_s: float = 600.0,
           port: int | None = None, stdout=None, stderr=None) -> int:
    """Run `command` as `processes` processes joined by one coordinator on localhost; wait for all.

    Returns 0 when every process exits 0, else the first failure's exit code; when one fails or
    `timeout_s` passes, the others are killed (by their ids) so none is left waiting on a collective."""
    port = port or free_port()
    procs = [
        subprocess.Popen(command, env=process_env(i, processes, port, cpu_devices), stdout=stdout, stderr=stderr)
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout_s
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                code = failed[0] if failed else 124
                break
            time.sleep(0.1)
        else:
            code = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvjax.distributed.launch",
        description="Start one command as N processes of JAX's multi-process runtime on this machine.",
    )
    parser.add_argument("--processes", "-n", type=int, required=True, help="processes to start")
    parser.add_argument("--cpu-devices", type=int, default=0, help="simulated CPU devices per process (0: the real ones)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before every process is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. kvjax generate ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.processes < 1:
        parser.error("give --processes >= 1 and a command after --")
    return launch(command, args.processes, args.cpu_devices, args.timeout, args.port)


if __name__ == "__main__":
    sys.exit(main())
