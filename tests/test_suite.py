"""The benchmark suite and its comparison: two quick CPU runs that differ in dtype, then compare.
Only the cheap members run (suite prefill and the attention kernels at their smallest shapes)."""

from __future__ import annotations

import json
import math

import pytest

from kvjax import cli
from kvjax.eval import compare, suite

MEMBERS = ["prefill", "attention"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    out = {}
    for name, dtype in (("a", "float32"), ("b", "bfloat16")):
        out[name] = suite.main(["--quick", "--members", *MEMBERS, "--dtype", dtype, "--read-gib", "0.05",
                                "--note", "test run", "--out", str(root / name)])
    result = compare.main([str(root / "a"), str(root / "b" / "run.json"), "--out", str(root / "compare")])
    return root, out, result


def test_run_json_is_tagged_and_shares_are_value_over_the_large_read(runs):
    root, out, _ = runs
    for name, dtype in (("a", "float32"), ("b", "bfloat16")):
        run = json.loads((root / name / "run.json").read_text())
        assert run == json.loads(json.dumps(out[name]))  # main returns what it writes
        assert run["kind"] == suite.RUN_KIND and run["note"] == "test run"
        tag = run["device"]
        for field in ("device_kind", "platform", "device_count", "jax", "jaxlib", "cpu_model", "threads"):
            assert tag[field] not in (None, ""), field
        assert tag["platform"] == "cpu" and tag["dtype"] == dtype and tag["device_count"] >= 1
        read = run["large_read"]
        assert read["bytes"] == int(0.05 * 2**30) // 4 * 4 and read["median_gbps"] > 0
        assert {n: m["status"] for n, m in run["members"].items()} == {"prefill": "ok", "attention": "ok"}
        assert run["members"]["prefill"]["dtype"] == dtype
        assert (root / name / "attention" / "bench_attention.json").exists()
        assert (root / name / "prefill" / "prefill.json").exists()
        figures = run["figures"]
        assert {f["benchmark"] for f in figures} == set(MEMBERS)
        bandwidth = [f for f in figures if f["unit"] == "GB/s"]
        assert bandwidth and all(math.isfinite(f["value"]) and f["value"] > 0 for f in figures if f["unit"] != "s")
        for f in figures:
            assert set(f) >= {"benchmark", "name", "value", "unit", "config"}
            if f["unit"] == "GB/s":
                assert f["share_of_large_read"] == pytest.approx(f["value"] / read["median_gbps"], rel=1e-9)
            else:
                assert "share_of_large_read" not in f
        assert "# Suite run" in (root / name / "run.md").read_text()


def test_compare_puts_both_runs_and_every_common_figure_side_by_side(runs):
    root, out, result = runs
    table = (root / "compare" / "compare.md").read_text()
    labels = [out["a"]["label"], out["b"]["label"]]
    assert labels[0] != labels[1] and all(label in table for label in labels)
    assert "float32" in table and "bfloat16" in table and "test run" in table
    keys = [{compare.figure_key(f) for f in out[n]["figures"]} for n in ("a", "b")]
    common = keys[0] & keys[1]
    assert common and result["common"] == len(common)
    lines = table.splitlines()
    for f in out["a"]["figures"]:
        if compare.figure_key(f) in common:
            cells = [f["benchmark"], f["name"], compare.config_text(f["config"])]
            assert any(all(f"| {c} |" in line for c in cells) for line in lines), cells
    saved = json.loads((root / "compare" / "compare.json").read_text())
    for row in saved["figures"]:
        if row["common"]:
            a, b = row["values"]
            assert row["ratio_to_first"][1] == pytest.approx(b / a)
    for png in ("shares.png", "ratios.png"):
        data = (root / "compare" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_compare_names_a_file_that_is_not_a_run(runs, tmp_path, capsys):
    root, _, _ = runs
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    other = tmp_path / "bench_decode.json"
    other.write_text(json.dumps({"benchmark": "bench_decode", "results": []}))
    for bad in (not_json, other):
        with pytest.raises(ValueError, match=str(bad)):
            compare.load_run(str(bad))
    with pytest.raises(FileNotFoundError, match="no suite run"):
        compare.load_run(str(tmp_path))
    assert cli.main(["bench", "compare", str(root / "a"), str(other), "--out", str(tmp_path / "c")]) == 2
    assert str(other) in capsys.readouterr().err


def test_a_member_that_is_unavailable_or_fails_is_recorded_and_the_suite_goes_on(tmp_path):
    settings = suite.Settings(out=str(tmp_path), quick=True, dtype="float32", threads=1, read_gib=0.05)
    read = {"median_gbps": 10.0}
    missing = suite.Member("ghost", "kvjax.eval.no_such_bench", (), lambda s, o: ["--out", o],
                           lambda p, r: [], "ghost")
    entry, figures = suite.run_member(missing, settings, read)
    assert entry["status"] == "skipped" and "kvjax.eval.no_such_bench" in entry["reason"] and figures == []
    no_torch = suite.Member("needy", None, ("no_such_module_xyz",), lambda s, o: [], lambda p, r: [], "needy")
    assert "no_such_module_xyz is not installed" in suite.run_member(no_torch, settings, read)[0]["reason"]
    broken = suite.Member("broken", "kvjax.eval.compare", (), lambda s, o: ["--no-such-option"],
                          lambda p, r: [], "broken")
    entry, figures = suite.run_member(broken, settings, read)
    assert entry["status"] == "failed" and "SystemExit" in entry["reason"] and figures == []
    assert (tmp_path / "broken" / "error.txt").exists()


def test_threads_outside_the_machine_are_refused():
    with pytest.raises(ValueError, match="--threads 0"):
        suite.pin_threads(0)
    assert set(suite.MEMBERS) == {"attention", "policies", "decode", "prefill", "real", "dispatch"}
    assert cli.BENCHMARKS["suite"] == "kvjax.eval.suite" and cli.BENCHMARKS["compare"] == "kvjax.eval.compare"


def test_dispatch_member_times_every_dispatch_size_against_one_step(tmp_path):
    from kvjax.eval import bench_dispatch

    payload = bench_dispatch.main(["--quick", "--out", str(tmp_path)])
    rows = payload["rows"]
    assert {(r["batch"], r["steps_per_dispatch"]) for r in rows} == {(1, 1), (1, 8), (2, 1), (2, 8)}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # each row's speedup is its own (model, batch)'s one-step-per-call time over its time, and its rates
    # follow from its seconds (the K = 1 row's ratio is with itself, so it alone checks nothing)
    for r in rows:
        one = next(o for o in rows if (o["model"], o["batch"], o["steps_per_dispatch"]) == (r["model"], r["batch"], 1))
        assert r["speedup_vs_1"] == pytest.approx(one["seconds"] / r["seconds"]), r
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * payload["settings"]["new"] / r["seconds"]), r
        assert r["ms_per_step"] == pytest.approx(1e3 * r["seconds"] / (payload["settings"]["new"] - 1)), r
    figures = suite.dispatch_figures(payload, {"median_gbps": 10.0})
    assert len(figures) == 2 * len(rows) and {f["benchmark"] for f in figures} == {"dispatch"}
    assert (tmp_path / "bench_dispatch.md").exists() and (tmp_path / "bench_dispatch.png").exists()
