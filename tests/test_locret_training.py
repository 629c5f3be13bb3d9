"""Locret training: labels against numpy (and blocked over the answer), a short run whose loss falls, exact
resume, bad rows skipped, bfloat16 train steps, the bfloat16 safetensors export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.locret import HeadsConfig, init_heads, load_heads, retaining_scores
from kvjax.locret.data import build_examples, make_batch
from kvjax.locret.labels import Batch, answer_logit_max, compute_targets
from kvjax.locret.training import head_loss, loss_fn, make_optimizer, make_train_step
from kvjax.models import CausalLM, unrolled
from kvjax.models.rope import rope_frequencies
from kvjax.cache.attention import dense_causal_attention
from kvjax.train import locret as train_locret
from kvjax.tasks.synthetic import digits, passkey_sample

TINY = os.path.join(os.path.dirname(kvjax.__file__), "assets", "tiny-llama")


def dense_capture(model, tokens):
    """Per layer (q post-RoPE [T, Hq, D], k post-RoPE [T, H, D], q_pre, k_pre, v) of one sequence, float64."""
    store = {}

    def attend(layer, inputs, carry):
        store[layer] = tuple(np.asarray(x[0], np.float64) for x in (inputs.q, inputs.k, inputs.q_pre, inputs.k_pre, inputs.v))
        return dense_causal_attention(inputs.q, inputs.k, inputs.v), carry

    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    CausalLM(model.cfg).apply({"params": model.params}, jnp.asarray(tokens)[None], positions, rope_frequencies(model.cfg),
                              unrolled(attend, model.cfg.num_layers), None)
    return store


def test_labels_match_numpy(hf_models):
    model = kvjax.load_model(hf_models("llama_gqa_llama3")[1])
    prefix, answer = random_tokens(1, (2, 32)), random_tokens(2, (2, 8))
    prefix_len, answer_len = np.array([32, 21], np.int32), np.array([8, 3], np.int32)
    batch = Batch(*(jnp.asarray(x) for x in (prefix, prefix_len, answer, answer_len)))
    targets = jax.jit(lambda p, b: compute_targets(p, b, cfg=model.cfg, dtype=jnp.float32, chunk_size=16))(model.params, batch)
    H, G = model.cfg.num_kv_heads, model.cfg.group_size
    for b in range(2):
        P = int(prefix_len[b])
        seq = np.concatenate([prefix[b, :P], answer[b, : answer_len[b]]])
        for layer, (q, k, q_pre, k_pre, v) in dense_capture(model, seq).items():
            D = q.shape[-1]
            logits = np.einsum("ahd,thd->hat", q[P:], np.repeat(k[:P], G, axis=1)) / np.sqrt(D)  # [Hq, A, P]
            expected = logits.reshape(H, G, -1, P).max(axis=(1, 2)).T  # [P, H]
            np.testing.assert_allclose(np.asarray(targets.labels[layer, b, :P]), expected, atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(targets.q_pre[layer, b, :P]), q_pre[:P], atol=1e-5)
            np.testing.assert_allclose(np.asarray(targets.k_pre[layer, b, :P]), k_pre[:P], atol=1e-5)
            np.testing.assert_allclose(np.asarray(targets.v[layer, b, :P]), v[:P], atol=1e-5)
        assert np.asarray(targets.valid[b]).sum() == P
    # labels only (what scoring tokens by their labels reads): the same labels, no inputs recorded
    only = jax.jit(lambda p, b: compute_targets(p, b, cfg=model.cfg, dtype=jnp.float32, chunk_size=16, features=False))(
        model.params, batch)
    assert only.q_pre is None and only.k_pre is None and only.v is None
    np.testing.assert_array_equal(np.asarray(only.labels), np.asarray(targets.labels))

    # the loss (what loss_fn returns on these targets, and what the train step differentiates) against numpy
    heads = init_heads(HeadsConfig.for_model(model.cfg, 16), seed=3).params
    loss = jax.jit(head_loss, static_argnums=2)(heads, targets, 0.5)
    fit = smooth = 0.0
    valid = np.asarray(targets.valid)
    for layer in range(model.cfg.num_layers):
        pred = np.asarray(retaining_scores(heads[f"layer_{layer}"], targets.q_pre[layer], targets.k_pre[layer], targets.v[layer]))
        err = np.abs(pred - np.asarray(targets.labels[layer]))
        fit += np.where(err < 1, 0.5 * err**2, err - 0.5)[valid].mean()
        pairs = valid[:, 1:] & valid[:, :-1]
        smooth += ((pred[:, 1:] - pred[:, :-1]) ** 2)[pairs].mean()
    np.testing.assert_allclose(float(loss), fit / model.cfg.num_layers + 0.5 * smooth, rtol=1e-5)


def _write_rows(path, n=6):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        sample = passkey_sample(rng, 90)
        rows.append({"instruction": sample.prompt, "output": digits(sample.answer) + " ."})
    rows += [
        {"instruction": "the sky is blue ."},  # no output
        {"output": "1 2 3"},  # no instruction
        {"instruction": "the sky is blue .", "output": "  "},  # empty answer
        {"instruction": ["not", "text"], "output": "4"},  # wrong type (datasets cannot type this column)
    ]
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write("{ broken json\n")


ARGS = ["--model", TINY, "--steps", "10", "--warmup", "2", "--lr", "1e-2", "--hidden", "32", "--chunk-size", "64",
        "--save-every", "3", "--no-progress"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("locret_train")
    data = str(root / "rows.jsonl")
    _write_rows(data)
    out = str(root / "full")
    summary = train_locret.main(ARGS + ["--data", data, "--out", out])
    return data, out, summary


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(row["step"], row["loss"]) for row in map(json.loads, f)]


def test_bad_rows_are_skipped_and_counted(full_run):
    _, _, summary = full_run
    assert summary["examples"] == 6
    assert summary["skipped"] == {
        "missing_output": 1, "missing_instruction": 1, "empty_answer": 1, "not_a_string": 1, "unparsable_line": 1,
    }


def test_training_loss_falls_and_heads_load(full_run):
    data, out, summary = full_run
    losses = [loss for _, loss in _losses(out)]
    assert len(losses) == 10 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses
    assert summary["steps_per_second"] > 0 and summary["tokens_per_second"] > 0
    assert os.path.getsize(os.path.join(out, "loss.png")) > 0
    saved, exported = load_heads(os.path.join(out, "heads")), load_heads(os.path.join(out, "heads.safetensors"))
    assert saved.config == exported.config == HeadsConfig.for_model(kvjax.load_model(TINY).cfg, 32)
    for layer in range(saved.config.num_layers):
        for name in ("w1", "w2"):
            assert saved.layer(layer)[name].dtype == jnp.float32 and exported.layer(layer)[name].dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(saved.layer(layer)[name].astype(jnp.bfloat16)),
                                          np.asarray(exported.layer(layer)[name]))


def test_killed_run_resumes_exactly(full_run, tmp_path):
    data, full_out, _ = full_run
    out = str(tmp_path / "resumed")
    killed = train_locret.main(ARGS + ["--data", data, "--out", out, "--stop-after", "7"])
    assert killed["steps_done"] == 6  # checkpoints at 3 and 6; step 7 was lost with the "kill"
    assert [s for s, _ in _losses(out)] == list(range(1, 8))
    train_locret.main(ARGS + ["--data", data, "--out", out])
    assert _losses(out) == _losses(full_out)  # same steps, bit-identical losses


def test_examples_truncate_and_batch(tmp_path):
    path = str(tmp_path / "rows.json")
    long_doc = " ".join(["the sky is blue ."] * 60)
    with open(path, "w") as f:
        json.dump([{"instruction": long_doc + " what is the pass key ?", "output": "1 2 3 4 5 6 7 8 9"}], f)
    tokenizer = kvjax.load_model(TINY).tokenizer
    (example,), skipped = build_examples(path, tokenizer, max_length=64, max_answer=4, progress=False)
    assert not skipped and len(example.answer) == 4 and len(example.prefix) == 60
    full = tokenizer(long_doc + " what is the pass key ?")["input_ids"]
    assert example.prefix.tolist() == full[:30] + full[-30:]  # the middle is cut, the question kept
    batch = make_batch([example], chunk_size=32)
    assert batch.prefix.shape == (1, 64) and batch.answer.shape == (1, 8)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build_examples(str(tmp_path / "missing.jsonl"), tokenizer, progress=False)


def test_answer_labels_in_blocks_match_one_block():
    rng = np.random.default_rng(0)
    B, A, Hq, H, S, D = 2, 11, 6, 2, 40, 8
    q, k = rng.normal(size=(B, A, Hq, D)).astype(np.float32), rng.normal(size=(B, H, S, D)).astype(np.float32)
    answer_real = np.arange(A)[None] < np.array([[11], [5]])
    key_real = rng.random((B, H, S)) < 0.8
    qg = q.reshape(B, A, H, Hq // H, D)
    s = np.einsum("bahgd,bhsd->bhgas", qg, k) / np.sqrt(D)
    s = np.where(answer_real[:, None, None, :, None], s, -np.inf)
    expected = np.where(key_real, s.max(axis=(2, 3)), 0.0)
    for block in (1, 3, 4, 64):  # 3 and 4 leave a padded last block
        got = answer_logit_max(jnp.asarray(q), jnp.asarray(answer_real), jnp.asarray(k), jnp.asarray(key_real), block)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads_dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_train_steps(hf_models, heads_dtype):
    """A bfloat16 model: the loss is finite and close to float32's, every head moves, dtypes stay."""
    path = hf_models("llama_gqa_llama3")[1]
    model, model32 = kvjax.load_model(path, dtype="bfloat16"), kvjax.load_model(path)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(model.params))
    prefix, answer = random_tokens(4, (2, 32)), random_tokens(5, (2, 8))
    batch = Batch(*(jnp.asarray(x) for x in (prefix, np.array([32, 19], np.int32), answer, np.array([8, 5], np.int32))))
    heads = init_heads(HeadsConfig.for_model(model.cfg, 16), seed=2, dtype=heads_dtype).params
    before = jax.tree_util.tree_map(np.asarray, heads)

    loss16 = loss_fn(heads, model.params, batch, cfg=model.cfg, dtype=model.dtype, chunk_size=16)
    loss32 = loss_fn(jax.tree_util.tree_map(lambda w: w.astype(jnp.float32), heads), model32.params, batch,
                     cfg=model.cfg, dtype=jnp.float32, chunk_size=16)
    assert loss16.dtype == jnp.float32 and abs(float(loss16) - float(loss32)) < 0.05 * float(loss32), (loss16, loss32)

    optimizer = make_optimizer(learning_rate=1e-2, total_steps=3, warmup_steps=0)
    step = make_train_step(optimizer, cfg=model.cfg, dtype=model.dtype, chunk_size=16)
    opt_state = optimizer.init(heads)
    losses = []
    for _ in range(3):
        heads, opt_state, loss = step(heads, opt_state, model.params, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), losses
    for layer, params in heads.items():
        for name, w in params.items():
            assert w.dtype == heads_dtype, (layer, name, w.dtype)
            assert np.abs(np.asarray(w, np.float32) - before[layer][name].astype(np.float32)).max() > 0, (layer, name)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(model.params))


