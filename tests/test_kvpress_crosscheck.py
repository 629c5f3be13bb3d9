"""kvjax keeps exactly what kvpress 0.5.x keeps (SnapKV, StreamingLLM, TOVA, AdaKV), on the same weights.

Runs only where the kvpress venv exists (`python -m eval.kvpress_crosscheck --setup` makes it); kvpress
pins transformers < 5.3, so it cannot share this environment.
"""

import os

import pytest

from kvjax.eval.kvpress_crosscheck import VENV, crosscheck

PYTHON = os.environ.get("KVPRESS_PYTHON", os.path.join(os.path.dirname(__file__), "..", VENV, "bin", "python"))


@pytest.mark.kvpress
@pytest.mark.skipif(not os.path.exists(PYTHON), reason="no kvpress venv: python -m eval.kvpress_crosscheck --setup")
def test_kept_positions_match_kvpress():
    report = crosscheck(PYTHON, length=512, budget=128)
    assert set(report) == {"snapkv", "streaming", "tova", "ada_snapkv"}
    for name, result in report.items():
        assert result["agrees"], f"{name}: {result}"
