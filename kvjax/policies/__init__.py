"""KV-cache policies: one small file per method, registered by name for `kvjax.make_policy`."""

from kvjax.policies.base import (
    POLICY_REGISTRY, ChunkSchedule, Compressor, DecodeEvictor, DecodeView, FullPolicy, LayerRoles, PageView, Policy,
    Preset, PromptView, ScoringPass, Selector, layer_roles, make_policy, register_policy, register_preset,
)
from kvjax.policies.eviction import ScoredEviction
from kvjax.policies.snapkv import SnapKV
from kvjax.policies.pyramid import PyramidKV
from kvjax.policies.h2o import H2O
from kvjax.policies.tova import TOVA
from kvjax.policies.streaming import StreamingLLM
from kvjax.policies.quest import Quest
from kvjax.policies.quest_static import QuestStatic
from kvjax.policies.quest_adaptive import QuestAdaptive
from kvjax.policies.compose import Compose
from kvjax.policies.locret import Locret
from kvjax.policies.ada import AdaKV
from kvjax.policies.kvzip import KVzip
from kvjax.policies.oracle import OraclePage, OracleToken
from kvjax.policies.loki import Loki
from kvjax.policies.key_int4 import KeyInt4
from kvjax.policies.options import parse_spec

__all__ = [
    "POLICY_REGISTRY", "AdaKV", "ChunkSchedule", "Compose", "Quest", "QuestAdaptive", "QuestStatic", "FullPolicy", "H2O", "KVzip", "Locret", "Policy", "PyramidKV",
    "Preset", "ScoredEviction", "ScoringPass", "SnapKV", "StreamingLLM", "TOVA", "make_policy", "register_policy", "register_preset",
    "KeyInt4", "Loki", "OraclePage", "OracleToken", "parse_spec",
    "Compressor", "DecodeEvictor", "DecodeView", "LayerRoles", "PageView", "PromptView", "Selector", "layer_roles",
]
