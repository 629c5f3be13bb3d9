"""Locret (Huang et al., 2024): trained retaining heads score cached tokens; chunked prefill evicts to a budget.

- the heads (`kvjax.policies.locret_heads`, beside the policy that runs them, re-exported here): the
  per-layer heads, the one scoring function `retaining_scores`, orbax / safetensors storage, the heads
  shipped by model name (`kvjax/assets/locret-heads/`).
- `labels`: training targets through kvjax's own chunked-prefill step.
- `training`: the loss (`loss_fn`), optimizer and jitted train step.
- `data`: LongAlpaca-style rows (instruction, output) from the hub, local json / jsonl / parquet, or in memory
  (`kvjax.tasks.longalpaca.real_text_rows`, the offline recipe on real text).

The policy itself is `kvjax.policies.locret.Locret` (`make_policy("locret", ...)`).
"""

from kvjax.policies.locret_heads import (
    HeadsConfig, RetainingHeads, export_safetensors, init_heads, load_heads, restore_heads, retaining_scores, save_heads,
    shipped_heads,
)
from kvjax.locret.labels import Batch, Targets, compute_targets

__all__ = [
    "Batch", "HeadsConfig", "RetainingHeads", "Targets", "compute_targets", "export_safetensors", "init_heads",
    "load_heads", "restore_heads", "retaining_scores", "save_heads", "shipped_heads",
]
