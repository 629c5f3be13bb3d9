"""Functional Flax decoder models (Llama, Mistral, Qwen2, Phi-3) with an explicit KV state."""

from kvjax.models.transformer import AttentionInputs, CausalLM

__all__ = ["AttentionInputs", "CausalLM"]
