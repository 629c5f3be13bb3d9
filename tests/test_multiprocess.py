"""kvjax over JAX's multi-process runtime, with real processes on this machine.

Each run starts 2 processes x 2 simulated CPU devices through `kvjax.distributed.launch` (a coordinator on
a free localhost port, CPU collectives over gloo) beside its one-process reference; tests/_multiprocess_runs.py
drives them and tests/_serve_mesh_worker.py serves on a 1x2 mesh. The three runs start in the background
as soon as this module is collected (tests/conftest.py), each in its own process session, and are killed
with it when a run outlives its timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 900  # seconds a run may take before its whole process group is killed (~1 minute when idle)
# runs conftest.py starts at collection -> the fixture or test that takes each
BACKGROUND_RUNS = {("generate",): "generated", ("train",): "trained",
                   ("serve",): "test_serving_engine_on_a_two_device_mesh_equals_one_device"}


def start_worker(kind: str) -> subprocess.Popen:
    """Start one run in a new session (so a timeout kills its launcher and every process it started)."""
    from _multiprocess_runs import FLAGS

    out = tempfile.mkdtemp(prefix=f"kvjax-{kind}-")  # logs, checkpoints; removed when the run succeeds
    if kind == "serve":
        command = [sys.executable, os.path.join(HERE, "_serve_mesh_worker.py")]
    else:
        command = [sys.executable, os.path.join(HERE, "_multiprocess_runs.py"), kind, out]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, XLA_FLAGS=FLAGS), start_new_session=True)
    proc.out_dir = out
    return proc


def run(kind: str) -> dict:
    from conftest import take_background_run

    proc = take_background_run((kind,)) or start_worker(kind)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: its launcher and the processes it started
        proc.communicate()
        pytest.fail(f"the {kind} run took more than {TIMEOUT} s (logs in {proc.out_dir})")
    if proc.returncode != 0:
        pytest.fail(f"the {kind} run failed ({proc.returncode}; logs in {proc.out_dir}):\n{stderr[-4000:]}")
    result = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    failed = [name for name, code in result.get("codes", {}).items() if code != 0]
    if not failed:
        shutil.rmtree(proc.out_dir, ignore_errors=True)
    return dict(result, logs=proc.out_dir)


@pytest.fixture(scope="module")
def generated():
    return run("generate")


@pytest.fixture(scope="module")
def trained():
    return run("train")


# --------------------------------------------------------------------------------------------- generation


def test_generation_over_two_processes_equals_one_device(generated):
    assert generated["codes"]["worker"] == 0, f"the 2-process generation failed: see {generated['logs']}/worker.log"
    first, second = generated["processes"]
    assert (first["processes"], first["devices"], first["local_devices"]) == (2, 4, 2)
    assert [(r["mesh"], r["policy"]) for r in first["runs"]] == [(r["mesh"], r["policy"]) for r in second["runs"]]
    names = {(r["mesh"], r["policy"]) for r in first["runs"]}
    from _multiprocess_runs import INSIDE

    assert {p for m, p in names if m == "inside"} == set(INSIDE)
    for mine, theirs in zip(first["runs"], second["runs"]):
        label = f"{mine['policy']} on the {mine['mesh']} mesh"
        reference = mine if "ref_tokens" in mine else theirs  # the processes took turns with the references
        assert mine["tokens"] == theirs["tokens"], f"{label}: the processes disagree"
        assert mine["tokens"] == reference["ref_tokens"], f"{label}: {mine['tokens']} != one device's {reference['ref_tokens']}"
        assert reference["kept_equal"], f"{label}: kept positions per (layer, sequence, head) differ after prefill"
        assert np.min(mine["tokens"]) >= 0
        # no process could read the state alone: every host read went through process_allgather
        assert not mine["state_fully_addressable"]


def test_meshes_keep_the_model_axis_inside_a_process_or_span_both(generated):
    by_mesh = {r["mesh"]: r["mesh_processes"] for r in generated["processes"][0]["runs"]}
    assert by_mesh["inside"] == [[0, 0], [1, 1]]  # data over processes, model within one
    assert by_mesh["spans"] == [[0, 0, 1, 1]]  # the model axis (heads, all-reduces) across both


def test_kvjax_generate_mesh_from_the_launcher(generated):
    assert generated["codes"]["cli_mesh"] == 0 and generated["codes"]["cli_single"] == 0
    mesh, single = generated["cli_mesh"], generated["cli_single"]
    assert mesh is not None and single is not None
    assert mesh["token_ids"] == single["token_ids"] and len(mesh["token_ids"]) == 5


# ------------------------------------------------------------------------------------------------ training


def test_data_parallel_training_over_two_processes_equals_one(trained):
    assert trained["codes"]["one"] == 0 and trained["codes"]["two"] == 0, trained["codes"]
    one, two = trained["one"]["losses"], trained["two"]["losses"]
    assert len(one) == len(two) == 3 and np.all(np.isfinite(one))
    np.testing.assert_allclose(two, one, rtol=1e-5)  # pmean over gloo sums in its own order
    for name, value in trained["one"]["heads"].items():
        np.testing.assert_allclose(trained["two"]["heads"][name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("writer, reader", [("two", "two_then_one"),
                                            pytest.param("one", "one_then_two", marks=pytest.mark.heavy)])
def test_checkpoints_resume_across_process_counts_exactly(trained, writer, reader):
    """The last checkpoint of a 2-process run restored by 1 process (4 devices), and the reverse: the heads
    each writes right after restoring equal, bit for bit, the heads the writer ended with."""
    assert trained["codes"][reader] == 0, trained["codes"]
    assert trained[reader]["losses"] == trained[writer]["losses"]  # nothing re-run, nothing lost
    assert trained[reader]["heads"] == trained[writer]["heads"]


# ------------------------------------------------------------------------------------------------- serving


def test_serving_engine_on_a_two_device_mesh_equals_one_device():
    out = run("serve")
    assert out["devices"] == 2
    assert out["sharded"] == out["ref"] and len(out["ref"]) == 3
    assert out["leaked_pages"] == 0
    assert out["pool_devices"] == 2 and out["pool_shard_shape"][:2] == [1, 1]  # each device its heads' pool
    assert out["http_text"] == out["expected_text"] and out["http_text"]  # kvjax serve --mesh 1x2


# ------------------------------------------------------------------------------------------ in-process


def test_launcher_kills_the_others_when_one_process_fails():
    from kvjax.distributed.launch import launch

    # process 0 exits 3 at once; process 1 would sleep for a minute but is killed
    code = "import os, sys, time; sys.exit(3) if os.environ['KVJAX_PROCESS_ID'] == '0' else time.sleep(60)"
    start = time.monotonic()
    assert launch([sys.executable, "-c", code], 2, timeout_s=30) == 3
    assert time.monotonic() - start < 20


def test_mesh_from_text_names_the_problem():
    from kvjax.distributed import mesh_from_text

    with pytest.raises(ValueError, match="DATAxMODEL"):
        mesh_from_text("2by2")
    assert mesh_from_text("1x1").shape == {"data": 1, "model": 1}
