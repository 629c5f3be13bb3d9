"""CacheClip's auxiliary-model tuning (`kvjax.rag.aux_tuning`, `train/cacheclip_aux.py`) on the shipped model.

- what is trained is what scores: `aux_attention` equals `AuxScorer(context="full").scores` on the same
  prompt (the scorer's selection is the trained quantity);
- the KL loss falls on a tiny run, and a run killed and resumed repeats an uninterrupted one exactly;
- the saved auxiliary model loads back (`load_aux`) and scores with its tuned weights.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.rag import AuxScorer, ChunkStore, assemble, truncated_model
from kvjax.rag.aux_tuning import aux_attention, load_aux, selection_recall
from kvjax.tasks.rag_records import rag_prompt
from kvjax.train import cacheclip_aux
from test_real_tasks import corpus, tokenizer  # noqa: F401  (fixtures: a small BPE, no download)

SMALL = ["--samples", "8", "--eval-samples", "4", "--chunks", "3", "--chunk-len", "48", "--records", "3",
         "--batch-size", "2", "--lr", "2e-3", "--warmup", "1", "--save-every", "4", "--no-progress"]


@pytest.fixture(scope="module")
def model():
    return kvjax.load_model("tiny")


def test_aux_attention_is_what_the_scorer_scores(model):
    prefix, chunks, question, _ = rag_prompt(model.tokenizer, np.random.default_rng(3), 3, 48, 3, straddle=True)
    aux = truncated_model(model, 1)
    ctx = assemble(model, ChunkStore(model), prefix, chunks, question, max_new_tokens=4)
    scores = AuxScorer(aux, context="full").scores(ctx)
    tokens = np.concatenate([prefix, *chunks, question])[None]
    attention = np.asarray(aux_attention(aux.params, jnp.asarray(tokens), len(question), cfg=aux.cfg))[0]
    context_end = len(prefix) + sum(len(c) for c in chunks)
    np.testing.assert_allclose(scores, attention[len(prefix) : context_end], atol=1e-5)


def test_selection_recall():
    target = np.array([0.5, 0.1, 0.3, 0.05, 0.05, 9.0])  # the last entry is past the context
    assert selection_recall(target, target, 5, 0.4) == 1.0
    assert selection_recall(target, -target, 5, 0.4) == 0.0
    assert selection_recall(target, np.array([0.5, 0.0, 0.0, 0.3, 0.0, 0.0]), 5, 0.4) == 0.5


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("aux") / "whole"
    return out, cacheclip_aux.main(SMALL + ["--steps", "8", "--aux-layers", "1", "--out", str(out)])


def test_loss_falls_and_a_resumed_run_repeats_an_uninterrupted_one(tmp_path, whole_run):
    (tmp_path / "whole").symlink_to(whole_run[0])
    whole = whole_run[1]
    split = SMALL + ["--steps", "8", "--aux-layers", "1", "--out", str(tmp_path / "split")]
    cacheclip_aux.main(split + ["--stop-after", "4"])
    resumed = cacheclip_aux.main(split)

    def losses(run):
        with open(tmp_path / run / "metrics.jsonl") as f:
            return [json.loads(line)["loss"] for line in f]

    assert len(losses("whole")) == 8
    np.testing.assert_allclose(losses("split"), losses("whole"), rtol=1e-6)
    assert np.mean(losses("whole")[-2:]) < np.mean(losses("whole")[:2]), losses("whole")
    assert resumed["recall_after"] == whole["recall_after"]
    for name in ("whole", "split"):
        assert (tmp_path / name / "loss.png").exists() and (tmp_path / name / "aux" / "aux.json").exists()


def test_tuned_model_loads_and_scores_with_its_weights(model, whole_run):
    tuned = load_aux(model, str(whole_run[0] / "aux"))
    untuned = truncated_model(model, 1)
    assert tuned.cfg.num_layers == 1 and tuned.tokenizer is model.tokenizer
    prefix, chunks, question, _ = rag_prompt(model.tokenizer, np.random.default_rng(4), 3, 48, 3, straddle=True)
    ctx = assemble(model, ChunkStore(model), prefix, chunks, question, max_new_tokens=4)
    assert not np.allclose(AuxScorer(tuned, context="full").scores(ctx), AuxScorer(untuned, context="full").scores(ctx))


def test_real_text_prompts_share_one_shape_and_end_with_the_value(tokenizer):
    """`--task real`: rag_real requests (straddle, split, inside cycled; straddle only held out), context then
    query then the value's tokens, one shape, `after_boundary` the asked fact's tokens after the boundary."""
    tok = tokenizer  # test_real_tasks' small BPE; the chunks come from the default corpus (Debian's licence texts)
    args = cacheclip_aux.parse_args(["--task", "real", "--chunks", "3", "--chunk-len", "64", "--records", "2"])
    data = cacheclip_aux.prompts(tok, 6, args, seed=5)
    assert [m["kind"] for _, _, m in data] == ["straddle", "split", "inside"] * 2
    assert all(m["kind"] == "straddle" for _, _, m in cacheclip_aux.prompts(tok, 2, args, seed=6, straddle_only=True))
    for tokens, context_len, meta in data:
        answer = tokens[len(tokens) - meta["answer_len"]:]
        assert tok.decode(answer.tolist()).strip() == meta["answer"] + "."
        assert len(tokens) == context_len + meta["question_len"] + meta["answer_len"]
        if meta["kind"] == "inside":
            assert meta["after_boundary"] is None
        else:  # the fact's tail after the boundary: inside the context, ending with the value's period
            after = meta["after_boundary"]
            assert after.max() < context_len and tok.decode(tokens[after].tolist()).endswith(".")
            assert meta["answer"][-1] in tok.decode(tokens[after].tolist())
