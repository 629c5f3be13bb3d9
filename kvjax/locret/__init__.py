"""Locret (Huang et al., 2024): trained retaining heads score cached tokens; chunked prefill evicts to a budget.

Notes: docs/modules.md (`kvjax/locret/__init__.py`)."""

from kvjax.policies.locret_heads import (
    HeadsConfig, RetainingHeads, export_safetensors, init_heads, load_heads, restore_heads, retaining_scores, save_heads,
    shipped_heads,
)
from kvjax.locret.labels import Batch, Targets, compute_targets

__all__ = [
    "Batch", "HeadsConfig", "RetainingHeads", "Targets", "compute_targets", "export_safetensors", "init_heads",
    "load_heads", "restore_heads", "retaining_scores", "save_heads", "shipped_heads",
]
