"""Checkpoint loading: sharded and single files, clear errors, the shipped model, the CLI."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from conftest import random_tokens
from kvjax.cli import main as cli_main
from kvjax.models.hub import shipped_model_dir
from kvjax.models.convert import params_to_hf


def _torch():
    """torch for the tests that compare with transformers (the dev extra); the rest run without it."""
    return pytest.importorskip("torch", reason="compares with transformers, which runs on torch (the dev extra)")


def test_sharded_checkpoint_with_index(hf_models, tmp_path):
    torch = _torch()
    hf, _ = hf_models("llama_gqa_llama3")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = kvjax.load_model(tmp_path)
    tokens = random_tokens(5, (1, 20))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), ref, atol=1e-4, rtol=0)


def test_round_trip_of_parameter_names(hf_models):
    hf, path = hf_models("phi3_longrope")
    exported = params_to_hf(kvjax.load_model(path).params)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(exported) == set(state)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, state[name])


def _copy(path, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(path, target)
    return target


def _rewrite_tensors(target, edit):
    from safetensors.numpy import load_file, save_file

    file = target / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    target = _copy(shipped_model_dir(), tmp_path)

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = np.zeros(3, np.float32)

    _rewrite_tensors(target, edit)
    with pytest.raises(kvjax.CheckpointError) as info:
        kvjax.load_model(target)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in str(info.value)
    assert "unexpected tensors: model.layers.1.mlp.extra.weight" in str(info.value)


def test_shape_mismatch_names_both_shapes(tmp_path):
    target = _copy(shipped_model_dir(), tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] = 320
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(kvjax.CheckpointError, match=r"mlp.up_proj.weight: checkpoint has \(512, 128\), config implies \(320, 128\)"):
        kvjax.load_model(target)


def test_unknown_model_type_and_missing_dir(tmp_path):
    target = _copy(shipped_model_dir(), tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "gpt2"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown model_type 'gpt2'.*supported: llama, mistral, qwen2, phi3"):
        kvjax.load_model(target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvjax.load_model(tmp_path / "nowhere")


def test_config_reads_transformers_4_spelling():
    from kvjax.models.config import ModelConfig

    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=128)
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}})
    assert old == new and old.rope.theta == 5e5 and old.rope.rope_type == "linear"


def test_shipped_model_matches_transformers():
    torch = _torch()
    from transformers import LlamaForCausalLM

    path = shipped_model_dir()
    model = kvjax.load_model(path)
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    tokens = np.asarray([model.tokenizer("the pass key is 123 . remember it")["input_ids"]])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(kvjax.forward_logits(model, tokens)), ref, atol=1e-4, rtol=0)


def test_cli_generate_json(tmp_path):
    # a subprocess, so the persistent compilation cache it turns on stays out of this test process
    env = {**os.environ, "KVJAX_COMPILATION_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kvjax.cli", "generate", "--prompt", "the pass key is 42 .", "--max-new-tokens", "5", "--json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == 8 and len(out["token_ids"]) == 5
    model = kvjax.load_model(shipped_model_dir())
    expected = kvjax.generate(model, [model.tokenizer("the pass key is 42 .")["input_ids"]], 5)[0]
    assert out["token_ids"] == [int(t) for t in expected if t >= 0]
    # every compiled program is written (kvjax sets no minimum compile time or size): a second run that
    # compiles nothing again writes no new entry, and gives the same tokens
    written = set(os.listdir(tmp_path / "cache"))
    assert written, "the persistent compilation cache stayed empty"
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["token_ids"] == out["token_ids"]
    assert set(os.listdir(tmp_path / "cache")) == written, "the second run compiled programs the cache did not hold"


def test_cli_reports_bad_input(capsys):
    assert cli_main(["generate", "--model", "/nonexistent/model", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("option, message", [
    ("token_budget=abc", "option token_budget='abc': expected int"),
    ("budget=3", "policy 'quest' has no option 'budget'"),
    ("per_kv_head=maybe", "option per_kv_head='maybe': expected bool"),
    ("token_budget", "must be KEY=VALUE"),
])
def test_cli_parses_policy_options_by_field_type(capsys, option, message):
    argv = ["generate", "--prompt", "x", "--policy", "quest", "--policy-option", option]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_policy_options_take_the_field_types():
    from kvjax.policies.options import parse_policy_options

    options = parse_policy_options("quest", ["token_budget=96", "per_kv_head=true", "page_size=none"])
    assert options == {"token_budget": 96, "per_kv_head": True, "page_size": None}
    assert kvjax.make_policy("quest", **options).token_budget == 96


def test_prompt_past_the_context_is_refused_before_work():
    model = kvjax.load_model(shipped_model_dir())
    limit = model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"model's context is {limit}.*allow_longer_context=True"):
        kvjax.generate(model, [[5] * (limit + 10)], max_new_tokens=4)
    with pytest.raises(ValueError, match="allow_longer_context"):
        kvjax.prefill(model, [[5] * (limit + 1)])
    with pytest.raises(ValueError, match="plus max_new_tokens"):
        kvjax.generate(model, [[5] * (limit - 2)], max_new_tokens=8)


def test_truncated_safetensors_is_named(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(shipped_model_dir(), copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(kvjax.CheckpointError, match="model.safetensors"):
        kvjax.load_model(copy)
