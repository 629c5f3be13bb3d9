"""Evaluation tasks: synthetic prompts, scoring rules, LongBench metrics, perplexity by decode, sweep output."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.eval import sweep
from kvjax.eval.lib import longbench, perplexity, policies, retrieval
from kvjax.eval.lib.sweep import run_sweep
from kvjax.tasks import synthetic
from kvjax.train.build_tiny_model import fast_tokenizer

# ------------------------------------------------------------------------------------- synthetic tasks


@pytest.fixture(scope="module")
def tokenizer():
    return fast_tokenizer()


def test_passkey_sample_layout(tokenizer):
    rng = np.random.default_rng(1)
    s = synthetic.passkey_sample(rng, 500, depth=0.5)
    assert s.question == synthetic.PASSKEY_QUESTION
    assert f"the pass key is {synthetic.digits(s.answer)} ." in s.context
    assert len(s.answer) == 5 and s.answer.isdigit()
    ids = tokenizer(s.prompt)["input_ids"]
    assert abs(len(ids) - 501) <= 2  # BOS + about n_tokens words
    assert tokenizer.unk_token_id not in ids
    assert 0.4 <= s.depth <= 0.6


def test_multikey_sample_asks_one_record(tokenizer):
    rng = np.random.default_rng(2)
    s = synthetic.multikey_sample(rng, 400, num_records=6, depth=0.9)
    key = s.question.split()[-1]
    assert s.question == synthetic.MULTIKEY_QUESTION.format(key=key)
    assert f"{key} {synthetic.digits(s.answer)} ." in s.context
    assert sum(w in synthetic.KEYS for w in s.context.split()) == 6  # six distinct records
    assert tokenizer.unk_token_id not in tokenizer(s.prompt)["input_ids"]
    assert s.depth > 0.8


def test_multikey_rejects_bad_record_count():
    with pytest.raises(ValueError, match="num_records"):
        synthetic.multikey_sample(np.random.default_rng(0), 300, num_records=0)


@pytest.mark.parametrize(
    "text, expected",
    [("7 1 4 3 2 . remember", "71432"), ("the key is 4 2", "42"), ("no digits", None), ("1 2 x 3", "12")],
)
def test_first_integer(text, expected):
    assert synthetic.first_integer(text) == expected


def test_score_text_first_integer_match():
    assert retrieval.score_text("7 1 4 3 2 .", "71432") == ("71432", True)
    assert retrieval.score_text("7 1 4 3 .", "71432") == ("7143", False)
    assert retrieval.score_text("grass", "71432") == (None, False)


def test_depths_cycle_and_accuracy_by_depth():
    samples = retrieval.make_samples("passkey", 300, 4, depths=[0.0, 1.0])
    assert [round(s.depth) for s in samples] == [0, 1, 0, 1]
    records = [retrieval.Scored("passkey", 300, s.depth, s.answer, s.answer, i % 2 == 0, "") for i, s in enumerate(samples)]
    assert retrieval.accuracy(records) == 0.5
    by_depth = retrieval.accuracy_by_depth(records)
    assert by_depth["0.0-0.2"] == 1.0 and by_depth["0.8-1.0"] == 0.0
    with pytest.raises(ValueError, match="unknown synthetic retrieval task"):
        retrieval.make_samples("needle", 300, 1)


# ------------------------------------------------------------------------------------ LongBench metrics


def test_qa_f1_follows_squad_normalisation():
    assert longbench.normalize_answer("The  Cat, sat!") == "cat sat"
    assert longbench.qa_f1("the cat sat", "A cat sat on the mat") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert longbench.qa_f1("dog", "cat") == 0.0
    assert longbench.score_prediction("hotpotqa", "Paris", ["paris", "London"]) == 1.0
    # TriviaQA keeps the first line of the prediction
    assert longbench.score_prediction("triviaqa", "\nParis\nand more words", ["Paris"]) == 1.0


def test_rouge_l_is_lcs_f1():
    # LCS of "a b c d" and "a c d e" is "a c d" (3): P = 3/4, R = 3/4
    assert longbench.rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert longbench.rouge_l("x y", "a b") == 0.0
    assert longbench.score_prediction("gov_report", "a b c d", ["a c d e"]) == pytest.approx(0.75)


def test_longbench_jsonl_skips_bad_rows(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [
        {"input": "what colour is the sky ?", "context": "the sky is blue .", "answers": ["blue"], "_id": "a"},
        {"input": "missing context", "answers": ["x"]},
        {"input": "q", "context": "c", "answers": []},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    good, skipped = longbench.load_jsonl(str(path))
    assert [r["_id"] for r in good] == ["a"] and skipped == 3


def test_longbench_prompt_middle_truncation(tokenizer):
    row = {"input": "what is the pass key ?", "context": " ".join(["green"] * 500), "answers": ["1"]}
    ids = longbench.build_prompt_ids(tokenizer, "hotpotqa", row, max_prompt_tokens=100)
    assert len(ids) == 101 and ids[0] == tokenizer.bos_token_id
    full = tokenizer(longbench.PROMPTS["hotpotqa"].format(**row), add_special_tokens=False)["input_ids"]
    assert ids[1:51] == full[:50] and ids[51:] == full[-50:]


# ------------------------------------------------------------------------------- perplexity by decode


@pytest.fixture(scope="module")
def shipped():
    from kvjax.models.hub import shipped_model_dir

    return kvjax.load_model(shipped_model_dir())


def test_decode_perplexity_equals_dense_forward(shipped):
    rng = np.random.default_rng(0)
    ids = shipped.tokenizer(synthetic.passkey_sample(rng, 60).prompt)["input_ids"]
    result = perplexity.decode_perplexity(shipped, kvjax.make_policy("full"), ids, prefix_tokens=5, progress=False)
    logits = kvjax.forward_logits(shipped, np.asarray([ids]))[0]
    logprobs = jax.nn.log_softmax(logits, -1)
    nll = -np.mean([float(logprobs[t - 1, ids[t]]) for t in range(5, len(ids))])
    assert result["tokens"] == len(ids) - 5
    assert result["nll"] == pytest.approx(nll, abs=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)


def test_longbench_run_on_shipped_model(tmp_path, shipped):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(json.dumps({"input": "what is the pass key ?", "context": "the pass key is 4 2 .", "answers": ["4 2"]}) + "\n")
    out = longbench.run_longbench(shipped, kvjax.make_policy("full"), "hotpotqa", str(path), max_prompt_tokens=64,
                                  max_new_tokens=4, progress=False)
    assert out["samples"] == 1 and out["skipped_rows"] == 0
    expected = 100 * longbench.score_prediction("hotpotqa", out["records"][0]["prediction"], ["4 2"])
    assert out["score"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.run_longbench(shipped, kvjax.make_policy("full"), "lcc", str(path))


# ------------------------------------------------------------------------------------- sweep output


def _fake_result():
    rows = []
    for task in ("passkey", "multikey"):
        rows.append({"task": task, "length": 512, "policy": "full", "budget": None, "accuracy": 1.0, "samples": 4})
        for b, acc in ((64, 0.25), (128, 0.75)):
            rows.append({"task": task, "length": 512, "policy": "quest", "budget": b, "accuracy": acc, "samples": 4})
    latency = [{"length": 512, "policy": p, "budget": None, "decode_ms_per_step": 2.0, "decode_tokens_per_s": 500.0, "batch": 1}
               for p in ("full", "quest")]
    return {"tasks": ["passkey", "multikey"], "lengths": [512], "budgets": [64, 128], "policies": ["full", "quest"],
            "num_records": 4, "accuracy": rows, "latency": latency}


def test_sweep_table_and_plot(tmp_path):
    result = _fake_result()
    table = sweep.accuracy_table(result)
    assert "| quest | 25% | 75% |" in table and "| full | 100% | 100% |" in table
    path = sweep.plot(result, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and path.endswith(".png")


# ------------------------------------------------------------------------------ query-agnostic control


def test_quest_static_keeps_top_pages_for_the_last_query():
    from kvjax.policies.base import PromptView

    B, H, G, S, D, ps = 1, 2, 2, 64, 8, 16
    key = jax.random.PRNGKey(3)
    k = jax.random.normal(key, (B, H, S, D))
    q = jax.random.normal(jax.random.fold_in(key, 1), (B, 1, H * G, D))
    lengths = jnp.array([[64, 40]], jnp.int32)
    valid = jnp.arange(S)[None, None, :] < lengths[..., None]
    view = PromptView(layer=1, num_layers=2, k=k, slot_pos=jnp.where(valid, jnp.arange(S), -1), valid=valid,
                      slot_score=jnp.zeros((B, H, S)), lengths=lengths, next_position=jnp.array([64]),
                      final_chunk=jnp.array([True]), window_q=q, window_pos=jnp.array([[63]]))
    policy = kvjax.make_policy("quest_static", token_budget=32, page_size=ps)
    keep, count = policy.compress_layer(view, 32)
    kn, qn = np.asarray(k), np.asarray(q)[0, 0].reshape(H, G, D)
    for h in range(H):
        n = int(lengths[0, h])
        pages = [(kn[0, h, p * ps : min((p + 1) * ps, n)]) for p in range(-(-n // ps))]
        score = [max(np.maximum(qn[h, g] * pg.min(0), qn[h, g] * pg.max(0)).sum() for g in range(G)) for pg in pages]
        current = len(pages) - 1
        best = max((p for p in range(current)), key=lambda p: score[p])
        expected = sorted(set(range(current * ps, n)) | set(range(best * ps, (best + 1) * ps)))
        kept = [int(s) for s in np.asarray(keep[0, h]) if s >= 0]
        # a full current page: exactly it and the best other page; a partial one: those plus part of the next best
        assert kept == expected if n % ps == 0 else set(expected) <= set(kept), (h, kept, expected)
        assert int(count[0, h]) == len(kept) == 32


def test_demo_table_lists_every_policy():
    from kvjax.eval.demo import demo_table

    result = _fake_result()
    result.update(budgets=[64], lengths=[512], num_samples=4, dense_layers=1, seconds=1.0, model="tiny",
                  machine={"processor": "cpu", "cpu_model": "test cpu"})
    result["accuracy"] = [r for r in result["accuracy"] if r["budget"] in (None, 64)]
    table = demo_table(result)
    assert "| full |  | 100% | 100% | 2.0 | 500 |" in table
    assert "| quest | 64 | 25% | 25% | 2.0 | 500 |" in table


def test_shipped_model_retrieves(shipped):
    """The trained default model answers passkey and 4-record multi-key prompts with full attention."""
    full = kvjax.make_policy("full")
    passkey = retrieval.run_task(shipped, full, "passkey", 512, 8, seed=5)
    multikey = retrieval.run_task(shipped, full, "multikey", 512, 8, seed=5, num_records=4)
    assert retrieval.accuracy(passkey) >= 7 / 8, [r.text for r in passkey]
    assert retrieval.accuracy(multikey) >= 6 / 8, [r.text for r in multikey]


def test_sweep_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Batches in the checkpoint are not run again; `max_batches` stops early and a later call goes on."""
    calls = []

    def fake_answer_shared(model, policies, samples, task, n_tokens, progress=None, question_in_prefill=False):
        calls.append((task, tuple(policies), len(samples)))
        return {key: [retrieval.Scored(task, n_tokens, 0.5, "1", "1", i % 2 == 0, "1") for i in range(len(samples))]
                for key in policies}

    monkeypatch.setattr(retrieval, "answer_shared", fake_answer_shared)
    monkeypatch.setattr(retrieval, "task_samples", lambda model, task, n, num, seed, records: list(range(num)))
    checkpoint = str(tmp_path / "batches.jsonl")
    kwargs = dict(policies=("full", "streaming"), budgets=(64,), lengths=(512,), tasks=("passkey",), num_samples=4,
                  batch_size=2, latency=False, progress=False, checkpoint=checkpoint)
    partial = run_sweep(None, **kwargs, max_batches=1)
    assert calls == [("passkey", ("full", "streaming@64"), 2)]
    assert [(r["policy"], r["samples"], r["accuracy"]) for r in partial["accuracy"]] == [("full", 2, 0.5), ("streaming", 2, 0.5)]
    first = run_sweep(None, **kwargs)
    assert len(calls) == 2 and [(r["samples"], r["accuracy"]) for r in first["accuracy"]] == [(4, 0.5), (4, 0.5)]

    def fail(*args, **kw):
        raise AssertionError("a finished batch ran again")

    monkeypatch.setattr(retrieval, "answer_shared", fail)
    again = run_sweep(None, **kwargs)
    assert again["accuracy"] == first["accuracy"]
    with pytest.raises(AssertionError, match="ran again"):  # another setting is not taken from the checkpoint
        run_sweep(None, **{**kwargs, "num_samples": 8})


