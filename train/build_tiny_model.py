"""Build the tiny Llama that ships with kvjax: HF format (config.json, model.safetensors, tokenizer.json).

Word-level tokenizer (built with the `tokenizers` library) over the passkey task's words, the ten digits
and a few specials; random weights from a fixed seed. It exercises every code path offline; its outputs
are not meaningful text until the trained default model (train/train_tiny_model.py, evaluation issue)
replaces these weights.

    python -m train.build_tiny_model --out kvjax/assets/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from kvjax.tasks.synthetic import VOCABULARY


def build_tokenizer():
    """Word-level tokenizer over `train.synthetic.VOCABULARY` (specials first, then the ten digits)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(VOCABULARY)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    # digits split one by one, so any number is representable
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tokenizer


def fast_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def tiny_config(hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2, intermediate: int | None = None):
    """The shipped model's `LlamaConfig` (tied embeddings, rope_theta 1e4, word-level vocabulary)."""
    from transformers import LlamaConfig

    fast = fast_tokenizer()
    return LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )


def write_model(out: str, hf_config, params, readme: str) -> str:
    """Write an HF-format directory: config.json, model.safetensors, tokenizer files and a README."""
    from safetensors.numpy import save_file

    from kvjax.models.convert import params_to_hf

    os.makedirs(out, exist_ok=True)
    fast_tokenizer().save_pretrained(out)
    hf_config.save_pretrained(out)
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(readme)
    return out


def build(out: str, seed: int = 0, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2) -> str:
    import kvjax

    hf_config = tiny_config(hidden, layers, heads, kv_heads)
    cfg = kvjax.ModelConfig.from_hf_dict(hf_config.to_dict())
    params = kvjax.init_params(cfg, seed=seed, std=0.1)
    readme = (
        "# tiny-llama (random weights)\n\nBuilt by `python -m train.build_tiny_model` (seed "
        f"{seed}): {layers} layers, hidden {hidden}, {heads} query / {kv_heads} kv heads, vocab {cfg.vocab_size} "
        "(word-level). Random weights: it exercises kvjax offline; its text is not meaningful.\n"
    )
    return write_model(out, hf_config, params, readme)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("kvjax", "assets", "tiny-llama"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps({"written": build(args.out, args.seed)}))


if __name__ == "__main__":
    main()
