"""What the kvpress and KVzip cross-checks share: the kvpress venv and the comparison of kept positions."""

from __future__ import annotations

import numpy as np

VENV = ".venv-kvpress"  # kvpress pins transformers < 5.3: it runs in a venv of its own (`--setup` makes it)


def compare(ours: list, theirs: list, scores: list, tol: float) -> dict:
    """Per (layer, head): positions kept by one side only, and whether kvpress's scores tie them."""
    differing, ties, same_counts = 0, 0, True
    for layer, (ours_l, theirs_l) in enumerate(zip(ours, theirs)):
        for head, (a, b) in enumerate(zip(ours_l, theirs_l)):
            s = np.asarray(scores[layer][head])
            # pair the swapped positions by kvpress's score, best first
            only_ours = sorted(set(a) - set(b), key=lambda t: -s[t])
            only_theirs = sorted(set(b) - set(a), key=lambda t: -s[t])
            differing += len(only_ours)
            scale = np.max(np.abs(s[np.isfinite(s)])) if np.isfinite(s).any() else 1.0
            for x, y in zip(only_ours, only_theirs):
                if abs(s[x] - s[y]) <= tol * scale:
                    ties += 1
            same_counts &= len(only_ours) == len(only_theirs)
    return {"differing_positions": differing, "explained_by_ties": ties, "same_counts_per_head": same_counts,
            "exact": differing == 0 and same_counts, "agrees": differing == ties and same_counts}
