"""The batch engine on Jenga's pool (`kvjax.jenga.row_pool`): a tiny random Gemma-3-like model (five layers with
a sliding window of 8 tokens to one global) served with prefix caching aligned across its layer groups. A
shared-prefix request hits the pool (global layers share the whole prefix, window layers hold their own
window), decodes the greedy tokens it decodes alone, and every page goes back to the pool."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.jenga.row_pool import FULL, layer_groups
from kvjax.models.config import ModelConfig
from kvjax.models.loading import Model, init_params
from kvjax.serving.batch_engine import BatchEngine

VOCAB, WINDOW, PAGE, CHUNK, CAPACITY = 97, 8, 8, 16, 96
GEMMA3 = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
              query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
              rms_norm_eps=1e-6, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


@pytest.fixture(scope="module")
def gemma() -> Model:
    cfg = ModelConfig.from_hf_dict(GEMMA3)
    assert cfg.windows == (WINDOW,) * 5 + (0,)
    return Model(cfg, init_params(cfg, seed=3, std=0.1))


def _prompts(prefix_tokens: int, suffixes: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, size=prefix_tokens).tolist()
    return [prefix + rng.integers(0, VOCAB, size=n).tolist() for n in suffixes]


def _serve(model, rows, max_new, policy=None, **engine_options):
    """Serve `rows` together; returns (engine, tokens per row, every batch pool the engine used)."""
    engine = BatchEngine(model, capacity=CAPACITY, page_size=PAGE, chunk_size=CHUNK, steps_per_dispatch=4,
                         **{"max_rows": 2, "prefix_cache_bytes": 0, **engine_options})
    ids = [engine.submit(row, max_new, policy, eos_token_id=-1) for row in rows]
    pools = {}
    while engine.has_work:
        engine.step()
        pools.update({id(b.pool): b.pool for b in engine.batches.values()})
    return engine, [engine.requests[i].tokens for i in ids], list(pools.values())


def _alone(model, row, max_new, policy=None):
    return kvjax.generate(model, [row], max_new, policy, page_size=PAGE, capacity=CAPACITY, chunk_size=CHUNK,
                          eos_token_id=-1)[0].tolist()


def _all_pages_back(pool) -> None:
    """No page is held for a request; evicting the cached prefixes frees every large page."""
    pool.allocator.check_invariants()
    assert pool.live_pages() == 0 and not pool.allocator.request_ids
    pool.allocator.reset_prefix_cache()
    assert pool.allocator.num_free_large_pages() == pool.allocator.layout.num_large_pages


def test_groups_of_a_hybrid_model_share_large_pages(gemma):
    """Global layers, window layers and each compressed (layer, head) get groups of their own sizes."""
    specs, members = layer_groups(gemma.cfg, kvjax.make_policy("full"), 2, PAGE, "float32")
    assert [s.name for s in specs] == [FULL, f"window{WINDOW}"]
    assert [len(m) for m in members] == [1 * 2, 5 * 2] and specs[1].page_bytes == 5 * specs[0].page_bytes
    snapkv = kvjax.make_policy("snapkv", token_budget=16, window=4)
    specs, members = layer_groups(gemma.cfg, snapkv, 2, PAGE, "float32")
    assert [s.name for s in specs] == [f"window{WINDOW}", "layer5.head0", "layer5.head1"]
    specs, members = layer_groups(gemma.cfg, snapkv, 2, PAGE, "float32", uniform=True)  # paging before Jenga
    assert [s.name for s in specs] == [FULL] and len(members[0]) == 6 * 2


@pytest.mark.parametrize("max_rows", [2, 1])
def test_a_hybrid_shared_prefix_hits_the_pool_and_decodes_as_alone(gemma, max_rows):
    """Two rows live together (2) or one after the other (1: the second finds the first's blocks cached, not
    live): the second request shares the prefix's whole chunks in the global layer, copies nothing there,
    holds its own window in the window layers, and decodes the greedy tokens it decodes alone."""
    rows = _prompts(3 * CHUNK, [5, 11])
    engine, tokens, pools = _serve(gemma, rows, 10, max_rows=max_rows)
    for row, got in zip(rows, tokens):
        assert got == _alone(gemma, row, 10)
    heads = gemma.cfg.num_kv_heads
    assert engine.shared_pages == 3 * CHUNK // PAGE * 1 * heads  # one global layer, its whole prefix
    assert engine.leaked_pages == 0 and len(pools) == 1
    _all_pages_back(pools[0])


def test_window_pages_are_a_rows_own_and_stop_growing(gemma):
    """While both rows decode past the window, their window pages are distinct and each (layer, head) holds
    one window's pages; the global layer's prefix pages are the same physical pages in both rows."""
    rows = _prompts(2 * CHUNK, [3, 6], seed=1)
    engine = BatchEngine(gemma, max_rows=2, capacity=CAPACITY, page_size=PAGE, chunk_size=CHUNK,
                         steps_per_dispatch=4, prefix_cache_bytes=0)
    for row in rows:
        engine.submit(row, 12, eos_token_id=-1)
    seen = 0
    while engine.has_work:
        engine.step()
        for batch in engine.batches.values():
            if all(r is not None for r in batch.rows):
                table = np.asarray(batch.state.page_table)  # [L, R, H, P]
                window = table[:5]
                assert ((window >= 0).sum(-1) <= -(-WINDOW // PAGE)).all()
                assert not set(window[:, 0][window[:, 0] >= 0]) & set(window[:, 1][window[:, 1] >= 0])
                shared = 2 * CHUNK // PAGE
                np.testing.assert_array_equal(table[5, 0, :, :shared], table[5, 1, :, :shared])
                stats, pool = batch.pool.allocator.stats(), batch.pool  # the fast count agrees with the walk
                assert pool.live_pages() == sum(g.live_pages * len(m) for g, m in zip(stats.groups, pool.members)) > 0
                seen += 1
    assert seen and engine.leaked_pages == 0


def test_a_compressing_policy_shares_nothing_on_a_hybrid_model(gemma):
    policy = kvjax.make_policy("snapkv", token_budget=16, window=4)
    rows = _prompts(3 * CHUNK, [5, 11], seed=2)
    engine, tokens, pools = _serve(gemma, rows, 6, policy)
    for row, got in zip(rows, tokens):
        assert got == _alone(gemma, row, 6, policy)
    assert engine.shared_pages == 0 and engine.leaked_pages == 0
    _all_pages_back(pools[0])


def test_a_row_joins_only_when_the_pool_holds_it_to_its_end(gemma):
    """A pool of five large pages holds two rows' prompts but not their last tokens: the second request waits
    for the first to finish instead of running the pool out of pages mid-decode."""
    rows = _prompts(0, [53, 53], seed=3)
    engine, tokens, pools = _serve(gemma, rows, 10, pool_pages=50)
    assert pools[0].num_pages == 50 and pools[0].large_pages == 10
    for row, got in zip(rows, tokens):
        assert got == _alone(gemma, row, 10)
    assert engine.leaked_pages == 0


@pytest.mark.heavy
def test_counted_admission_is_the_engines(gemma):
    """`eval/bench_jenga_engine.py` counts Gemma-3 270M's rows at 2K-16K without running it (`serve_counted`:
    the engine's admission and placement, each row's slots from its length). On one trace its rows live at
    each dispatch, pages per row, KV waste and prefix hits are the engine's, for Jenga's and uniform pages."""
    from kvjax.eval.bench_jenga_engine import fixed_pool_pages, serve, serve_counted, traffic

    for kind, uniform in (("shared", False), ("shared", True), ("unique", False)):
        prompts = traffic(kind, 4 * CHUNK, 10, VOCAB, chunk=CHUNK)  # shared: the first 3 chunks
        settings = dict(new_tokens=12, pool_pages=fixed_pool_pages(gemma.cfg, 4 * CHUNK, 12, 1, PAGE), max_rows=8,
                        uniform=uniform, chunk=CHUNK, steps=4, page_size=PAGE)
        served = serve(gemma, prompts, **settings)
        for timed_only in ("tokens", "wall_s", "tokens_per_s"):  # the counted run neither decodes nor times
            served.pop(timed_only)
        assert served["max_live_rows"] >= (1 if uniform else 3) and served["leaked_pages"] == 0
        assert serve_counted(gemma.cfg, prompts, **settings) == served, (kind, uniform)
