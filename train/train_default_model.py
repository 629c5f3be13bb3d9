"""Train the shipped default model: a tiny Llama that retrieves passkeys and multi-key records at 2K tokens.

JAX + Flax (kvjax's own `CausalLM`, dense attention) + Optax. The recipe follows a torch trial of what
trains on a 2-core CPU (docs/default_model.md, "Background"):

- a word-level vocabulary (`kvjax.tasks.synthetic.VOCABULARY`), loss on the answer digits only, several
  questions per multi-key document;
- one **previous-token head set by hand** at initialisation (layer 0, head 0): its query and key read a
  constant embedding dimension, with the query rotated back by one position's RoPE angle in the
  highest-frequency pairs, so it attends to the previous token. Without it a plain run stalled at chance;
- a length curriculum (128 -> 2048 tokens, about 4K tokens per batch) that moves on when answer-digit
  accuracy stays above a threshold, then the remaining time at the longest lengths with a decaying rate.

    python -m train.train_default_model --out kvjax/assets/tiny-llama --minutes 25

Writes the HF-format model (config.json, model.safetensors, tokenizer.json), `training_log.jsonl` and
`training_summary.json` (steps, wall time, curriculum) into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.tasks import synthetic
from .build_tiny_model import fast_tokenizer, tiny_config, write_model

# (sequence length, batch size): about 4K tokens per batch
CURRICULUM = ((64, 64), (128, 32), (256, 16), (512, 8), (1024, 4), (2048, 2))


@dataclass(frozen=True)
class Recipe:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    lr: float = 1.5e-3
    final_lr: float = 1e-4
    warmup_steps: int = 50
    passkey_fraction: float = 0.25  # rows of each batch that are passkey documents
    min_records: int = 2
    max_records: int = 8
    questions_per_doc: int = 4
    promote_accuracy: float = 0.9  # mean answer-digit accuracy over the last `promote_window` steps
    promote_window: int = 30
    prev_head_scale: float = 1.75  # query/key weight of the hand-set previous-token head
    const_embedding: float = 0.1  # the constant embedding dimension it reads
    prev_head_pairs: int = 5  # highest-frequency RoPE pairs it uses
    seed: int = 0


# --------------------------------------------------------------------------------------------- model


def set_previous_token_head(params, cfg, recipe: Recipe, const_dim: int = 0):
    """Make layer 0's query head 0 attend to the previous token (kv head 0 keys on the same feature); returns
    the parameters with the layers stacked `[L, ...]` (training scans them).

    Embedding dimension `const_dim` is set to `const_embedding` for every token (after RMSNorm a constant
    several times larger than the token dimensions, small enough not to drown them). For
    RoPE pair j (dims j and j + D/2, frequency theta_j) the key reads `s` and the query `s * e^{-i theta_j}`,
    so their dot product at query position m and key position n is s^2 * cos((m - n - 1) theta_j): summed
    over the highest-frequency pairs it peaks at n = m - 1.
    """
    from kvjax.models import stack_layers
    from kvjax.models.rope import rope_frequencies

    params = jax.tree_util.tree_map(lambda x: x, stack_layers(params))  # a copy of the tree, layers stacked
    embed = params["embed_tokens"]["embedding"]
    params["embed_tokens"]["embedding"] = embed.at[:, const_dim].set(recipe.const_embedding)
    inv_freq, _ = rope_frequencies(cfg)
    D, half = cfg.head_dim, cfg.head_dim // 2
    attn = params["layers"]["self_attn"]  # stacked [L, ...]: layer 0 is row 0
    q_kernel, k_kernel = attn["q_proj"]["kernel"][0], attn["k_proj"]["kernel"][0]  # [hidden, heads * D]
    q_row = jnp.zeros(q_kernel.shape[1])
    k_row = jnp.zeros(k_kernel.shape[1])
    s = recipe.prev_head_scale
    for j in range(recipe.prev_head_pairs):
        theta = float(inv_freq[j])
        q_row = q_row.at[j].set(s * np.cos(theta)).at[j + half].set(-s * np.sin(theta))
        k_row = k_row.at[j].set(s)
    # only head 0's / kv head 0's columns are replaced
    q_kernel = q_kernel.at[const_dim, :D].set(q_row[:D]).at[1:, :D].multiply(0.1)
    k_kernel = k_kernel.at[const_dim, :D].set(k_row[:D]).at[1:, :D].multiply(0.1)
    attn["q_proj"]["kernel"] = attn["q_proj"]["kernel"].at[0].set(q_kernel)
    attn["k_proj"]["kernel"] = attn["k_proj"]["kernel"].at[0].set(k_kernel)
    # its values carry the previous token's identity, not the constant
    attn["v_proj"]["kernel"] = attn["v_proj"]["kernel"].at[0, const_dim, :D].set(0.0)
    return params


def loss_and_metrics(params, tokens, mask, cfg):
    """Cross-entropy on the masked target tokens. tokens, mask: `[B, T]`; mask marks tokens to predict."""
    from kvjax.engine.api import dense_forward

    logits = dense_forward(params, tokens, cfg)
    logits, targets, weight = logits[:, :-1], tokens[:, 1:], mask[:, 1:].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    count = jnp.maximum(weight.sum(), 1.0)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return (nll * weight).sum() / count, {"digit_accuracy": (correct * weight).sum() / count}


def make_train_step(cfg, optimizer):
    @jax.jit
    def step(params, opt_state, tokens, mask):
        (loss, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(params, tokens, mask, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return step


# ---------------------------------------------------------------------------------------------- data


class BatchMaker:
    """Token batches `[B, T]` with answer masks, from `train.synthetic` documents."""

    def __init__(self, recipe: Recipe, seed: int):
        self.recipe = recipe
        self.rng = np.random.default_rng(seed)
        self.tokenizer = fast_tokenizer()
        self.pad = self.tokenizer.pad_token_id

    def _row(self, length: int) -> tuple[list[str], list[bool]]:
        """One document as words (BOS excluded) and a per-word answer mask, `length - 1` words at most."""
        r, rng = self.recipe, self.rng
        n = length - 1
        if rng.uniform() < r.passkey_fraction:
            sample = synthetic.passkey_sample(rng, n - 5)
            words = sample.prompt.split()
            answer = synthetic.digits(sample.answer).split()
            return words + answer, [False] * len(words) + [True] * len(answer)
        records = int(rng.integers(r.min_records, r.max_records + 1))
        context, qa = synthetic.multikey_training_text(rng, n, records, r.questions_per_doc)
        words, mask = context.split(), [False] * len(context.split())
        for question, answer in qa:
            q, a = question.split(), synthetic.digits(answer).split() + ["."]
            words += q + a
            mask += [False] * len(q) + [True] * (len(a) - 1) + [False]
        return words, mask

    def batch(self, length: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((batch_size, length), self.pad, np.int32)
        masks = np.zeros((batch_size, length), bool)
        vocab = self.tokenizer.get_vocab()
        bos = self.tokenizer.bos_token_id
        for i in range(batch_size):
            words, mask = self._row(length)
            ids = [bos] + [vocab[w] for w in words][: length - 1]
            tokens[i, : len(ids)] = ids
            masks[i, 1 : len(ids)] = mask[: length - 1]
        return tokens, masks


# ----------------------------------------------------------------------------------------- training


def train(out: str, minutes: float, recipe: Recipe = Recipe(), log_every: int = 10) -> dict:
    import kvjax
    from kvjax.models import stack_layers
    from tqdm import tqdm

    hf_config = tiny_config(recipe.hidden, recipe.layers, recipe.heads, recipe.kv_heads, recipe.intermediate)
    cfg = kvjax.ModelConfig.from_hf_dict(hf_config.to_dict())
    params = stack_layers(kvjax.init_params(cfg, seed=recipe.seed, std=0.02))  # trained stacked
    params = set_previous_token_head(params, cfg, recipe)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=recipe.lr, b1=0.9, b2=0.98, weight_decay=0.01),
    )
    opt_state = optimizer.init(params)
    step_fn = make_train_step(cfg, optimizer)
    batches = BatchMaker(recipe, recipe.seed)

    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "training_log.jsonl"), "w")
    budget = minutes * 60.0
    started = time.perf_counter()
    stage, stage_start_step, final_started = 0, 0, None
    recent: list[float] = []
    history = []
    step = 0
    bar = tqdm(total=int(budget), unit="s", desc="training", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= budget:
            break
        last_stage = stage == len(CURRICULUM) - 1
        if last_stage and final_started is None:
            final_started = elapsed
        # learning rate: warm-up, constant through the curriculum, linear decay over the final stage's time
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup_steps)
        if final_started is not None:
            frac = (elapsed - final_started) / max(budget - final_started, 1.0)
            lr = recipe.lr + (recipe.final_lr - recipe.lr) * min(frac, 1.0)
        opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        length, batch_size = CURRICULUM[stage]
        if last_stage and step % 2 == 1:  # keep the shorter lengths alive in the final stage
            length, batch_size = CURRICULUM[stage - 1]
        tokens, mask = batches.batch(length, batch_size)
        params, opt_state, loss, metrics = step_fn(params, opt_state, tokens, mask)
        step += 1
        accuracy = float(metrics["digit_accuracy"])
        recent = (recent + [accuracy])[-recipe.promote_window :]
        record = {"step": step, "seconds": round(time.perf_counter() - started, 2), "length": length,
                  "loss": float(loss), "digit_accuracy": accuracy, "lr": lr}
        if step % log_every == 0:
            log.write(json.dumps(record) + "\n")
            log.flush()
        bar.n = min(int(record["seconds"]), int(budget))
        bar.set_postfix_str(f"step {step} len {length} loss {float(loss):.3f} acc {np.mean(recent):.2f}")
        bar.refresh()
        if (not last_stage and step - stage_start_step >= recipe.promote_window
                and np.mean(recent) >= recipe.promote_accuracy):
            history.append({"length": CURRICULUM[stage][0], "passed_at_step": step, "seconds": record["seconds"]})
            stage, stage_start_step, recent = stage + 1, step, []
    bar.close()
    log.close()
    seconds = time.perf_counter() - started
    summary = {
        "recipe": recipe.__dict__, "steps": step, "train_seconds": round(seconds, 1),
        "process_cpu_seconds": round(time.process_time(), 1), "curriculum": history,
        "final_length": CURRICULUM[stage][0], "jax": jax.__version__, "devices": str(jax.devices()),
    }
    readme = (
        "# tiny-llama: kvjax's default model (trained)\n\n"
        f"A {recipe.layers}-layer Llama (hidden {recipe.hidden}, {recipe.heads} query / {recipe.kv_heads} kv heads, "
        f"MLP {recipe.intermediate}, vocab {cfg.vocab_size} words, tied embeddings) trained by "
        "`python -m train.train_default_model` on synthetic passkey and multi-key retrieval "
        f"({step} steps, {seconds / 60:.1f} minutes). Recipe and accuracy: docs/default_model.md.\n"
    )
    write_model(out, hf_config, jax.device_get(params), readme)
    with open(os.path.join(out, "training_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("kvjax", "assets", "tiny-llama"))
    parser.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = train(args.out, args.minutes, Recipe(seed=args.seed))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