def test_sweep_copies_the_cells_another_checkpoint_holds(tmp_path, monkeypatch):
    """`reuse`: cells another sweep of the same setting holds for a batch this call runs are copied, not run, and
    only for the batches run (so every cell of the report covers the same samples)."""
    calls = []

    def answer(correct):
        def fake(model, policies, samples, task, n_tokens, **kw):
            calls.append(tuple(policies))
            return {key: [retrieval.Scored(task, n_tokens, 0.5, "1", "1", correct, "1")] * len(samples)
                    for key in policies}
        return fake

    monkeypatch.setattr(retrieval, "task_samples", lambda model, task, n, num, seed, records: list(range(num)))
    kwargs = dict(budgets=(64,), lengths=(512,), tasks=("passkey",), num_samples=4, batch_size=2, latency=False,
                  progress=False)
    other, mine = str(tmp_path / "other.jsonl"), str(tmp_path / "mine.jsonl")
    monkeypatch.setattr(retrieval, "answer_shared", answer(True))
    run_sweep(None, policies=("full", "streaming"), checkpoint=other, **kwargs)
    monkeypatch.setattr(retrieval, "answer_shared", answer(False))
    calls.clear()
    result = run_sweep(None, policies=("full", "streaming", "h2o"), checkpoint=mine, reuse=other, max_batches=1,
                       **kwargs)
    assert calls == [("h2o@64",)]
    cells = {r["policy"]: (r["accuracy"], r["samples"]) for r in result["accuracy"]}
    assert cells == {"full": (1.0, 2), "streaming": (1.0, 2), "h2o": (0.0, 2)}
    with open(mine) as f:
        assert [json.loads(line)["reused_from"] for line in f] == [other]


