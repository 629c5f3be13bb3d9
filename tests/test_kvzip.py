"""KVzip (`kvjax.policies.kvzip`, `kvjax.engine.reconstruction`): the reconstruction scores against a dense
numpy computation, the budget pooled over layers and heads, per layer or per head with the sinks kept, and
kvpress's `KVzipPress` keeping the same positions (where the kvpress venv exists)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.compaction import kept_positions
from kvjax.engine.api import dense_forward
from kvjax.engine.reconstruction import instruction_ids, repeat_feeds
from kvjax.engine.decode import prompt_view
from kvjax.eval.lib.crosscheck import VENV

PYTHON = os.environ.get("KVPRESS_PYTHON", os.path.join(os.path.dirname(__file__), "..", VENV, "bin", "python"))
ROWS = [np.random.default_rng(0).integers(3, 120, 90).tolist(), np.random.default_rng(1).integers(3, 120, 61).tolist()]


@pytest.fixture(scope="module")
def tiny():
    return kvjax.load_model("tiny")  # a tokenizer: the repeat instruction is real text


def _raw_scores(model, state):
    """f32[L, H, T] of row 0: each prompt position's slot_score."""
    L = model.cfg.num_layers
    out = []
    for layer in range(L):
        view = prompt_view(state, layer, L, state.next_position)
        pos, score, valid = (np.asarray(x)[0] for x in (view.slot_pos, view.slot_score, view.valid))
        per = np.full((score.shape[0], int(np.asarray(state.next_position)[0])), np.nan)
        for h in range(score.shape[0]):
            per[h, pos[h][valid[h]]] = score[h][valid[h]]
        out.append(per)
    return np.stack(out)