def test_kvzip_targets_are_the_kvzip_policys_scores():
    """`kvzip_targets`: the heads' inputs of `compute_targets` and the log of the score the kvzip policy
    itself writes after its reconstruction pass (budget above the prompt: nothing pooled away)."""
    from kvjax.engine.decode import prompt_view
    from kvjax.locret.data import Example
    from kvjax.locret.labels import kvzip_targets

    model = kvjax.load_model(TINY)
    prefix = random_tokens(21, (1, 40))[0]
    batch = make_batch([Example(prefix, np.array([5, 6], np.int32))], chunk_size=16)
    targets = kvzip_targets(model, batch, chunk_size=16)
    plain = compute_targets(model.params, batch, cfg=model.cfg, dtype=model.dtype, chunk_size=16)
    for got, want in zip(targets[:3], plain[:3]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    state, _ = kvjax.prefill(model, prefix[None], policy=kvjax.make_policy("kvzip", token_budget=64), max_new_tokens=2)
    L = model.cfg.num_layers
    for layer in range(L):
        view = prompt_view(state, layer, L, state.next_position)
        for h in range(model.cfg.num_kv_heads):
            pos, score = np.asarray(view.slot_pos[0, h]), np.asarray(view.slot_score[0, h])
            real = (pos >= 4) & np.asarray(view.valid[0, h])  # past the 4 sinks (+inf)
            np.testing.assert_allclose(np.asarray(targets.labels[layer, 0, pos[real], h]),
                                       np.log(np.maximum(score[real], 1e-8)), rtol=1e-4, atol=1e-4)


def test_ranked_loss_and_pooled_recall():
    from kvjax.locret.training import cached_predictions, normalise_labels, ranked_loss, top_share_recall

    rng = np.random.default_rng(3)
    L, T, H = 2, 24, 2
    labels = rng.normal(size=(L, T, H)).astype(np.float32)
    valid = np.arange(T) < 20
    assert top_share_recall(labels, labels, valid, 0.25) == 1.0
    assert top_share_recall(-labels, labels, valid, 0.25) == 0.0
    # pooled: a prediction that ranks every head alike but shifts one layer up keeps per-head recall, loses pooled
    shifted = labels + np.array([10.0, 0.0])[:, None, None]
    assert top_share_recall(shifted, labels, valid, 0.25, pooled=False) == 1.0
    assert top_share_recall(shifted, labels, valid, 0.25) < 1.0
    z = np.asarray(normalise_labels(jnp.asarray(labels), jnp.asarray(valid)))
    assert abs(z[:, valid].mean()) < 1e-5 and abs(z[:, valid].std() - 1) < 1e-4 and (z[:, ~valid] == 0).all()
    heads = init_heads(HeadsConfig(L, 2, H, 4, 8), seed=0).params
    x = jnp.asarray(rng.normal(size=(L, T, (2 + 2 * H) * 4)), jnp.float32)
    pred = np.asarray(cached_predictions(heads, x))
    np.testing.assert_allclose(pred[1], np.asarray(retaining_scores(heads["layer_1"], x[1, None, :, :8].reshape(1, T, 2, 4),
                               x[1, None, :, 8:16].reshape(1, T, 2, 4), x[1, None, :, 16:].reshape(1, T, 2, 4)))[0],
                               rtol=1e-5, atol=1e-5)
    loss = lambda target: float(ranked_loss(heads, x, jnp.asarray(target), jnp.asarray(valid)))  # noqa: E731
    assert loss(pred) < loss(-pred)  # labels the heads already rank well cost less
