"""eval.locret_real reads Locret's cells and the compared evictors' out of sweep JSON files."""

from __future__ import annotations

import json

from kvjax.eval import locret_real


def test_tables_keep_locret_and_the_compared_policies_where_locret_ran(tmp_path):
    cells = [
        {"task": "real_passkey", "length": 4096, "policy": "full", "budget": None, "accuracy": 0.9, "correct": 45, "samples": 50},
        {"task": "real_passkey", "length": 4096, "policy": "snapkv", "budget": 512, "accuracy": 0.02, "correct": 1, "samples": 50},
        {"task": "real_passkey", "length": 4096, "policy": "quest", "budget": 512, "accuracy": 0.3, "correct": 15, "samples": 50},
        {"task": "real_passkey", "length": 4096, "policy": "locret:heads=x", "budget": 512, "accuracy": 0.05, "correct": 1, "samples": 20},
        {"task": "niah_single", "length": 2048, "policy": "full", "budget": None, "accuracy": 1.0, "correct": 50, "samples": 50},
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"accuracy": cells}))
    kept = locret_real.locret_cells([str(path)])
    assert {c["policy"] for c in kept} == {"full", "snapkv", "locret:heads=x"}  # quest is not compared; 2K has no Locret
    table = locret_real.tables(kept)
    assert "512 (1/8)" in table and "| full | 90% |" in table and "5% (n=20)" in table
    paths = locret_real.main(["--sweeps", str(path), "--out", str(tmp_path / "out")])
    written = open(paths["md"]).read()  # the table, then the load the run saw (eval.lib.report.write_outputs)
    assert written.startswith(table) and written[len(table):].lstrip().startswith("Load average before/after:")
