"""kvjax: long-context KV-cache compression and sparse attention in JAX.

Public API (see the README): load_model, forward_logits, make_policy, register_policy, generate, prefill,
decode_step, generate_text, CacheCapacityError.
"""

from kvjax.models.config import ModelConfig
from kvjax.engine.api import decode_step, forward_logits, generate, generate_text, prefill
from kvjax.models.loading import Model, init_params, load_model
from kvjax.models.convert import CheckpointError
from kvjax.policies import Policy, make_policy, register_policy
from kvjax.cache.state import CacheCapacityError, KVState, init_state

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError",
    "CheckpointError",
    "KVState",
    "Model",
    "ModelConfig",
    "Policy",
    "decode_step",
    "forward_logits",
    "generate",
    "generate_text",
    "init_params",
    "init_state",
    "load_model",
    "make_policy",
    "prefill",
    "register_policy",
]
