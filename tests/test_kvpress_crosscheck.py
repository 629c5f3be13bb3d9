"""kvjax keeps exactly what kvpress 0.5.x keeps (SnapKV, StreamingLLM, TOVA, AdaKV, PyramidKV, H2O), on the
same weights; where a definition differs from kvpress's press (eval/kvpress_crosscheck.py says how), the
difference is checked to be there. Runs only where the kvpress venv exists (`python -m
eval.kvpress_crosscheck --setup` makes it); kvpress pins transformers < 5.3, so it cannot share this environment.
"""

import os

import pytest

from kvjax.eval.kvpress_crosscheck import DIFFERS, PAIRS, crosscheck
from kvjax.eval.lib.crosscheck import VENV

PYTHON = os.environ.get("KVPRESS_PYTHON", os.path.join(os.path.dirname(__file__), "..", VENV, "bin", "python"))


@pytest.mark.kvpress
@pytest.mark.heavy  # kvpress's own venv and model runs: CI builds it and runs the whole set
@pytest.mark.skipif(not os.path.exists(PYTHON), reason="no kvpress venv: python -m eval.kvpress_crosscheck --setup")
def test_kept_positions_match_kvpress():
    report = crosscheck(PYTHON, length=512, budget=128)
    assert {r["policy"] for r in report.values()} >= {"snapkv", "streaming", "tova", "ada_snapkv", "pyramid", "h2o"}
    for press in PAIRS:
        assert report[press]["agrees"], f"{press}: {report[press]}"
    # kvpress's PyramidKVPress at beta 20 falls back to SnapKV's uniform budget; kvjax keeps a pyramid
    pyramid = report["pyramidkv_beta20"]
    assert pyramid["kvpress_kept_per_layer"] == [128, 128] and pyramid["kept_per_layer"][0] > pyramid["kept_per_layer"][1]
    # kvpress's ObservedAttentionPress averages each key's attention over the queries that see it: other positions
    assert report["observed_attention"]["same_counts_per_head"] and report["observed_attention"]["differing_positions"] > 0
    assert set(report) == set(PAIRS) | set(DIFFERS)
