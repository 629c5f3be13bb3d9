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

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = (
    "the grass is green . sky blue sun yellow here we go there and back again pass key remember it "
    "what ? one of special magic numbers for : a an in on at to of no yes answer question context"
).split()
DIGITS = [str(d) for d in range(10)]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(SPECIALS + DIGITS + WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    # digits split one by one, so any number is representable
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tokenizer


def build(out: str, seed: int = 0, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2) -> str:
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    import kvjax
    from kvjax.models.convert import params_to_hf

    os.makedirs(out, exist_ok=True)
    tokenizer = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    vocab_size = tokenizer.get_vocab_size()
    hf_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
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
    hf_config.save_pretrained(out)
    cfg = kvjax.ModelConfig.from_pretrained(out)
    params = kvjax.init_params(cfg, seed=seed, std=0.1)
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params).items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(
            "# tiny-llama (random weights)\n\nBuilt by `python -m train.build_tiny_model` (seed "
            f"{seed}): {layers} layers, hidden {hidden}, {heads} query / {kv_heads} kv heads, vocab {vocab_size} "
            "(word-level). Random weights: it exercises kvjax offline; its text is not meaningful.\n"
        )
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("kvjax", "assets", "tiny-llama"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps({"written": build(args.out, args.seed)}))


if __name__ == "__main__":
    main()
