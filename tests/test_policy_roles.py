"""Roles, typed: a policy declares the roles it plays, and each hook sees its own view, with no None field
but the optional ones its policy does not use (docs/design.md, "Policies")."""

import dataclasses
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies import (
    POLICY_REGISTRY, TOVA, AdaKV, DecodeEvictor, DecodeView, LayerRoles, Policy, PromptView, Quest, Selector,
    layer_roles,
)

SEEN = []  # the views the hooks below were traced with


@dataclasses.dataclass(frozen=True)
class SeenTOVA(TOVA):  # a compressor (window 1) and a decode-time evictor
    def compress_layer(self, view, keep_bound):
        SEEN.append(view)
        return super().compress_layer(view, keep_bound)

    def decode_scores(self, view):
        SEEN.append(view)
        return super().decode_scores(view)


@dataclasses.dataclass(frozen=True)
class SeenQuest(Quest):
    def select_pages(self, view):
        SEEN.append(view)
        return super().select_pages(view)


def test_each_hook_sees_its_view_with_no_none_field_it_uses():
    model = kvjax.load_model("tiny")
    policy = kvjax.make_policy("compose", evict=SeenTOVA(token_budget=24),
                               select=SeenQuest(token_budget=32, dense_layers=0))
    prompt = np.random.default_rng(0).integers(5, model.cfg.vocab_size, size=(2, 40))
    SEEN.clear()
    kvjax.generate(model, prompt, max_new_tokens=3, policy=policy, page_size=8)
    none = {}
    for view in SEEN:
        none.setdefault(type(view).__name__, set()).update(f for f in view._fields if getattr(view, f) is None)
        assert set(none[type(view).__name__]) <= set(type(view).OPTIONAL)
    # no pooled budget, no key sketch: the only optional fields this policy leaves None
    assert none == {"PromptView": {"pool_threshold"}, "PageView": {"key_sketch"}, "DecodeView": set()}


def test_a_role_member_without_its_declared_role_is_refused():
    with pytest.raises(TypeError, match="defines select_pages of the Selector role without declaring it"):
        @dataclasses.dataclass(frozen=True)
        class Undeclared(Policy):
            def select_pages(self, view):
                return None

    with pytest.raises(TypeError, match="evicts while decoding but does not compress"):
        class EvictsOnly(Policy, DecodeEvictor):
            def decode_scores(self, view):
                return view.slot_score

    class Declared(Policy, Selector):
        def select_pages(self, view):
            return None

    declared = Declared(dense_layers=1)
    assert declared.selector is declared and declared.compressor is None and declared.evictor is None
    assert [layer_roles(declared, l) for l in (0, 1)] == [LayerRoles(False, False, False), LayerRoles(False, True, False)]


def test_wrappers_name_the_part_playing_each_role():
    h2o, quest = kvjax.make_policy("h2o"), kvjax.make_policy("quest")
    composed = kvjax.make_policy("compose", evict=h2o, select=quest)
    assert (composed.compressor, composed.evictor, composed.selector) == (h2o, h2o, quest)
    assert layer_roles(composed, 0) == LayerRoles(True, False, True)  # Quest's two dense layers
    assert layer_roles(composed, 2) == LayerRoles(True, True, True)
    ada = kvjax.make_policy("ada", scorer="h2o", dense_layers=1)
    assert isinstance(ada.compressor, AdaKV) and ada.evictor is None and ada.selector is None  # Ada allocates once
    assert ada.compressor.accumulates_attention and [layer_roles(ada, l).compress for l in (0, 1)] == [False, True]
    token = kvjax.make_policy("oracle_token")
    assert (token.selector.unit, quest.selector.unit) == ("slot", "page")


def test_the_documented_new_method_plays_its_roles():
    """docs/design.md's "Writing a method" example, run: it registers, declares its roles and keeps what it says."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "design.md").read_text()
    example = re.search(r"### Writing a method\n.*?```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    try:
        exec(compile(example, "docs/design.md", "exec"), namespace)
        policy = kvjax.make_policy("knorm", token_budget=2)
    finally:
        POLICY_REGISTRY.pop("knorm", None)
    assert (policy.compressor, policy.evictor, policy.selector) == (policy, policy, None)
    k = jnp.asarray([[[[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]]])  # [B=1, H=1, S=4, D=2]: norms 5, 1, 2, 7.1
    slots = dict(layer=jnp.int32(0), num_layers=1, lengths=jnp.array([[4]]), next_position=jnp.array([4]), k=k,
                 slot_pos=jnp.arange(4)[None, None], valid=jnp.ones((1, 1, 4), bool), slot_score=jnp.zeros((1, 1, 4)))
    keep, count = policy.compress_layer(PromptView(**slots, final_chunk=jnp.array([True])), 2)
    assert np.asarray(keep).tolist() == [[[1, 2]]] and np.asarray(count).tolist() == [[2]]
    stats = dict(q=jnp.zeros((1, 1, 2)), row_max=jnp.zeros((1, 1)), row_sum=jnp.ones((1, 1)))
    assert int(jnp.argmin(policy.decode_scores(DecodeView(**slots, **stats)))) == 3  # the largest key goes
