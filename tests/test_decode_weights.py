"""Decode reads each weight matrix in place: the compiled decode step and decode loop copy no weight.

A scan over stacked layer parameters slices every weight out of the stack on every token, and XLA:CPU
materialises each slice (a `dynamic-slice` fusion feeding the matmul). `Model.decode_params` takes the
layers apart once and the step picks each layer's arrays with a `lax.switch`, so the compiled program holds
no instruction producing a weight-shaped array. The check itself is shown to see the scanned step's copies.
The per-layer form gives the stacked form's logits and tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models.config import ModelConfig
from kvjax.engine.decode_loop import decode_steps
from kvjax.engine.generation import policy_or_full
from kvjax.models.loading import Model, init_params
from kvjax.models import is_unstacked, unstack_layers
from kvjax.models.weight_copies import weight_copies, weight_shapes
from kvjax.engine.step import append_step

# shapes no activation or cache array of a decode step takes: every [96, x] / [160, 96] array is a weight
CFG = ModelConfig(
    model_type="llama", max_position_embeddings=4096, vocab_size=512, hidden_size=96, intermediate_size=160,
    num_layers=4, num_heads=6, num_kv_heads=2, head_dim=16,
)
PROMPT = (np.arange(70)[None] * 7 % 500).astype(np.int32)
POLICIES = {
    "full": None,
    "quest": dict(token_budget=32, page_size=16),  # selects pages; dense layers 0-1: two segments
    "h2o": dict(token_budget=48),  # evicts while decoding
}


@pytest.fixture(scope="module")
def model():
    return Model(CFG, init_params(CFG, seed=0, std=0.08))


def policy_for(name):
    return policy_or_full(None if POLICIES[name] is None else kvjax.make_policy(name, **POLICIES[name]))


def decode_hlo(model, params, policy) -> str:
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    lowered = append_step.lower(
        params, state, None, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), logits, None, cfg=CFG,
        dtype=jnp.float32, policy=policy,
    )
    return lowered.compile().as_text()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decode_step_copies_no_weight(model, name):
    shapes = weight_shapes(model.params)
    assert shapes == weight_shapes(model.decode_params) and (96, 160) in shapes
    assert weight_copies(decode_hlo(model, model.decode_params, policy_for(name)), shapes) == []


def test_the_check_sees_the_scanned_steps_copies(model):
    """The stacked parameters, scanned: each weight matrix is sliced out (copied) every step."""
    copies = weight_copies(decode_hlo(model, model.params, policy_for("full")), weight_shapes(model.params))
    assert len(copies) >= len(weight_shapes(model.params))
    assert all("dynamic-slice" in line for line in copies)


def test_decode_loop_copies_no_weight(model):
    policy = policy_for("quest")
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    lowered = decode_steps.lower(
        model.decode_params, state, logits, jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0),
        jnp.zeros((1,), bool), jnp.zeros((1,), jnp.int32), jnp.int32(4), step=append_step, steps=4, cfg=CFG,
        dtype=jnp.float32, policy=policy, temperature=0.0, top_k=0, top_p=1.0,
    )
    assert weight_copies(lowered.compile().as_text(), weight_shapes(model.params)) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_per_layer_decode_equals_stacked(model, name):
    policy = policy_for(name)
    results = []
    for params in (model.params, model.decode_params):
        state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
        steps = []
        for token in (3, 11, 5):
            state, _, logits = append_step(
                params, state, None, jnp.full((1, 1), token, jnp.int32), jnp.ones((1,), jnp.int32), logits, None,
                cfg=CFG, dtype=jnp.float32, policy=policy,
            )
            steps.append(np.asarray(logits))
        results.append(np.stack(steps))
    np.testing.assert_allclose(results[1], results[0], rtol=2e-5, atol=2e-5)


def test_decode_params_made_once_per_parameter_tree(model):
    first = model.decode_params
    assert model.decode_params is first and is_unstacked(first["layers"]) and len(first["layers"]) == CFG.num_layers
    np.testing.assert_array_equal(
        first["layers"][2]["mlp"]["up_proj"]["kernel"], model.params["layers"]["mlp"]["up_proj"]["kernel"][2]
    )
    other = Model(CFG, init_params(CFG, seed=1, std=0.08))
    assert other.decode_params is not first
    replaced = Model(CFG, model.params)
    replaced.params = other.params  # a new tree: the decode form follows it
    np.testing.assert_array_equal(
        replaced.decode_params["layers"][0]["self_attn"]["q_proj"]["kernel"],
        other.params["layers"]["self_attn"]["q_proj"]["kernel"][0],
    )
    assert unstack_layers(first) is first


def test_per_layer_parameters_must_match_the_depth(model):
    params = {**model.decode_params, "layers": model.decode_params["layers"][:3]}
    with pytest.raises(ValueError, match="3 layers, the config has 4"):
        kvjax.forward_logits(Model(CFG, params), PROMPT[:, :8])
