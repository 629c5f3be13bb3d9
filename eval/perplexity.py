"""PG19-style perplexity by token-by-token decode (Quest's language-modelling evaluation).

A prefix of the text is prefilled (and compressed, for methods that compress); every following token is
then fed through `decode_step`, so each prediction reads the cache the policy keeps (Quest's selection,
H2O's and TOVA's eviction) exactly as generation would. The score is the mean negative log-likelihood of
each next token and its exponential.

    result = decode_perplexity(model, policy, token_ids, prefix_tokens=256)
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from tqdm import tqdm


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
    import kvjax

    ids = [int(t) for t in token_ids]
    if not 1 <= prefix_tokens < len(ids):
        raise ValueError(f"prefix_tokens must be in [1, {len(ids)}) for {len(ids)} tokens, got {prefix_tokens}")
    state, logits = kvjax.prefill(model, [ids[:prefix_tokens]], policy, page_size=page_size,
                                  max_new_tokens=len(ids) - prefix_tokens)
    nll = np.zeros(len(ids) - prefix_tokens, np.float64)
    for i, t in enumerate(tqdm(range(prefix_tokens, len(ids)), desc=f"perplexity {policy.name}", disable=not progress,
                               leave=False)):
        logprobs = jax.nn.log_softmax(logits[0].astype(np.float32))
        nll[i] = -float(logprobs[ids[t]])
        if t + 1 < len(ids):
            logits, state = kvjax.decode_step(model, state, [ids[t]], policy)
    mean = float(nll.mean())
    return {"policy": policy.name, "tokens": int(nll.size), "prefix_tokens": prefix_tokens, "nll": mean,
            "perplexity": math.exp(mean)}
