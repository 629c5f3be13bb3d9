"""`eval.depths`: a sweep checkpoint's per-sample scores are matched to their needles' depths through the
sweep's strided batches."""

from __future__ import annotations

import json
from types import SimpleNamespace

from eval.depths import binned, depth_tables, scores_by_depth

SETTING = {"samples": 6, "records": 4, "seed": 0, "dense_layers": 0, "batch_size": 3}


def test_scores_get_the_depth_of_their_sample(tmp_path):
    samples = [SimpleNamespace(depth=d) for d in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    # two batches, strided as the sweep runs them: batch 0 = samples 0, 2, 4; batch 1 = samples 1, 3, 5
    rows = [
        {"task": "t", "length": 64, "batch": 0, "setting": SETTING,
         "scores": {"full": [1.0, 1.0, 0.0], "quest@32": [0.0, 1.0, 1.0], "quest@64": [1.0, 1.0, 1.0]}},
        {"task": "t", "length": 64, "batch": 1, "setting": SETTING,
         "scores": {"full": [1.0, 0.0, 1.0], "quest@32": [0.0, 0.0, 1.0], "quest@64": [1.0, 1.0, 1.0]}},
        {"task": "t", "length": 64, "batch": 0, "setting": {**SETTING, "seed": 1}, "scores": {"full": [0.0] * 3}},
    ]
    path = tmp_path / "sweep.batches.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = scores_by_depth(str(path), lambda task, n: samples, ["t"], [64], SETTING, 32)
    cells = found[("t", 64)]
    assert sorted(cells["full"]) == [(0.0, 1.0), (0.2, 1.0), (0.4, 1.0), (0.6, 0.0), (0.8, 0.0), (1.0, 1.0)]
    assert sorted(cells["quest"]) == [(0.0, 0.0), (0.2, 0.0), (0.4, 1.0), (0.6, 0.0), (0.8, 1.0), (1.0, 1.0)]
    assert binned(cells["quest"], 2) == [1 / 3, 2 / 3]  # depth 1.0 falls in the last, closed bin
    assert "| quest | 33% | 67% | 6 |" in depth_tables(found, ["full", "quest"], 2, 32)
