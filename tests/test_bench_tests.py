"""eval.bench_tests reads pytest's summary and --durations rows into counts and per-file seconds."""

from kvjax.eval import bench_tests

OUTPUT = """\
........................................................ [100%]
============================= slowest durations ==============================
158.20s setup    tests/test_multiprocess.py::test_generation_across_processes
12.50s call     tests/test_policies.py::test_h2o[float32]
2.50s teardown tests/test_policies.py::test_h2o[float32]
0.70s call     tests/test_state.py::test_pages
802 passed, 17 skipped, 1 failed, 60 deselected, 3 warnings in 1106.31s (0:18:26)
"""


def test_counts_and_seconds_per_file():
    parsed = bench_tests.parse(OUTPUT)
    assert parsed["counts"] == {"passed": 802, "skipped": 17, "failed": 1, "deselected": 60, "warning": 3}
    assert parsed["files_s"] == {"tests/test_multiprocess.py": 158.2, "tests/test_policies.py": 15.0,
                                 "tests/test_state.py": 0.7}
    assert list(parsed["files_s"]) == ["tests/test_multiprocess.py", "tests/test_policies.py", "tests/test_state.py"]
    assert parsed["slowest"][0] == {"test": "tests/test_multiprocess.py::test_generation_across_processes",
                                    "phase": "setup", "s": 158.2}


def test_render_names_the_set_and_the_load():
    payload = {"set": "quick (python -m pytest)", "wall_s": 600.0, "returncode": 0, "machine": {"cpu_count": 2},
               "cpu_load_before": [0.1, 0.2, 0.3], "cpu_load_after": [1.9, 1.2, 0.8],
               **bench_tests.parse(OUTPUT)}
    text = bench_tests.render(payload)
    assert "10.0 minutes" in text and "802 passed" in text and "[0.1, 0.2, 0.3]" in text
    assert "`tests/test_multiprocess.py` | 158 | 91%" in text
