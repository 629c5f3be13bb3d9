"""`kvjax demo --model gemma3-270m`: the demo's policies on Gemma-3 270M (sliding-window layers beside global
ones; KVzip left out and said so), run through the command line. Skipped unless the model is fetched (`real`)."""

import json

import pytest

from gguf_reference import fetched_or_skip

# heavy: loading the GGUF and its 262K-entry tokenizer takes half a minute before any policy runs
pytestmark = [pytest.mark.real, pytest.mark.heavy]
NAME = "gemma3-270m"
fetched_or_skip(NAME)


def test_the_demo_runs_on_gemma3(capsys):
    from kvjax.cli import main as cli_main
    from kvjax.eval.demo import REAL_POLICIES, SETTINGS, demo_table

    assert cli_main(["demo", "--model", NAME, "--length", "1024", "--samples", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tasks, ran = SETTINGS["real"][0], [p for p in REAL_POLICIES if p != "kvzip"]
    assert result["model"] == NAME and result["policies"] == ran
    assert list(result["skipped_policies"]) == ["kvzip"]  # its reconstruction pass: no sliding windows
    assert {(r["task"], r["policy"]) for r in result["accuracy"]} == {(t, p) for t in tasks for p in ran}
    assert all(r["samples"] == 1 and 0 <= r["accuracy"] <= 1 for r in result["accuracy"])
    assert {r["policy"]: r["decode_tokens_per_s"] > 0 for r in result["latency"]} == dict.fromkeys(ran, True)
    table = demo_table(result)
    assert all(f"| {p} |" in table for p in ran) and "kvzip left out: its reconstruction pass" in table
