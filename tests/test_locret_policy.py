"""The Locret policy: keeps the retaining heads' top slots per chunk, holds the tail, stays O(budget + chunk)."""

import dataclasses

import jax
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cache.compaction import kept_positions, memory_report
from kvjax.util.compile_count import count_compiles
from kvjax.locret import HeadsConfig, export_safetensors, init_heads, save_heads
from kvjax.policies import locret_heads as heads_module
from test_locret_training import dense_capture
from test_state import check_invariants

CHUNK, BUDGET, TAIL, STABLE = 32, 24, 8, 6  # evict budget b = BUDGET - TAIL = 16


@pytest.fixture(scope="module")
def setup(hf_models):
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    heads = init_heads(HeadsConfig.for_model(model.cfg, 32), seed=5)
    return model, heads


def numpy_scores(heads, layer, q_pre, k_pre, v):
    """The retaining head in numpy: SiLU MLP on concat(q_pre, k_pre, v) -> [T, H]."""
    x = np.concatenate([q_pre.reshape(len(q_pre), -1), k_pre.reshape(len(k_pre), -1), v.reshape(len(v), -1)], -1)
    w1, w2 = (np.asarray(heads.layer(layer)[n], np.float64) for n in ("w1", "w2"))
    h = x @ w1
    return (h / (1 + np.exp(-h))) @ w2


def _policy(heads, **options):
    """Per kv head unless `pool` says otherwise (the per-head tests below)."""
    defaults = {"token_budget": BUDGET, "stabilizers": STABLE, "local_tail": TAIL, "heads": heads, "pool": "head"}
    return kvjax.make_policy("locret", **{**defaults, **options})


def _prefill(model, tokens, policy, **kwargs):
    state, logits = kvjax.prefill(model, tokens, policy=policy, chunk_size=CHUNK, page_size=8, max_new_tokens=4, **kwargs)
    check_invariants(state)
    return state, logits


def test_one_chunk_keeps_the_heads_top_and_the_tail(setup):
    model, heads = setup
    T = CHUNK + TAIL  # one (final) chunk, then the tail
    tokens = random_tokens(11, (1, T))
    state, _ = _prefill(model, tokens, _policy(heads))
    kept = kept_positions(state)
    b = BUDGET - TAIL
    for layer, (_, _, q_pre, k_pre, v) in dense_capture(model, tokens[0]).items():
        ref = numpy_scores(heads, layer, q_pre[:CHUNK], k_pre[:CHUNK], v[:CHUNK])  # [CHUNK, H]
        for h in range(model.cfg.num_kv_heads):
            expected = set(np.argsort(-ref[:, h])[:b].tolist()) | set(range(CHUNK, T))
            assert set(kept[layer][0][h].tolist()) == expected


@pytest.mark.parametrize("head_cap", [4, 1])
def test_pooled_budget_keeps_the_top_over_all_layers_and_heads(setup, head_cap):
    model, heads = setup
    T = CHUNK + TAIL  # one (final) chunk, then the tail
    tokens = random_tokens(11, (1, T))
    state, _ = _prefill(model, tokens, _policy(heads, pool="all", head_cap=head_cap))
    kept = kept_positions(state)
    b, H = BUDGET - TAIL, model.cfg.num_kv_heads
    ref = np.stack([numpy_scores(heads, layer, q_pre[:CHUNK], k_pre[:CHUNK], v[:CHUNK])
                    for layer, (_, _, q_pre, k_pre, v) in sorted(dense_capture(model, tokens[0]).items())])  # [L, C, H]
    # a head keeps at most head_cap * b slots, so only its head_cap * b best are candidates of the pool
    candidates = -np.sort(-ref, axis=1)[:, : b * head_cap]  # [L, K, H]
    threshold = np.sort(candidates.ravel())[::-1][b * H * len(ref) - 1]
    counts = []
    for layer in range(len(ref)):
        for h in range(H):
            order = np.argsort(-ref[layer, :, h])
            expected = order[: min((ref[layer, :, h] >= threshold - 1e-5).sum(), b * head_cap)]
            assert set(kept[layer][0][h].tolist()) == set(expected.tolist()) | set(range(CHUNK, T))
            counts.append(len(expected))
    assert max(counts) > b and min(counts) < b if head_cap > 1 else max(counts) == b  # spread unevenly, capped
    assert sum(counts) == b * H * len(ref)  # the pool filled exactly, also where the cap clips heads


def test_stabilizers_survive_non_final_chunks(setup):
    model, heads = setup
    T = 2 * CHUNK + TAIL
    tokens = random_tokens(12, (1, T))
    state, _ = _prefill(model, tokens, _policy(heads))
    kept = kept_positions(state)
    b = BUDGET - TAIL
    for layer, (_, _, q_pre, k_pre, v) in dense_capture(model, tokens[0]).items():
        ref = numpy_scores(heads, layer, q_pre[:CHUNK], k_pre[:CHUNK], v[:CHUNK])
        for h in range(model.cfg.num_kv_heads):
            positions = kept[layer][0][h]
            assert len(positions) == BUDGET and set(range(2 * CHUNK, T)) <= set(positions.tolist())
            # after chunk 1 (not final) the newest STABLE slots were kept whatever their score
            first = set(np.argsort(-ref[: CHUNK - STABLE, h])[: b - STABLE].tolist()) | set(range(CHUNK - STABLE, CHUNK))
            assert set(positions[positions < CHUNK].tolist()) <= first


