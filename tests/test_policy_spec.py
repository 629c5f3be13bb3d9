"""One policy-spec grammar (`kvjax.policies.parse_spec`) for the command line, the server and eval."""

import pytest

import kvjax
from kvjax.policies import Compose, Quest, SnapKV, parse_spec
from kvjax.serving.http import APIError, build_policy


def test_a_name_options_and_extra_options():
    assert parse_spec("quest:token_budget=64,dense_layers=1") == Quest(token_budget=64, dense_layers=1)
    assert parse_spec("quest", options=["token_budget=64"]) == Quest(token_budget=64)
    assert parse_spec({"name": "snapkv", "token_budget": 96}) == SnapKV(token_budget=96)
    assert parse_spec(None) == kvjax.make_policy("full")


def test_composition_and_defaults():
    policy = parse_spec("snapkv+quest:token_budget=32", defaults={"token_budget": 128, "dense_layers": 2})
    assert isinstance(policy, Compose)
    assert policy.evict == SnapKV(token_budget=128, dense_layers=2)
    assert policy.select == Quest(token_budget=32, dense_layers=2)
    assert parse_spec("full", defaults={"token_budget": 128}) == kvjax.make_policy("full")


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown policy 'nope'"),
    ("snapkv:nonsense=1", "no option"),
    ("quest:token_budget=many", "token_budget='many': expected int"),
    ("snapkv+quest+h2o", "two parts"),
    ("quest:page_size=32", "does not match the cache's page_size=16"),
    ({"token_budget": 3}, 'needs "name"'),
])
def test_refusals_name_the_bad_part(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_options_beside_a_composition_are_refused():
    with pytest.raises(ValueError, match="inside the spec"):
        parse_spec("snapkv+quest", options=["token_budget=64"])


def test_the_server_validates_with_its_own_page_size():
    default = kvjax.make_policy("full")
    assert build_policy("quest:page_size=32,token_budget=64", default, page_size=32) == Quest(token_budget=64, page_size=32)
    with pytest.raises(APIError, match="kv_policy: quest: page_size=32 does not match the cache's page_size=16"):
        build_policy("quest:page_size=32,token_budget=64", default, page_size=16)
    composed = build_policy("snapkv:token_budget=64+quest:token_budget=64", default, page_size=16)
    assert isinstance(composed, Compose)  # the server takes compositions too
