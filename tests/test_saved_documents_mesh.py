"""Saved documents and meshes: a mesh server answers from a saved document as one device does, in the engine's
batch and over HTTP; `kvjax prefill --mesh` saves the state one device saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _worker(kind: str) -> dict:
    """tests/_saved_document_mesh_worker.py `kind` on 2 simulated CPU devices (a subprocess: XLA_FLAGS before jax
    starts)."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_saved_document_mesh_worker.py")
    run = subprocess.run([sys.executable, worker, kind], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # about 30 s of CPU: compiles the serving engine for one device and for a 1x2 mesh
def test_a_mesh_server_answers_from_a_saved_document():
    out = _worker("serve")
    assert out["devices"] == 2
    assert out["mesh"] == out["one_device"] == out["alone"]  # two questions in one batch, greedy
    assert out["leaked_pages"] == 0
    assert out["loads_lookups"] == [1, 2]  # loaded once onto the mesh, then kept in the engine's cache
    assert out["http_text"] == out["expected_text"]  # kvjax serve --mesh 1x2 --documents: kv_state answered


@pytest.mark.slow  # about 15 s of CPU: two prefills of the tiny model, one on a 1x2 mesh
def test_cli_prefill_on_a_mesh_saves_what_one_device_saves():
    out = _worker("prefill")
    assert out["devices"] == 2
    one, mesh = out["one_device"], out["mesh"]
    assert one["code"] == mesh["code"] == 0 and one["batch"] == mesh["batch"] == 1  # no padding rows saved
    assert (one["report"]["devices"], mesh["report"]["devices"]) == (1, 2)  # the prefill's pages lived on both
    assert (mesh["report"]["pages"], mesh["report"]["room"]) == (one["report"]["pages"], one["report"]["room"])
    assert out["tables_equal"] and out["keys_max_diff"] < 1e-4  # the mesh's prefill differs in last bits only
    assert mesh["answers"] == one["answers"]
    assert "one document is one sequence, so the mesh is 1xM" in out["refused"] and not out["refused_saved"]


@pytest.mark.slow  # about 15 s of CPU: a prefill, then decode on one device and on a 2x1 mesh
def test_a_batch_the_data_axis_does_not_divide_is_padded_on_request():
    out = _worker("padded")
    assert out["devices"] == 2
    assert "1 sequences and 2 kv heads cannot split over 2 data" in out["refused"]  # not asked to pad
    assert out["held_rows"] == 2  # a copy of the sequence on the second data shard
    assert out["mesh"] == out["one_device"] and len(out["mesh"]) == 1  # the padding row's answer dropped
