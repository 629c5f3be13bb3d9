"""Bytes one decode step reads for each query-aware selector, against Quest and full attention.

Per (layer, kv head) at a context of n slots, pages of ps slots, head dim D, float32 K/V pages (4 bytes a
value), a group of G query heads selecting apart (per query head, as the sweep runs them), budget b:

- metadata: what the scorer reads to rank pages. Quest: kmin and kmax, 2 D x 4 bytes a page (32 bytes a
  token at D = 64, ps = 16). `loki`: `rank` bfloat16 coordinates a slot (2 rank bytes a token) plus its
  D x rank float32 basis. `key_int4`: D/2 bytes a slot plus D float32 scales. The oracles read every key
  (4 D bytes a token). Full attention scores nothing.
- scores: the page scores written and read back for top-k, 4 bytes per page and query head (per slot for
  the token oracle), plus the page table (4 bytes a page).
- chosen: the K and V the selected pages hold, b slots of 2 D x 4 bytes per query head (each query head
  reads its own pages); full attention reads the n slots once per kv head.

    python -m eval.selection_bytes --contexts 2048 4096 --budgets 64 128 256 512
"""

from __future__ import annotations

import argparse

from .lib.report import default_out, machine_info, markdown_table, write_outputs
from .lib.setups import step_bytes

SELECTORS = ("full", "quest", "oracle_page", "oracle_token", "loki", "key_int4")


def render(payload: dict) -> str:
    """Bytes one decode step reads per layer and kv head, a row per (context, budget, selector)."""
    header = ["context", "budget", "selector", "metadata", "scores + page table", "chosen K/V", "total",
              "metadata B/token"]
    body = [[r["context"], r["budget"], r["selector"], f"{r['metadata']:,}", f"{r['scores']:,}", f"{r['chosen']:,}",
             f"{r['total']:,}", f"{r['metadata_bytes_per_token']:.1f}"] for r in payload["results"]]
    return markdown_table(header, body)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--out", default=default_out("selection_bytes"))
    args = parser.parse_args(argv)
    rows = []
    for n in args.contexts:
        for budget in args.budgets:
            for selector in SELECTORS:
                b = step_bytes(selector, n, budget)
                rows.append({"context": n, "budget": budget, "selector": selector, **b,
                             "metadata_bytes_per_token": b["metadata"] / n})
    payload = {"benchmark": "selection_bytes", "machine": machine_info(), "head_dim": 64, "page_size": 16,
               "group": 3, "kv_itemsize": 4, "results": rows}
    table = render(payload)
    write_outputs(args.out, "selection_bytes", payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