def test_sweep_reports_every_task_its_checkpoint_holds(tmp_path, monkeypatch):
    """A call naming one task, length or policy still reports the others the checkpoint holds for its setting."""
    monkeypatch.setattr(retrieval, "answer_shared", lambda model, policies, samples, task, n_tokens, **kw: {
        key: [retrieval.Scored(task, n_tokens, 0.5, "1", "1", task == "passkey", "1")] * len(samples)
        for key in policies})
    monkeypatch.setattr(retrieval, "task_samples", lambda model, task, n, num, seed, records: list(range(num)))
    kwargs = dict(num_samples=2, batch_size=2, latency=False, progress=False, checkpoint=str(tmp_path / "b.jsonl"))
    run_sweep(None, policies=("full", "streaming"), budgets=(64,), lengths=(512,), tasks=("passkey",), **kwargs)
    later = run_sweep(None, policies=("full", "h2o"), budgets=(128,), lengths=(1024,), tasks=("multikey",), **kwargs)
    cells = {(r["task"], r["length"], r["policy"], r["budget"]): r["accuracy"] for r in later["accuracy"]}
    assert cells == {("passkey", 512, "full", None): 1.0, ("passkey", 512, "streaming", 64): 1.0,
                     ("multikey", 1024, "full", None): 0.0, ("multikey", 1024, "h2o", 128): 0.0}
    assert (later["tasks"], later["lengths"], later["budgets"]) == (["multikey", "passkey"], [512, 1024], [64, 128])
    assert later["policies"] == ["full", "h2o", "streaming"]
    assert "**passkey**, 512 tokens" in sweep.accuracy_table(later)


