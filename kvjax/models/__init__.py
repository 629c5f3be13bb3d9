"""Functional Flax decoder models (Llama, Mistral, Qwen2, Phi-3) with an explicit KV state.

Layer parameters are stacked (`params["layers"]`, leaves `[L, ...]`); `layer_params` and `first_layers`
take one layer or a prefix of the stack without hand-rolled slicing; `unstack_layers` takes the stack apart
for decode (one tree per layer, each read in place).
"""

from kvjax.models.transformer import (
    AttentionInputs,
    CausalLM,
    Segment,
    first_layers,
    is_unstacked,
    layer_params,
    segments_by,
    unrolled,
    unstack_layers,
)

__all__ = ["AttentionInputs", "CausalLM", "Segment", "first_layers", "is_unstacked", "layer_params", "segments_by",
           "unrolled", "unstack_layers"]
