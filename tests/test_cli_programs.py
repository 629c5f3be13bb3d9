"""`kvjax bench` runs benchmarks and `kvjax eval` evaluations; an evaluation named under `bench` still runs."""

import pytest

from kvjax import cli


@pytest.fixture
def ran(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "_run_program", lambda module, argv, as_json=False: calls.append((module, argv)) or 0)
    return calls


def run(argv):
    args = cli.build_parser().parse_args(argv)
    return args.func(args)


def test_benchmarks_and_evaluations_are_apart():
    from kvjax.eval.evaluate import TASKS

    assert not set(cli.BENCHMARKS) & set(cli.EVALUATIONS) and not set(cli.EVALUATIONS) & set(TASKS)
    assert all(module.startswith("kvjax.eval.bench_") or name in ("suite", "compare")
               for name, module in cli.BENCHMARKS.items())


def test_eval_runs_an_evaluation_by_name_or_one_task(ran):
    run(["eval", "sweep", "--quick"])
    run(["eval", "perplexity", "--text", "book.txt"])  # evaluate.py's task of that name, as before
    run(["eval", "perplexity-sweep", "--quick"])
    assert ran == [("kvjax.eval.sweep", ["--quick"]), (cli.EVALUATE, ["perplexity", "--text", "book.txt"]),
                   ("kvjax.eval.perplexity", ["--quick"])]


def test_an_evaluation_under_bench_runs_and_says_where_it_moved(ran, capsys):
    run(["bench", "perplexity", "--quick"])
    run(["bench", "decode", "--quick"])
    assert ran == [("kvjax.eval.perplexity", ["--quick"]), ("kvjax.eval.bench_decode", ["--quick"])]
    assert "now `kvjax eval perplexity-sweep`" in capsys.readouterr().err


def test_a_folded_benchmark_runs_under_its_new_name_and_says_so(ran, capsys):
    run(["bench", "real", "--quick"])
    run(["bench", "real", "--model", "gemma3-270m"])
    assert ran == [("kvjax.eval.bench_decode", ["--model", "smollm2-135m", "--quick"]),
                   ("kvjax.eval.bench_decode", ["--model", "gemma3-270m"])]
    assert "runs `kvjax bench decode --model smollm2-135m --quick`" in capsys.readouterr().err
