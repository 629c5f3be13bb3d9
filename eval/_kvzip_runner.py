"""Runs inside the kvpress venv (no jax, no kvjax): KVzipPress on a tiny random Llama with a character tokenizer.

Saves the model and tokenizer, prefills one prompt under each KVzip case and writes, per case, the kept
positions and the press's scores per (layer, kv head) as JSON. `eval/kvzip_crosscheck.py` calls it.
"""

import json
import sys

import torch
from kvpress import KVzipPress
from _kvpress_runner import build_model  # this script's folder is on the path
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast


def build(out_dir: str, seed: int, num_layers: int):
    """The cross-check's random Llama (`_kvpress_runner.build_model`) and a character tokenizer without a chat
    template (printable ASCII and newline: KVzip's instruction), saved to `out_dir`."""
    model = build_model(out_dir, seed, num_layers)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(out_dir)
    model.config._name_or_path = out_dir  # where KVzipPress loads its tokenizer from
    return model


def main():
    spec = json.loads(sys.argv[1])
    model = build(spec["model_dir"], spec["seed"], spec["num_layers"])
    ids = torch.tensor([spec["prompt"]], dtype=torch.long)
    T, H = ids.shape[1], model.config.num_key_value_heads
    out = {}
    for name, options in spec["cases"].items():
        press = KVzipPress(compression_ratio=spec["ratio"], **options)
        recorded = {}
        original = press.compress_post

        def compress_post(model, _original=original, _press=press, _recorded=recorded):
            _original(model)  # raises the sinks' scores above every other, then masks the pruned keys
            _recorded["scores"] = _press.score_val[:, 0].float().tolist()  # [L, H, T]

        press.compress_post = compress_post
        with torch.no_grad(), press(model):
            model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        kept = []
        for layer in model.model.layers:
            _, heads, seqs = layer.self_attn.masked_key_indices
            masked = [set(seqs[heads == h].tolist()) for h in range(H)]
            kept.append([[t for t in range(T) if t not in masked[h]] for h in range(H)])
        out[name] = {"kept": kept, "scores": recorded["scores"]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
