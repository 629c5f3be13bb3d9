"""KV-cache policies: one small file per method, registered by name."""

from kvjax.policies.base import POLICY_REGISTRY, FullPolicy, Policy, make_policy, register_policy

__all__ = ["POLICY_REGISTRY", "FullPolicy", "Policy", "make_policy", "register_policy"]
