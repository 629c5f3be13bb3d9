"""`kvjax.decode_step` inside a user's own jitted loop: it traces under `jax.jit` and `lax.scan`, leaves the
capacity flag in the state, and gives `generate`'s greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model, init_params
from kvjax.cache.state import CacheCapacityError, overflow_error

CFG = ModelConfig(
    model_type="llama", max_position_embeddings=4096, vocab_size=512, hidden_size=96, intermediate_size=160,
    num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
)
PROMPT = (np.arange(2 * 40).reshape(2, 40) * 7 % 500).astype(np.int32)


@pytest.fixture(scope="module")
def model():
    return Model(CFG, init_params(CFG, seed=0, std=0.08))


def greedy_loop(model, policy, new_tokens):
    """The loop a user writes: prefill, then a jitted `lax.scan` of decode steps with argmax sampling."""

    @jax.jit
    def decode(state, token):
        def body(carry, _):
            state, token = carry
            logits, state = kvjax.decode_step(model, state, token, policy)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (state, token), token

        (state, _), tokens = jax.lax.scan(body, (state, token), None, length=new_tokens - 1)
        return state, tokens.T

    return decode


@pytest.mark.parametrize("name", ["full", "quest", "loki", "key_int4"])
def test_a_jitted_user_loop_gives_generates_tokens(model, name):
    """Every selector selects in layer 2 (1 page of 16 besides the current one); loki and key_int4 carry the
    prefill's key sketch through the loop and write each decoded token's row."""
    policy = None if name == "full" else kvjax.make_policy(name, token_budget=32, page_size=16)
    expected = kvjax.generate(model, PROMPT, 6, policy)
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=6)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    state, tokens = greedy_loop(model, policy, 6)(state, first)
    assert int(state.overflow[0]) == 0  # the capacity flag, left in the state for the caller
    np.testing.assert_array_equal(np.concatenate([np.asarray(first)[:, None], np.asarray(tokens)], axis=1), expected)
    if name in ("loki", "key_int4"):  # the loop wrote each decoded token's sketch row from its key
        assert_sketch_rows_follow_keys(policy, state, layer=2, slots=slice(40, 45))


def assert_sketch_rows_follow_keys(policy, state, layer, slots):
    """The state's sketch rows at logical `slots` of `layer` equal the selector's sketch of the pool's keys there."""
    from kvjax.cache.state import gather_layer
    from kvjax.pallas_kernels import page_values
    from kvjax.pallas_kernels.sketch_scores import unpack_int4

    keys = gather_layer(state, layer)[0][:, :, slots]  # [B, H, n, D]
    expected = policy.codes(jax.tree.map(lambda x: x[layer], state.key_sketch.params), keys.astype(jnp.float32))
    table = jnp.clip(state.page_table[layer], 0, None)
    B, H, P = table.shape
    rows = state.key_sketch.codes[table].reshape(B, H, P * state.page_size, -1)[:, :, slots]
    decode = (lambda x: np.concatenate([np.asarray(a) for a in unpack_int4(x)], -1)) if policy.codes_kind == "int4" \
        else (lambda x: np.asarray(page_values(x), np.float32))
    np.testing.assert_allclose(decode(rows), decode(expected), rtol=1e-2, atol=1e-2)


def test_the_capacity_flag_stays_in_the_state(model):
    state, logits = kvjax.prefill(model, PROMPT, capacity=48)  # 40 tokens in, room for 8 more
    state, _ = greedy_loop(model, None, 12)(state, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    assert int(state.overflow[0]) != 0
    assert isinstance(overflow_error(state), CacheCapacityError)


def _evicting_policy(name: str):
    if name == "locret":
        from kvjax.locret import HeadsConfig, init_heads

        heads = init_heads(HeadsConfig.for_model(CFG, hidden_size=16), seed=1)
        return kvjax.make_policy("locret", token_budget=32, stabilizers=4, local_tail=8, heads=heads)
    return kvjax.make_policy(name, **({} if name == "full" else {"token_budget": 32}))


@pytest.mark.parametrize("name, kv_dtype", [
    pytest.param("h2o", "int8", id="h2o-int8"),  # the quick suite's representative; the others are heavy
    *(pytest.param(name, kv_dtype, id=f"{name}-{kv_dtype or 'float32'}", marks=pytest.mark.heavy)
      for name, kv_dtype in [("h2o", None), ("tova", None), ("streaming", None), ("locret", None), ("full", "int8")]),
])
def test_a_jitted_user_loop_that_evicts_while_decoding(model, name, kv_dtype):
    """Policies that evict while decoding (H2O, TOVA, StreamingLLM; Locret scores each new token with its
    heads), and int8 pages, inside the user's jitted `lax.scan`: generate's greedy tokens, and every head at
    its budget after the loop."""
    model = model.with_kv_dtype(kv_dtype) if kv_dtype else model
    policy = _evicting_policy(name)
    expected = kvjax.generate(model, PROMPT, 6, policy)
    state, logits = kvjax.prefill(model, PROMPT, policy, max_new_tokens=6)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    state, tokens = greedy_loop(model, policy, 6)(state, first)
    assert int(state.overflow[0]) == 0
    np.testing.assert_array_equal(np.concatenate([np.asarray(first)[:, None], np.asarray(tokens)], axis=1), expected)
    if policy.evicts_while_decoding:
        held = np.asarray(state.lengths) - (np.asarray(state.hole) >= 0)
        budget = policy.evictor.decode_budget
        assert (held <= budget).all() and (held == budget).any(), held