def test_sweep_policy_specs():
    quest0 = policies.build_policy("quest:dense_layers=0", 128, dense_layers=2)
    assert (quest0.name, quest0.token_budget, quest0.dense_layers) == ("quest", 128, 0)
    composed = policies.build_policy("snapkv+quest", 64, dense_layers=2)
    assert composed.name == "compose" and composed.evict.token_budget == composed.select.token_budget == 64
    with pytest.raises(ValueError, match="no option"):
        policies.build_policy("snapkv:nonsense=1", 64)


def test_default_model_recipe_sets_a_previous_token_head_and_trains():
    """The hand-set head of train.train_default_model attends to the previous token, and a few optimizer
    steps on its batches lower the answer loss."""
    import optax

    from kvjax.cache.attention import dense_causal_attention
    from kvjax.models.transformer import CausalLM, unrolled
    from kvjax.models.rope import rope_frequencies
    from kvjax.train import train_default_model as tdm

    recipe = tdm.Recipe()  # the shipped recipe (the head's scale is set for its hidden size)
    hf = tdm.tiny_config(recipe.hidden, recipe.layers, recipe.heads, recipe.kv_heads, recipe.intermediate)
    cfg = kvjax.ModelConfig.from_hf_dict(hf.to_dict())
    params = tdm.set_previous_token_head(kvjax.init_params(cfg, seed=0), cfg, recipe)
    tokens, mask = tdm.BatchMaker(recipe, seed=0).batch(64, 8)
    captured = {}

    def attend(layer, inputs, carry):
        if layer == 0:
            s = jnp.einsum("btd,bsd->bts", inputs.q[:, :, 0], inputs.k[:, :, 0]) / np.sqrt(cfg.head_dim)
            T = s.shape[1]
            captured["p"] = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30), -1)
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), carry

    T = tokens.shape[1]
    CausalLM(cfg, jnp.float32).apply({"params": params}, tokens, jnp.broadcast_to(jnp.arange(T), tokens.shape),
                                     rope_frequencies(cfg), unrolled(attend, cfg.num_layers), None,
                                     method=CausalLM.hidden_and_logits)
    p = np.asarray(captured["p"])
    assert np.mean([p[:, i, i - 1] for i in range(1, T)]) > 0.9
    assert mask.sum() > 0 and not mask[:, 0].any()

    optimizer = optax.adamw(3e-3)
    step = tdm.make_train_step(cfg, optimizer)
    state = optimizer.init(params)
    losses = []
    for _ in range(8):
        params, state, loss, _ = step(params, state, tokens, mask)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_trace_compares_the_policies_kept_slots():
    """`kept_overlap` is the share of the reference's kept positions also kept, per layer and head; the trace's
    second table weights it by the reference's slots and spreads each policy's slots over the top layers."""
    from kvjax.eval.lib.needles import kept_overlap
    from kvjax.eval.trace_needle import overlap_table

    a = [[[np.array([1, 2, 3]), np.array([], int)]]]  # one layer, one row, two kv heads
    b = [[[np.array([2, 3, 4, 5]), np.array([], int)]]]
    np.testing.assert_allclose(kept_overlap(a, b), [[0.5, 1.0]])
    np.testing.assert_allclose(kept_overlap(b, a), [[2 / 3, 1.0]])
    policies = {"full": {}, "locret:x": {"kept_slots": [[2], [4]], "keeps_of": {"kvzip": [[0.5], [1.0]]}},
                "kvzip": {"kept_slots": [[4], [2]], "keeps_of": {"locret:x": [[1.0], [0.5]]}}}
    table = overlap_table({"policies": policies}, top=[1, 0])
    assert "| locret | 3 (2-4) | 4 2 |  | 67% (100 50) |" in table, table
    assert "| kvzip | 3 (2-4) | 2 4 | 67% (50 100) |  |" in table, table
    assert overlap_table({"policies": {"full": {}, "snapkv": {"kept_share": []}}}, top=[0]) == ""


