"""Runs inside the kvpress venv (torch, transformers < 5.3, kvpress 0.5.x; no jax, no kvjax).

Builds a tiny random Llama, saves it, prefills one prompt under each press and writes, per press, the
kept positions and the press's scores per (layer, kv head) as JSON. `eval/kvpress_crosscheck.py` calls it.
"""

import json
import sys

import torch
from kvpress import AdaKVPress, ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def build_model(out_dir: str, seed: int, num_layers: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    model.config._attn_implementation = "sdpa"
    return model


class AccumulatedAttentionPress(ObservedAttentionPress):
    """ObservedAttentionPress with its per-key mean undone: each key's attention summed over the queries that
    see it (H2O's accumulated score), not divided by their number. The group mean is kvpress's."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        mean = super().score(module, hidden_states, keys, values, attentions, kwargs)
        n_tokens = keys.shape[2]
        return mean * torch.arange(n_tokens, 0, -1).to(mean.device, mean.dtype)


EAGER = {"observed_attention", "h2o_accumulated"}  # presses that read the weights


def presses(ratio: float, window: int, kernel: int, alpha: float, pyramid_beta: float):
    return {
        "snapkv": SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel),
        "streaming": StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "tova": TOVAPress(compression_ratio=ratio),
        "adakv_snapkv": AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel),
                                   alpha_safeguard=alpha),
        "pyramidkv": PyramidKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel,
                                    beta=pyramid_beta),
        "pyramidkv_beta20": PyramidKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel, beta=20),
        "h2o_accumulated": AccumulatedAttentionPress(compression_ratio=ratio),
        "observed_attention": ObservedAttentionPress(compression_ratio=ratio),
    }


def layer_keys(cache, layer):
    return cache.layers[layer].keys[0]  # [H, T, D]


def main():
    spec = json.loads(sys.argv[1])
    model = build_model(spec["model_dir"], spec["seed"], spec["num_layers"])
    ids = torch.tensor([spec["prompt"]], dtype=torch.long)
    fulls = {}
    for implementation in ("sdpa", "eager"):
        model.config._attn_implementation = implementation
        with torch.no_grad():
            fulls[implementation] = DynamicCache(config=model.config)
            model(ids, past_key_values=fulls[implementation], use_cache=True)
    out = {}
    for name, press in presses(spec["ratio"], spec["window"], spec["kernel"], spec["alpha"],
                               spec["pyramid_beta"]).items():
        model.config._attn_implementation = "eager" if name in EAGER else "sdpa"
        full = fulls[model.config._attn_implementation]
        scorer = press.press if isinstance(press, AdaKVPress) else press
        recorded = {}
        original = scorer.score

        def score(module, *args, _original=original, _recorded=recorded):
            s = _original(module, *args)
            _recorded[module.layer_idx] = s[0].float().tolist()
            return s

        scorer.score = score
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), press(model):
            model(ids, past_key_values=cache, use_cache=True)
        kept = []
        for layer in range(model.config.num_hidden_layers):
            attn = model.model.layers[layer].self_attn
            per_head = []
            if isinstance(press, AdaKVPress):
                _, heads, seqs = attn.masked_key_indices
                T = ids.shape[1]
                for h in range(model.config.num_key_value_heads):
                    masked = set(seqs[heads == h].tolist())
                    per_head.append([t for t in range(T) if t not in masked])
            else:
                reference, pressed = layer_keys(full, layer), layer_keys(cache, layer)
                for h in range(reference.shape[0]):
                    # pressed keys are gathered from the same forward's keys: each equals one prompt key
                    distance = (pressed[h].double()[:, None, :] - reference[h].double()[None]).abs().amax(-1)
                    assert float(distance.min(-1).values.max()) < 1e-6, "a kept key matches no prompt key"
                    per_head.append(sorted(distance.argmin(-1).tolist()))
            kept.append(per_head)
        out[name] = {"kept": kept, "scores": [recorded[l] for l in sorted(recorded)]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
