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


@pytest.mark.heavy  # four points, each a fresh process; the pool bound itself: tests/test_locret_policy.py
def test_memory_points_of_a_named_model_with_shipped_heads(tmp_path):
    from kvjax.eval import bench_memory

    payload = bench_memory.main(["--model", "tiny", "--heads", "tiny", "--contexts", "512", "1024",
                                 "--locret-only-contexts", "--budget", "96", "--local-tail", "16", "--chunk", "128", "--new-tokens", "2",
                                 "--out", str(tmp_path)])
    points = {(r["policy"], r["context"]): r for r in payload["results"]}
    assert all("error" not in r for r in points.values()), payload["results"]
    assert payload["model"] == "tiny" and payload["heads"] == "tiny"
    # Locret's pool is sized for budget + one chunk, whatever the context; the full cache's grows with it
    assert points["locret", 512]["pool_mib"] == points["locret", 1024]["pool_mib"]
    assert points["full", 1024]["pool_mib"] > 1.5 * points["full", 512]["pool_mib"]  # capacity rounds up to 256
    assert points["locret", 1024]["kv_in_use_mib"] < points["full", 1024]["kv_in_use_mib"] / 4
    assert set(payload["slopes_mib_per_1k_tokens"]) == {"full", "locret"}
    assert "MiB per 1K tokens" in (tmp_path / "bench_memory.md").read_text()
