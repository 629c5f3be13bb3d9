"""eval/bench_locret_labels.py: one process per length, the run's own peak RSS and XLA's plan, on the tiny model."""

import json
import os

import pytest

from kvjax.eval import bench_locret_labels


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (VmHWM reset)")
def test_label_memory_points(tmp_path):
    out = str(tmp_path / "labels")
    payload = bench_locret_labels.main(["--model", "tiny", "--lengths", "64", "256", "--answer", "8", "--chunk", "32",
                                        "--out", out])
    short, long = payload["results"]
    assert "error" not in short and "error" not in long, payload["results"]
    assert (short["prefix_tokens"], long["prefix_tokens"]) == (64, 256)
    for point in (short, long):
        assert point["ran"] and point["run_s"] > 0
        assert 0 < point["run_peak_rss_mib"] <= point["peak_rss_mib"]
    assert long["targets_mib"] == pytest.approx(4 * short["targets_mib"])
    assert long["xla_temp_mib"] > short["xla_temp_mib"]  # the plan grows with the prefix...
    assert long["xla_temp_mib"] < 4 * short["xla_temp_mib"] + 1  # ...but no faster than linearly
    with open(os.path.join(out, "locret_labels.json")) as f:
        assert json.load(f)["results"] == payload["results"]
    assert "run's peak RSS MiB" in open(os.path.join(out, "locret_labels.md")).read()