def test_sinks_are_kept_within_the_budget(setup):
    """`sink_size`: the prompt's first tokens survive every chunk's eviction in every head, inside the budget."""
    model, heads = setup
    tokens = random_tokens(12, (1, 2 * CHUNK + TAIL))
    sinks = set(range(2))
    plain = kept_positions(_prefill(model, tokens, _policy(heads))[0])
    kept = kept_positions(_prefill(model, tokens, _policy(heads, sink_size=2))[0])
    assert all(sinks <= set(h.tolist()) and len(h) == BUDGET for layer in kept for h in layer[0])
    assert not all(sinks <= set(h.tolist()) for layer in plain for h in layer[0])  # the heads alone drop some


@pytest.mark.parametrize("pool", ["head", "all"])
def test_pool_is_sized_by_budget_not_prompt(setup, pool):
    model, heads = setup
    policy = _policy(heads, pool=pool, head_cap=2)
    short, _ = _prefill(model, random_tokens(13, (1, 3 * CHUNK)), policy)
    # a prompt past this tiny model's 256-token context: Locret's memory bound is what is measured here
    long, _ = _prefill(model, random_tokens(14, (1, 16 * CHUNK)), policy, allow_longer_context=True)
    assert long.num_pages == short.num_pages  # the pool does not grow with the prompt
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads
    assert long.num_pages <= L * H * (16 * CHUNK // 8) // 2  # half of what the prompt alone would take
    report = memory_report(long)
    if pool == "head":
        assert report["pages_in_use"] == L * H * (BUDGET // 8)
    else:  # the pooled budget in use, spread unevenly: at most head_cap times a head's share each
        assert report["pages_in_use"] <= L * H * (2 * (BUDGET - TAIL) + TAIL) // 8 + L * H
        kept = [len(p) for layer in kept_positions(long) for p in layer[0]]
        assert sum(kept) == L * H * BUDGET and max(kept) <= 2 * (BUDGET - TAIL) + TAIL  # filled exactly, capped


def test_large_budget_matches_the_full_cache_and_decode_compiles_once(setup):
    model, heads = setup
    tokens = random_tokens(15, (2, 3 * CHUNK))
    _, full_logits = _prefill(model, tokens, kvjax.make_policy("full"))
    big = _policy(heads, token_budget=4 * CHUNK)
    _, logits = _prefill(model, tokens, big)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), atol=1e-5)
    policy = _policy(heads)
    kvjax.generate(model, tokens, max_new_tokens=2, policy=policy, chunk_size=CHUNK, decode_last=2)
    with count_compiles() as compiles:
        kvjax.generate(model, tokens, max_new_tokens=6, policy=policy, chunk_size=CHUNK, decode_last=2)
    assert compiles.of("append_chunk") + compiles.of("append_token") == 0, f"decode recompiled: {compiles}"


def test_ragged_batch_and_dense_layers(setup):
    model, heads = setup
    rows = [random_tokens(16, (1, 2 * CHUNK + TAIL))[0], random_tokens(17, (1, CHUNK // 2))[0]]
    state, _ = _prefill(model, rows, _policy(heads, dense_layers=1))
    kept = kept_positions(state)
    alone = kept_positions(_prefill(model, rows[0][None], _policy(heads, dense_layers=1))[0])
    for h in range(model.cfg.num_kv_heads):
        assert kept[0][0][h].tolist() == list(range(len(rows[0])))  # the dense layer holds everything
        assert len(kept[1][0][h]) == BUDGET
        assert kept[1][1][h].tolist() == list(range(len(rows[1])))  # a short row fits whole
        assert kept[1][0][h].tolist() == alone[1][0][h].tolist()  # rows do not affect each other


def test_heads_from_paths_and_hashing(setup, tmp_path):
    model, heads = setup
    save_heads(tmp_path / "heads", heads)
    export_safetensors(heads, tmp_path / "heads.safetensors")
    for path in (str(tmp_path / "heads"), str(tmp_path / "heads.safetensors")):
        policy = _policy(path)
        assert policy == _policy(path) and hash(policy) == hash(_policy(path))  # one compile per path
        assert policy.heads.config == heads.config
        for layer in range(model.cfg.num_layers):
            for name in ("w1", "w2"):
                np.testing.assert_array_equal(np.asarray(policy.heads.layer(layer)[name]), np.asarray(heads.layer(layer)[name]))
    assert _policy(heads.params) == _policy(heads.params)
    # the heads are data, not identity: policies differing only in them share compiled steps, and each
    # still scores with its own heads (they reach the step as an argument)
    other = _policy(init_heads(heads.config, seed=6))
    assert _policy(heads) == other and hash(_policy(heads)) == hash(other)
    tokens = random_tokens(11, (1, CHUNK + TAIL))
    mine = kept_positions(_prefill(model, tokens, _policy(heads))[0])
    with count_compiles() as compiles:
        theirs = kept_positions(_prefill(model, tokens, other)[0])
    assert compiles.total == 0, compiles
    assert any(a.tolist() != b.tolist() for la, lb in zip(mine, theirs) for a, b in zip(la[0], lb[0]))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"token_budget": 8, "local_tail": 8}, "must exceed local_tail"),
        ({"stabilizers": BUDGET - TAIL}, "stabilizers must be in"),
        ({"local_tail": -1}, "local_tail must be >= 0"),
        ({"sink_size": BUDGET - TAIL - STABLE}, "sink_size must be in"),
    ],
)
def test_bad_options_name_the_field(setup, options, message):
    model, heads = setup
    with pytest.raises(ValueError, match=message):
        kvjax.generate(model, random_tokens(0, (1, 40)), max_new_tokens=1, policy=_policy(heads, **options))


