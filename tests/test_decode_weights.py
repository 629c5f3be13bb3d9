"""The weights are held once and read in place: `Model` holds per-layer trees only, and the compiled
prefill step, decode step and decode loop copy no weight.

A scan over stacked layer parameters slices every weight out of the stack on every token, and XLA:CPU
materialises each slice (a `dynamic-slice` fusion feeding the matmul). `Model` takes the layers apart at
load and the steps pick each layer's arrays with a `lax.switch`, so the compiled programs hold no
instruction producing a weight-shaped array. The check itself is shown to see the scanned step's copies.
The per-layer form gives the stacked form's logits and tokens.
"""

import gc


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models.config import ModelConfig
from kvjax.engine.decode_loop import decode_steps
from kvjax.engine.api import policy_or_full
from kvjax.models.loading import Model, init_params
from kvjax.models import is_unstacked, stack_layers, unstack_layers
from kvjax.models.weight_copies import weight_copies, weight_shapes
from kvjax.engine.decode import append_token
from kvjax.engine.step import append_chunk

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


def decode_hlo(model, params, policy, chunk: int = 1) -> str:
    """The compiled decode step (`chunk` 0) or prefill chunk of `chunk` tokens."""
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    if chunk == 0:
        lowered = append_token.lower(params, state, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), logits,
                                     cfg=CFG, dtype=jnp.float32, policy=policy)
    else:
        lowered = append_chunk.lower(params, state, None, jnp.zeros((1, chunk), jnp.int32), jnp.ones((1,), jnp.int32),
                                     logits, None, cfg=CFG, dtype=jnp.float32, policy=policy)
    return lowered.compile().as_text()


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_steps_copy_no_weight(model, name, chunk):
    shapes = weight_shapes(model.params)
    assert is_unstacked(model.params["layers"]) and (96, 160) in shapes
    assert weight_copies(decode_hlo(model, model.params, policy_for(name), chunk), shapes) == []


def test_the_check_sees_the_scanned_steps_copies(model):
    """The stacked parameters, scanned: each weight matrix is sliced out (copied) every step."""
    stacked = stack_layers(model.params)
    copies = weight_copies(decode_hlo(model, stacked, policy_for("full"), chunk=0), weight_shapes(stacked))
    assert len(copies) >= len(weight_shapes(stacked))
    assert all("dynamic-slice" in line for line in copies)


def weight_arrays(shapes: set, num_layers: int) -> list:
    """Live device arrays shaped as one layer's weight matrix, or as a stack of them (`[L, ...]`)."""
    gc.collect()
    stacked = {(num_layers,) + s for s in shapes}
    return [x for x in jax.live_arrays() if tuple(x.shape) in shapes | stacked]


def test_a_model_holds_its_weights_once_after_prefill_and_decode(model):
    shapes = {(96, 160), (160, 96)}  # gate/up and down: no activation, cache or other fixture has them
    held = weight_arrays(shapes, CFG.num_layers)
    assert len(held) == 3 * CFG.num_layers and all(x.ndim == 2 for x in held)
    policy = policy_for("quest")
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    logits, state = kvjax.decode_step(model, state, [3], policy)
    kvjax.generate(model, PROMPT, 4, policy)
    after = weight_arrays(shapes, CFG.num_layers)
    assert len(after) == len(held), [x.shape for x in after]
    assert sum(x.nbytes for x in after) == sum(x.nbytes for x in held)


def test_decode_loop_copies_no_weight(model):
    policy = policy_for("quest")
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
    lowered = decode_steps.lower(
        model.params, state, logits, jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0),
        jnp.zeros((1,), bool), jnp.zeros((1,), jnp.int32), jnp.int32(4), step=append_token, steps=4, cfg=CFG,
        dtype=jnp.float32, policy=policy, temperature=0.0, top_k=0, top_p=1.0,
    )
    assert weight_copies(lowered.compile().as_text(), weight_shapes(model.params)) == []


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_per_layer_decode_equals_stacked(model, name):
    policy = policy_for(name)
    results = []
    for params in (stack_layers(model.params), model.params):
        state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=8)
        steps = []
        for token in (3, 11, 5):
            state, logits = append_token(params, state, jnp.full((1,), token, jnp.int32), jnp.ones((1,), jnp.int32),
                                         logits, cfg=CFG, dtype=jnp.float32, policy=policy)
            steps.append(np.asarray(logits))
        results.append(np.stack(steps))
    np.testing.assert_allclose(results[1], results[0], rtol=2e-5, atol=2e-5)


def test_a_stacked_tree_is_taken_apart_at_load(model):
    stacked = stack_layers(model.params)
    loaded = Model(CFG, stacked)
    assert is_unstacked(loaded.params["layers"]) and len(loaded.params["layers"]) == CFG.num_layers
    np.testing.assert_array_equal(
        loaded.params["layers"][2]["mlp"]["up_proj"]["kernel"], stacked["layers"]["mlp"]["up_proj"]["kernel"][2]
    )
    assert unstack_layers(loaded.params) is loaded.params


def test_per_layer_parameters_must_match_the_depth(model):
    params = {**model.params, "layers": model.params["layers"][:3]}
    with pytest.raises(ValueError, match="3 layers, the config has 4"):
        kvjax.forward_logits(Model(CFG, params), PROMPT[:, :8])
