"""Functional Flax decoder models (Llama, Mistral, Qwen2, Phi-3) with an explicit KV state.

Layer parameters are stacked (`params["layers"]`, leaves `[L, ...]`); `layer_params` and `first_layers`
take one layer or a prefix of the stack without hand-rolled slicing.
"""

from kvjax.models.transformer import (
    AttentionInputs,
    CausalLM,
    Segment,
    first_layers,
    layer_params,
    segments_by,
    unrolled,
)

__all__ = ["AttentionInputs", "CausalLM", "Segment", "first_layers", "layer_params", "segments_by", "unrolled"]