def test_heads_must_fit_the_model(setup):
    model, _ = setup
    with pytest.raises(ValueError, match="heads= is required"):
        kvjax.make_policy("locret")
    wrong = init_heads(HeadsConfig(2, 4, 2, 8, 16))
    with pytest.raises(ValueError, match="input features"):
        kvjax.generate(model, random_tokens(0, (1, 40)), max_new_tokens=1, policy=_policy(wrong))


def test_heads_by_model_name(setup, tmp_path, monkeypatch):
    """heads="NAME" loads kvjax/assets/locret-heads/NAME.safetensors (bfloat16); a name with no shipped heads
    says how to train them."""
    model, heads = setup
    monkeypatch.setattr(heads_module, "shipped_heads_path", lambda name: str(tmp_path / f"{name}.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"shipped: none.*kvjax train locret --model my-model "):
        _policy("my-model")
    export_safetensors(heads, tmp_path / "my-model.safetensors", "bfloat16")
    assert heads_module.shipped_heads() == ["my-model"]
    policy = _policy("my-model")
    assert policy.heads.config == heads.config
    for layer in range(model.cfg.num_layers):
        for name in ("w1", "w2"):
            np.testing.assert_array_equal(np.asarray(policy.heads.layer(layer)[name]),
                                          np.asarray(heads.layer(layer)[name].astype("bfloat16")))
    _prefill(model, random_tokens(11, (1, CHUNK + TAIL)), policy)  # bfloat16 heads score a float32 model
    with pytest.raises(FileNotFoundError, match=r"do not exist .*ship for: my-model; `kvjax train locret`"):
        _policy(str(tmp_path / "elsewhere" / "heads.safetensors"))  # a path, not a name


def test_shipped_tiny_heads_load_by_name():
    model = kvjax.load_model("tiny")
    assert "tiny" in heads_module.shipped_heads()
    policy = kvjax.make_policy("locret", heads="tiny", token_budget=48, stabilizers=8, local_tail=8)
    policy.heads.config.check_model(model.cfg)
    assert all(w.dtype == "bfloat16" for w in jax.tree_util.tree_leaves(policy.heads.params))
    tokens = np.asarray(model.tokenizer(" ".join(["the sky is blue ."] * 40))["input_ids"], np.int32)[None]
    state, _ = kvjax.prefill(model, tokens, policy=policy, chunk_size=64, max_new_tokens=2)
    assert {len(p) for layer in kept_positions(state) for p in layer[0]} == {48}
    state, _ = kvjax.prefill(model, tokens, policy=dataclasses.replace(policy, pool="all"), chunk_size=64,
                             max_new_tokens=2)
    kept = [len(p) for layer in kept_positions(state) for p in layer[0]]  # the budget pooled over layers and heads
    assert sum(kept) == 48 * len(kept) and max(kept) <= 4 * 40 + 8


def test_shipped_smollm2_heads_load_by_name_and_fit_the_size_limit():
    import os

    path = heads_module.shipped_heads_path("smollm2-135m")
    assert os.path.getsize(path) <= 10 * 1000 * 1000, "the shipped heads must stay under 10 MB"
    assert "smollm2-135m" in heads_module.shipped_heads()
    policy = kvjax.make_policy("locret", heads="smollm2-135m", token_budget=256, stabilizers=64, local_tail=64)
    config = policy.heads.config
    # SmolLM2-135M's shape (the registry's model; its config is checked against the real file in test_real_model)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.hidden_size == 128
    assert all(w.dtype == "bfloat16" for w in jax.tree_util.tree_leaves(policy.heads.params))
    # these heads bring the options they were made for (pool="all", 4 sinks); what the caller sets wins
    assert (policy.pool, policy.sink_size) == ("all", 4)
    by_path = kvjax.make_policy("locret", heads=path, pool="head", token_budget=256)
    assert (by_path.pool, by_path.sink_size) == ("head", 4) and by_path.heads is policy.heads
    tiny = kvjax.make_policy("locret", heads="tiny")
    assert (tiny.pool, tiny.sink_size) == ("head", 0)
