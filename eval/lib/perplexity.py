"""Decode perplexity (Quest's, StreamingLLM's and H2O's language-modelling measure): a prefix prefilled (and
compressed), every following token fed through a decode step, so each prediction reads what the policy kept.

    result = decode_perplexity(model, policy, token_ids, prefix_tokens=256)
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

import kvjax
from kvjax.engine.generation import feed_tokens


def read_text_tokens(path: str, tokenizer, max_tokens: int | None = None) -> list[int]:
    """Token ids of a local text file (BOS first, as the tokenizer adds it)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} holds no text")
    ids = tokenizer(text)["input_ids"]
    return ids[:max_tokens] if max_tokens else ids


def decode_perplexity(model, policy, token_ids: Sequence[int], prefix_tokens: int = 1, page_size: int = 16,
                      progress: bool = True) -> dict:
    """Mean NLL and perplexity of `token_ids[prefix_tokens:]`, each predicted through one decode step."""
    ids = [int(t) for t in token_ids]
    if not 1 <= prefix_tokens < len(ids):
        raise ValueError(f"prefix_tokens must be in [1, {len(ids)}) for {len(ids)} tokens, got {prefix_tokens}")
    state, logits = kvjax.prefill(model, [ids[:prefix_tokens]], policy, page_size=page_size,
                                  max_new_tokens=len(ids) - prefix_tokens)
    _, _, nll = feed_tokens(model, state, logits, [np.asarray(ids[prefix_tokens:], np.int32)], policy,
                            return_nll=True, progress=progress)
    mean = float(nll[0].astype(np.float64).mean())
    return {"policy": policy.name, "tokens": int(nll.shape[1]), "prefix_tokens": prefix_tokens, "nll": mean,
            "perplexity": math.exp(mean)}
