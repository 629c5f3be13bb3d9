"""kvjax: long-context KV-cache compression and sparse attention in JAX.

Public API (see the README): load_model, forward_logits, make_policy, register_policy, generate, prefill,
decode_step, generate_text, save_state, load_state, generate_from_state, CacheCapacityError.
"""

from kvjax.models.config import ModelConfig
from kvjax.engine.api import decode_step, forward_logits, generate, generate_text, prefill
from kvjax.engine.saved_state import (
    SavedState, SavedStateError, generate_from_state, load_state, read_header, save_state,
)
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
    "SavedState",
    "SavedStateError",
    "decode_step",
    "forward_logits",
    "generate",
    "generate_from_state",
    "generate_text",
    "init_params",
    "init_state",
    "load_model",
    "load_state",
    "make_policy",
    "prefill",
    "read_header",
    "register_policy",
    "save_state",
]
