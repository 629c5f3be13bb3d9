"""Where a needle sits in a sample and what a state kept of it: its token span, the attention mass full
attention puts on it, the share of it each layer and kv head holds (trace programs, Locret's oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.attention import dense_causal_attention
from kvjax.cache.compaction import kept_positions
from kvjax.models import CausalLM
from kvjax.models.rope import rope_frequencies
from kvjax.models.transformer import unrolled
from kvjax.tasks import needles


def needle_span(model, sample) -> np.ndarray:
    """int[N]: context positions of the asked needle's tokens (its sentence, as tokenized in place)."""
    if sample.task == "passkey":
        text = needles.PASSKEY_NEEDLE.format(key=sample.answer)
    else:
        text = needles.RULER_NEEDLE.format(key=sample.key, value=sample.answer)
    length = len(model.tokenizer(" " + text, add_special_tokens=False)["input_ids"])
    start = sample.needle_positions[0]
    return np.arange(start, min(start + length, len(sample.context_ids)))


def needle_attention(model, prompt_ids, span: np.ndarray) -> np.ndarray:
    """f32[L, Hq]: per layer and query head, the attention mass the last prompt token puts on `span`."""
    cfg = model.cfg
    tokens = jnp.asarray(np.asarray(prompt_ids, np.int32)[None])
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    mask = jnp.zeros((T,), bool).at[jnp.asarray(span)].set(True)
    masses = []

    def attend(layer, inputs, carry):
        q = inputs.q[0, -1].astype(jnp.float32)  # [Hq, D]
        k = jnp.repeat(inputs.k[0].astype(jnp.float32), cfg.num_heads // cfg.num_kv_heads, axis=1)  # [T, Hq, D]
        probs = jax.nn.softmax(jnp.einsum("hd,thd->ht", q, k) * cfg.head_dim**-0.5, axis=-1)
        masses.append(np.asarray((probs * mask[None]).sum(-1)))
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), carry

    CausalLM(cfg, model.dtype).apply(
        {"params": model.params}, tokens, positions, rope_frequencies(cfg, False), unrolled(attend, cfg.num_layers),
        None, method=CausalLM.hidden_and_logits,
    )
    return np.stack(masses)


def kept_share(state, span: np.ndarray, row: int = 0, kept: list | None = None) -> np.ndarray:
    """f32[L, H]: per layer and kv head of sequence `row`, the share of `span`'s positions the state holds.
    `kept`: the state's `kvjax.cache.compaction.kept_positions`, when the caller already read them."""
    kept = kept_positions(state) if kept is None else kept
    return np.array([[np.isin(span, kept[l][row][h]).mean() for h in range(len(kept[l][row]))]
                     for l in range(len(kept))])


def kept_overlap(kept, reference, row: int = 0) -> np.ndarray:
    """f32[L, H]: per layer and kv head of sequence `row`, the share of `reference`'s kept positions that `kept`
    also holds (both `kvjax.cache.compaction.kept_positions`); 1 where the reference keeps none."""
    return np.array([[np.isin(reference[l][row][h], kept[l][row][h]).mean() if len(reference[l][row][h]) else 1.0
                      for h in range(len(reference[l][row]))] for l in range(len(reference))])


def value_span(model, sample, span: np.ndarray) -> np.ndarray:
    """int[N]: the positions of the asked value's tokens at the end of a RULER needle (its digits and the
    closing period); the whole needle for a passkey, whose key appears twice."""
    if sample.task == "passkey":
        return span
    length = len(model.tokenizer(" " + sample.answer + ".", add_special_tokens=False)["input_ids"])
    return span[-length:]


def answer_ids(model, sample) -> list[int]:
    """The gold answer's tokens as the model would write them after the question ("... is 12345")."""
    return model.tokenizer(" " + ", ".join(sample.answers), add_special_tokens=False)["input_ids"]


def needle_kept(state, spans) -> list[float]:
    """Per row b, the share of `spans[b]`'s positions the state holds, averaged over layers and kv heads."""
    kept = kept_positions(state)
    return [float(kept_share(state, span, row=b, kept=kept).mean()) for b, span in enumerate(spans)]
