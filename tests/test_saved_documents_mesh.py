"""Saved documents on a mesh server (kvjax.serving.saved_documents with a mesh engine): answers equal one
device's, in the engine's batch and over HTTP."""

from __future__ import annotations

import os

import pytest


@pytest.mark.slow  # about 30 s of CPU: compiles the serving engine for one device and for a 1x2 mesh
def test_a_mesh_server_answers_from_a_saved_document():
    """tests/_saved_document_mesh_worker.py on 2 simulated CPU devices (a subprocess: XLA_FLAGS before jax starts)."""
    import json
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_saved_document_mesh_worker.py")
    run = subprocess.run([sys.executable, worker], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2
    assert out["mesh"] == out["one_device"] == out["alone"]  # two questions in one batch, greedy
    assert out["leaked_pages"] == 0
    assert out["loads_lookups"] == [1, 2]  # loaded once onto the mesh, then kept in the engine's cache
    assert out["http_text"] == out["expected_text"]  # kvjax serve --mesh 1x2 --documents: kv_state answered
