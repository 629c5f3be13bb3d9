"""Functional Flax decoder models (Llama, Mistral, Qwen2, Phi-3, Gemma-3) with an explicit KV state.

Notes: docs/modules.md (`kvjax/models/__init__.py`)."""

from kvjax.models.transformer import (
    AttentionInputs,
    CausalLM,
    Segment,
    first_layers,
    is_unstacked,
    layer_params,
    stack_layers,
    unrolled,
    unstack_layers,
)

__all__ = ["AttentionInputs", "CausalLM", "Segment", "first_layers", "is_unstacked", "layer_params", "stack_layers",
           "unrolled", "unstack_layers"]
