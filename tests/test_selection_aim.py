"""The selection aim's judge (`eval.lib.selection_aim`): pooling independent sweeps and the verdicts."""

import pytest

from kvjax.eval.lib import selection_aim


def _sweep(seed, rows):
    return {"seed": seed, "accuracy": [
        {"task": "niah_single", "length": 4096, "policy": p, "budget": b, "accuracy": a, "samples": n}
        for p, b, a, n in rows]}


def test_pooling_weights_by_samples_and_the_verdicts_follow_the_aim_and_the_oracle():
    first = _sweep(0, [("full", None, 0.8, 20), ("oracle_page:dense_layers=2", 128, 0.6, 20),
                       ("key_int4:dense_layers=2", 128, 0.7, 20), ("loki:dense_layers=2", 256, 1.0, 20)])
    second = _sweep(1, [("full", None, 1.0, 30), ("oracle_page:dense_layers=2", 128, 0.8, 30),
                        ("key_int4:dense_layers=2", 128, 0.7, 30), ("loki:dense_layers=2", 256, 0.8, 30)])
    cells = selection_aim.pooled([first, second])
    assert cells[("niah_single", 4096, "full", None)][:2] == (pytest.approx(0.92), 50)
    rows = {(r["policy"], r["budget"]): r for r in selection_aim.aim_rows([first, second])}
    oracle, key_int4, loki = (rows[k] for k in [("oracle_page:dense_layers=2", 128), ("key_int4:dense_layers=2", 128),
                                                 ("loki:dense_layers=2", 256)])
    assert oracle["share"] == pytest.approx(0.72 / 0.92) and not oracle["holds"]
    assert key_int4["accuracy"] == pytest.approx(0.7) and key_int4["share"] < 0.9
    assert not key_int4["holds"]  # below the aim and below the oracle (0.70 < 0.72)
    assert loki["share"] == pytest.approx(0.88 / 0.92) and loki["holds"]  # 95.7% of full at 256
    text = selection_aim.render([first, second])
    assert "held to the oracle" not in text and "the ceiling is short of it" in text


def test_a_selector_at_the_oracle_below_the_aim_holds_and_one_seed_twice_is_refused():
    sweep = _sweep(0, [("full", None, 1.0, 20), ("oracle_page:dense_layers=2", 128, 0.8, 20),
                       ("key_int4:dense_layers=2", 128, 0.8, 20)])
    rows = {r["policy"]: r for r in selection_aim.aim_rows([sweep])}
    assert rows["key_int4:dense_layers=2"]["holds"]
    assert "held to the oracle: yes" in selection_aim.render(sweep)
    with pytest.raises(ValueError, match="seed 0"):
        selection_aim.pooled([sweep, sweep])
