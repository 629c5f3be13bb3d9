"""Which weight matrices a compiled program copies: the check that a decode step reads each weight in place.

Notes: docs/modules.md (`kvjax/models/weight_copies.py`)."""

from __future__ import annotations

import re
from typing import Any

import jax

from kvjax.models.transformer import is_unstacked

_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_NOT_A_COPY = {"parameter", "get-tuple-element", "bitcast", "tuple"}


def weight_shapes(params: Any) -> set[tuple[int, ...]]:
    """The shapes of one layer's weight matrices (leaves of two or more axes) in a model's parameter tree,
    stacked (`[L, ...]`, the leading axis dropped) or per-layer (`unstack_layers`)."""
    layers = params["layers"]
    if is_unstacked(layers):
        return {tuple(w.shape) for w in jax.tree.leaves(layers) if w.ndim >= 2}
    return {tuple(w.shape[1:]) for w in jax.tree.leaves(layers) if w.ndim >= 3}


def weight_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """The instructions of compiled HLO text (`jit(f).lower(...).compile().as_text()`) that produce an array
    of one of `shapes` outside a fusion's body, other than parameters, tuple elements and bitcasts: each is
    a weight matrix materialised by the program. Returns their lines (empty: no weight is copied)."""
    fused = set(re.findall(r" fusion\(.*calls=%([\w.\-]+)", hlo_text))
    computation, copies = None, []
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        match = _INSTRUCTION.match(line)
        if match is None or computation in fused:
            continue
        shape = tuple(int(d) for d in match.group(2).split(",") if d)
        if shape in shapes and match.group(3) not in _NOT_A_COPY:
            copies.append(line.strip())
    return copies


__all__ = ["weight_copies", "weight_shapes"]
