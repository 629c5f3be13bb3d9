"""A served model's layer pattern: which layers attend fully and which through a sliding window.

Pure host code (no jax).
"""

from __future__ import annotations


def alternating_windows(num_layers: int, window: int, first_sliding: bool = True) -> tuple[int | None, ...]:
    """Gemma-2's pattern: layers alternate a sliding window of `window` tokens and full attention
    (Gemma-2's layer 0 is a sliding one). None marks a full-attention layer."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    start = 0 if first_sliding else 1
    return tuple(window if (layer - start) % 2 == 0 else None for layer in range(num_layers))


__all__ = ["alternating_windows"]
