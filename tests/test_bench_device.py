"""`kvjax bench device`: its plan and how it reads the kernel tests' result (the run itself needs a device)."""

from kvjax.eval import bench_device


def test_plan_runs_native_kernel_tests_both_suites_and_compare(tmp_path, capsys):
    out = bench_device.main(["--dry-run", "--out", str(tmp_path), "--members", "attention"])
    names = [s["name"] for s in out["steps"]]
    assert names == ["kernel tests (native)", "suite on the device", "suite on the CPU", "compare"]
    steps = {s["name"]: s for s in out["steps"]}
    assert "tests/test_kernels_native.py" in steps["kernel tests (native)"]["argv"]
    assert steps["kernel tests (native)"]["env"] == {"KVJAX_TEST_REQUIRE": "native"}  # a skip there fails it
    assert steps["suite on the CPU"]["env"] == {"JAX_PLATFORMS": "cpu"}
    assert "--quick" in steps["suite on the device"]["argv"]
    compare = steps["compare"]["argv"]
    assert compare[-4:-2] == [str(tmp_path / "cpu"), str(tmp_path / "device")]
    assert "JAX_PLATFORMS=cpu" in capsys.readouterr().out


def test_counts_read_pytests_closing_line():
    output = "....F.s\n=== 1 failed, 5 passed, 1 skipped, 2 errors in 12.3s ===\n"
    assert bench_device.pytest_counts(output) == {"failed": 1, "passed": 5, "skipped": 1, "errors": 2}
    assert bench_device.pytest_counts("sss\n13 skipped in 0.50s\n") == {"skipped": 13}
    assert bench_device.pytest_counts("crashed before the summary") == {}


def test_counts_fall_back_to_the_progress_lines():
    """pytest -qq prints no summary line (the H200 run's first record): the progress characters count instead."""
    output = "bringing up nodes...\n........F.s [ 65%]\n..E                       [100%]\n== warnings summary ==\n"
    assert bench_device.pytest_counts(output) == {"passed": 11, "failed": 1, "skipped": 1, "errors": 1}


def test_kernel_tests_share_a_gpu_and_not_a_tpu():
    import argparse

    args = argparse.Namespace(out="x", members=["attention"], full=False)
    gpu, tpu = bench_device.plan(args, "gpu")[0], bench_device.plan(args, "tpu")[0]
    assert gpu["argv"][gpu["argv"].index("-n") + 1] == "4" and gpu["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert tpu["argv"][tpu["argv"].index("-n") + 1] == "0" and "XLA_PYTHON_CLIENT_PREALLOCATE" not in tpu["env"]
    assert "-q" not in gpu["argv"]  # the project's addopts has -q; -qq would hide pytest's summary line


def test_a_step_past_the_budget_is_recorded_not_run():
    record = bench_device.run_step({"name": "x", "argv": ["true"], "env": {}}, deadline=0.0)
    assert record["status"] == "not run (budget spent)"