def test_trace_needle_mass_and_kept_share(shipped):
    """The traced attention mass is a distribution over the prompt (1 over every position, 0 over none, and
    the last token's mass equals the dense attention's); the full cache keeps every needle token."""
    from kvjax.eval.lib import needles

    ids = shipped.tokenizer("the pass key is 1 2 3 . remember it . what is the pass key ?")["input_ids"]
    everything = needles.needle_attention(shipped, ids, np.arange(len(ids)))
    np.testing.assert_allclose(everything, 1.0, atol=1e-5)
    assert everything.shape == (shipped.cfg.num_layers, shipped.cfg.num_heads)
    first = needles.needle_attention(shipped, ids, np.arange(3))
    assert (first >= 0).all() and (first <= 1).all() and not np.allclose(first, first.mean())
    state, _ = kvjax.prefill(shipped, [ids], kvjax.make_policy("full"))
    np.testing.assert_array_equal(needles.kept_share(state, np.arange(3, 6)), 1.0)
    state, _ = kvjax.prefill(shipped, [ids], kvjax.make_policy("streaming", token_budget=8, sink_size=2))
    share = needles.kept_share(state, np.arange(3, 6))
    np.testing.assert_array_equal(share, 0.0)  # neither among the 2 sinks nor the 6 most recent
