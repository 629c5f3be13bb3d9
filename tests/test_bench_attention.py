"""eval.bench_attention at its smallest shapes: Quest's stages (--components) are timed and reported."""

import json

import pytest

from kvjax.eval import bench_attention


def test_components_are_timed_and_reported(tmp_path):
    result = bench_attention.main(["--components", "--models", "llama2-7b", "--contexts", "1024", "--budgets", "256",
                                   "--repeats", "1", "--working-set-gib", "0.05", "--large-read-gib", "0.25",
                                   "--out", str(tmp_path)])
    (row,) = result["rows"]
    (quest,) = row["quest"]
    stages = quest["components"]
    assert stages["scores_s"] > 0 and stages["top_k_s"] > 0 and stages["sparse_decode_s"] > 0
    # the sparse decode reads the selected + current pages' K and V: Quest's bytes less its metadata
    metadata = 32 * (1024 // 16) * 2 * 128 * 4
    assert stages["sparse_decode_gbps"] * stages["sparse_decode_s"] * 1e9 == pytest.approx(quest["bytes"] - metadata)
    assert set(result["huge_pages"]) == {"transparent_hugepage", "glibc_tunables"}
    saved = json.loads((tmp_path / "bench_attention.json").read_text())
    assert saved["rows"][0]["quest"][0]["components"] == stages
    assert "Quest's stages" in (tmp_path / "bench_attention.md").read_text()
    assert (tmp_path / "bench_attention.png").stat().st_size > 0