def test_scores_are_the_repetitions_largest_attention(tiny):
    """With a budget that keeps every slot, each slot's score is the largest causal softmax attention a fed
    token (instruction, turn end, the prompt again) gives it, from the dense forward over prompt + fed."""
    row = ROWS[0]
    policy = kvjax.make_policy("kvzip", token_budget=len(row), sink_size=4)
    state, _ = kvjax.prefill(tiny, [row], policy, max_new_tokens=4)
    got = _raw_scores(tiny, state)
    assert int(np.asarray(state.next_position)[0]) == len(row)  # the fed tokens are gone

    (_, _, fed), = repeat_feeds([np.asarray(row)], policy.scoring_pass, instruction_ids(tiny.tokenizer, policy.scoring_pass))[0]
    assert fed[-len(row):] == row and len(fed) > len(row)  # instruction and turn end, then the prompt
    tokens = jnp.asarray([row + fed], jnp.int32)
    L, Hq, H, D = tiny.cfg.num_layers, tiny.cfg.num_heads, tiny.cfg.num_kv_heads, tiny.cfg.head_dim
    _, (qs, ks) = dense_forward(tiny.params, tokens, tiny.cfg, tiny.dtype,
                                observe=lambda l, x, c: (c[0].at[l].set(x.q), c[1].at[l].set(x.k)),
                                observed=(jnp.zeros((L, 1, tokens.shape[1], Hq, D)), jnp.zeros((L, 1, tokens.shape[1], H, D))))
    n, T = len(row), tokens.shape[1]
    for layer in range(L):
        q = np.asarray(qs[layer, 0], np.float64)[n:]  # [F, Hq, D] fed queries
        k = np.asarray(ks[layer, 0], np.float64)  # [T, H, D]
        for h in range(H):
            logits = np.einsum("fgd,td->gft", q[:, h * (Hq // H) : (h + 1) * (Hq // H)], k[:, h]) / np.sqrt(D)
            logits = np.where(np.arange(T)[None, None, :] <= np.arange(n, T)[None, :, None], logits, -np.inf)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            want = (probs / probs.sum(-1, keepdims=True)).max(axis=(0, 1))[:n]
            np.testing.assert_allclose(got[layer, h, 4:], want[4:], rtol=2e-4, atol=1e-6)
            assert np.all(np.isposinf(got[layer, h, :4]))  # the sinks


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["all", "layer", "head"])
def test_budget_pooled_over_all_layers_one_layer_or_one_head(tiny, pool):
    budget, sinks = 12, 4
    policy = kvjax.make_policy("kvzip", token_budget=budget, pool=pool, chunk=40, sink_size=sinks)  # 3 and 2 passes
    state, _ = kvjax.prefill(tiny, ROWS, policy, max_new_tokens=4)
    kept = kept_positions(state)  # [L][B][H] -> positions
    L, H = tiny.cfg.num_layers, tiny.cfg.num_kv_heads
    counts = np.array([[[len(kept[l][b][h]) for h in range(H)] for b in range(2)] for l in range(L)])
    assert list(np.asarray(state.next_position)) == [len(r) for r in ROWS]
    if pool == "all":
        assert list(counts.sum(axis=(0, 2))) == [budget * H * L] * 2
        assert len(set(counts.sum(axis=2).ravel())) > 1  # layers keep different counts
    elif pool == "layer":
        assert np.all(counts.sum(axis=2) == budget * H)
    else:
        assert np.all(counts == budget)
    for l in range(L):
        for b in range(2):
            for h in range(H):
                assert set(range(sinks)) <= set(kept[l][b][h].tolist()), (l, b, h)
                assert np.all(kept[l][b][h] < len(ROWS[b]))


def test_options_and_shared_prefill_refusal(tiny):
    with pytest.raises(ValueError, match="pool"):
        kvjax.prefill(tiny, ROWS, kvjax.make_policy("kvzip", pool="rows"))
    with pytest.raises(ValueError, match="sink_size"):
        kvjax.prefill(tiny, ROWS, kvjax.make_policy("kvzip", token_budget=4, sink_size=4))
    from kvjax.engine.shared_prefill import shared_prefill

    with pytest.raises(ValueError, match="kvzip.*prefill it on its own"):
        shared_prefill(tiny, ROWS, [kvjax.make_policy("kvzip")], reserve_tokens=4)
    from kvjax.eval.lib import retrieval

    assert retrieval.compresses_in_prefill(kvjax.make_policy("kvzip"))  # the sweep prefills it on its own


@pytest.mark.heavy  # three KVzip prefills of the tiny model, about 20 s
def test_budgets_share_one_scoring_pass(tiny, monkeypatch):
    """The sweep's KVzip cells that differ in their budget alone share one prefill and one scoring pass
    (`retrieval.scored_states`), each state equal to the policy's own prefill (kept slots and logits)."""
    from kvjax.engine import reconstruction
    from kvjax.eval.lib import retrieval

    policies = {b: kvjax.make_policy("kvzip", token_budget=b, chunk=40) for b in (12, 20)}
    policies["head"] = kvjax.make_policy("kvzip", token_budget=12, chunk=40, pool="head")
    assert retrieval.scoring_groups(policies) == [[12, 20]]
    passes = []
    scores = reconstruction.reconstruction_scores
    monkeypatch.setattr(reconstruction, "reconstruction_scores", lambda *a: passes.append(1) or scores(*a))
    shared = dict(retrieval.scored_states(tiny, {b: policies[b] for b in (12, 20)}, ROWS, 4))
    assert len(passes) == 1
    for budget in (12, 20):
        want, want_logits = retrieval.policy_state(tiny, None, policies[budget], ROWS, 4)
        got, got_logits = shared[budget]
        np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
        for mine, theirs in zip(kept_positions(got), kept_positions(want)):
            for row_mine, row_theirs in zip(mine, theirs):
                assert [h.tolist() for h in row_mine] == [h.tolist() for h in row_theirs], budget


@pytest.mark.kvpress
@pytest.mark.heavy  # kvpress's own venv and model runs: CI builds it and runs the whole set
@pytest.mark.skipif(not os.path.exists(PYTHON), reason="no kvpress venv: python -m eval.kvpress_crosscheck --setup")
def test_kept_positions_match_kvpress_kvzip():
    from kvjax.eval.kvzip_crosscheck import CASES, crosscheck

    report = crosscheck(PYTHON, length=512, budget=128)
    assert set(report) == set(CASES)
    for name, result in report.items():
        assert result["agrees"], f"{name}: {result}"
    assert len(set(report["pooled over layers and heads"]["kept_per_layer"])) > 1  # layers keep different counts
