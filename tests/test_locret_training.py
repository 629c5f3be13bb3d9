"""Locret training: labels against numpy, a short run whose loss falls, exact resume, bad rows skipped."""

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
from kvjax.locret.labels import Batch, compute_targets
from kvjax.locret.training import head_loss
from kvjax.models import CausalLM, unrolled
from kvjax.rope import rope_frequencies
from kvjax.attention import dense_causal_attention
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
    saved, exported = load_heads(os.path.join(out, "heads")), load_heads(os.path.join(out, "heads.safetensors"))
    assert saved.config == exported.config == HeadsConfig.for_model(kvjax.load_model(TINY).cfg, 32)
    for layer in range(saved.config.num_layers):
        for name in ("w1", "w2"):
            np.testing.assert_array_equal(np.asarray(saved.layer(layer)[name]), np.asarray(exported.layer(layer)[name]))


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
