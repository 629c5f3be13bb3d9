"""The selection aim judged from committed sweeps: at each (task, length), every selector's accuracy at
budgets 128 and 256 as a share of full attention's, against the aim (90% of full at 128, 95% at 256) and
against the page oracle at the same budget (`<!-- render eval.lib.selection_aim a.json,b.json -->`).

Sweeps of the same cells with different seeds (independent samples) are pooled: accuracy weighted by
samples. Sweeps with the same seed share text windows, so pool only different seeds (`pooled` refuses
the same seed twice for a cell).
"""

from __future__ import annotations

from .report import markdown_table

AIM = {128: 0.90, 256: 0.95}
ORACLE = "oracle_page:dense_layers=2"
SHORT_TASK = {"real_passkey": "passkey", "niah_single": "needle"}  # column and row labels


def pooled(results: list) -> dict:
    """{(task, length, policy, budget): (accuracy, samples, seeds)} over sweeps of distinct seeds."""
    cells: dict = {}
    for result in results:
        for row in result["accuracy"]:
            key = (row["task"], row["length"], row["policy"], row["budget"])
            acc, n, seeds = cells.get(key, (0.0, 0, ()))
            if result["seed"] in seeds:
                raise ValueError(f"two sweeps with seed {result['seed']} hold {key}: their samples are not independent")
            total = n + row["samples"]
            cells[key] = ((acc * n + row["accuracy"] * row["samples"]) / total, total, seeds + (result["seed"],))
    return cells


def aim_rows(results: list, budgets=(128, 256)) -> list[dict]:
    """One row per (task, length, selector, budget): accuracy, samples, full's accuracy, the share of full,
    the oracle's accuracy and whether the aim holds (share >= AIM[budget]) or the selector matches the
    oracle where the oracle itself is short of the aim."""
    cells = pooled(results)
    rows = []
    for (task, n, policy, budget), (acc, samples, _) in cells.items():
        if policy == "full" or budget not in budgets or "quest" in policy or policy.startswith("oracle_token"):
            continue
        full = cells.get((task, n, "full", None))
        oracle = cells.get((task, n, ORACLE, budget))
        if full is None:
            continue
        share = acc / full[0] if full[0] else float("nan")
        oracle_share = oracle[0] / full[0] if oracle and full[0] else None
        at_oracle = policy != ORACLE and oracle_share is not None and oracle_share < AIM[budget] and acc >= oracle[0]
        held = share >= AIM[budget] or at_oracle
        rows.append({"task": task, "length": n, "policy": policy, "budget": budget, "accuracy": acc,
                     "samples": samples, "full": full[0], "full_samples": full[1], "share": share,
                     "oracle": None if oracle is None else oracle[0], "holds": bool(held)})
    return sorted(rows, key=lambda r: (r["length"], r["task"], r["policy"] != ORACLE, r["policy"], r["budget"]))


def render(results) -> str:
    """The aim table (`a.json,b.json` of the renderer hands a list; one sweep alone is a list of one)."""
    results = results if isinstance(results, list) else [results]
    table = []
    for r in aim_rows(results):
        oracle = "" if r["oracle"] is None or r["policy"] == ORACLE else f"{100 * r['oracle']:.0f}%"
        if r["share"] >= AIM[r["budget"]]:
            verdict = "yes"
        elif r["policy"] == ORACLE:
            verdict = "no: the ceiling is short of it"
        else:
            verdict = "held to the oracle: yes" if r["holds"] else "no"
        table.append([f"{SHORT_TASK.get(r['task'], r['task'])} {r['length'] // 1024}K", r["policy"].replace(":dense_layers=2", ""),
                      r["budget"], f"{100 * r['full']:.0f}% ({r['full_samples']})",
                      f"{100 * r['accuracy']:.0f}% ({r['samples']})", f"{100 * r['share']:.0f}%", oracle, verdict])
    return markdown_table(["task", "selector", "budget", "full (samples)", "selector (samples)", "share of full",
                           "page oracle", f"aim ({', '.join(f'{100 * v:.0f}% at {b}' for b, v in AIM.items())})"],
                          table)
