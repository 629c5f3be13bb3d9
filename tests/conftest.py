"""Shared fixtures: tiny random `transformers` models saved to temporary directories (no hub)."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Commands and programs called in-process would switch JAX's persistent compilation cache on for the
# whole test process (its writes crashed the process twice here, in jax's put_executable_and_time): keep
# it off in-process; tests that check the cache run the command in a subprocess with their own folder.
os.environ["KVJAX_COMPILATION_CACHE"] = "off"
# Compiling dominates these tiny runs: XLA:CPU's backend optimisations and its MLIR fusion emitters off for the
# test processes and the commands they start (`FAST_COMPILE`, the sharding and multi-process workers' too).
# The optimisations cut the suite's CPU by about a quarter, the emitters 45% of what was left (30.7 -> 17.0
# CPU-minutes, docs/testing.md); every comparison runs both of its sides under the same flags. Benchmarks, the demo
# and users' runs keep XLA's defaults. KVJAX_TEST_XLA_DEFAULTS=1 runs the suite with them.
if not os.environ.get("KVJAX_TEST_XLA_DEFAULTS"):
    from _simulated_devices import FAST_COMPILE

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import numpy as np
import pytest

# torch is a dev dependency for the transformers references only: the suite's torch-free tests run without
# it, and each test that needs a reference model skips, naming torch, where it is absent
# (`build_hf_model`, the `hf_models` fixture; modules that import torch themselves skip with
# `pytest.importorskip`).
import transformers

VOCAB = 97


def _llama_config(**overrides):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return transformers.LlamaConfig(**base)


def _phi3_config(**overrides):
    rotary_half = 16 // 2
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(rotary_half)],
            "long_factor": [1.0 + 0.9 * i for i in range(rotary_half)],
        },
        rope_theta=10000.0,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Phi3Config(**base)


CONFIGS = {
    "llama_gqa_llama3": lambda: _llama_config(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "llama_yarn": lambda: _llama_config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "llama_linear_tied": lambda: _llama_config(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True, num_key_value_heads=4
    ),
    "phi3_longrope": _phi3_config,
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    ),
    # every layer windowed (12 tokens), as Mistral declares it
    "mistral_sw12": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=12, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        attn_implementation="eager",
    ),
    # Phi-3 slides every layer; Qwen2 only the layers from max_window_layers on
    "phi3_sw8": lambda: _phi3_config(sliding_window=8, rope_scaling=None, attn_implementation="eager"),
    "qwen2_sw8_from1": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        attn_implementation="eager",
    ),
}
MODEL_CLASSES = {"phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM"}


def build_hf_model(name: str, seed: int = 0):
    """A tiny random HF model in float32, eval mode. Weights drawn wider than HF's init so logits differ."""
    torch = pytest.importorskip("torch", reason="the transformers reference models need torch (the dev extra)")
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    cls = getattr(transformers, MODEL_CLASSES[config.model_type])
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (hf model, saved directory). Built lazily, once per session."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (model, str(path))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def mistral(hf_models):
    """(transformers model, kvjax model) of the tiny Mistral with a 12-token window on every layer."""
    import kvjax

    hf, path = hf_models("mistral_sw12")
    return hf, kvjax.load_model(path)


def _abstract_device_mesh(device_kind: str, num_cores: int, platform: str):
    """A context in which lowering targets an abstract device of that kind, or a skip where this JAX's
    private API for it moved."""
    import jax

    try:
        from jax._src.mesh import AbstractDevice

        device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform=platform)
        return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
    except (ImportError, TypeError, AttributeError) as error:
        pytest.skip(f"cannot simulate a {platform} device for lowering here: {error}")


def simulate(platform: str):
    """A context in which lowering targets an abstract device of `platform`: a TPU v5e ("tpu"), so the
    Mosaic lowering knows its target, or an H100 ("cuda"), which Pallas's Triton lowering asks for from JAX
    0.11 on (it stops at "No supported GPU devices found" on a machine without one). Enter it after any
    real computation: from JAX 0.11 on, arrays made inside it ask for `lowering_platforms`."""
    if platform == "tpu":
        return _abstract_device_mesh("TPU v5e", 1, "tpu")
    return _abstract_device_mesh("NVIDIA H100", 132, "cuda")


@pytest.fixture
def simulated_tpu():
    with simulate("tpu"):
        yield


@pytest.fixture
def simulated_gpu():
    with simulate("cuda"):
        yield


def random_tokens(seed: int, shape, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every policy, shape and model compiles its own
    steps; kept for the whole run they exhaust the process's memory maps (vm.max_map_count, 65530 by
    default) and LLVM then crashes the process mid-suite."""
    yield
    import jax

    jax.clear_caches()


# The kernel-parity modules check each kernel's logic against its reference at float32's 1e-5. On a GPU a
# float32 dot defaults to TF32 (about 1e-3 relative), which both sides round differently, so these modules
# run with float32 dots there; tests/test_kernels_native.py checks the default (TF32) precision at TF32's
# tolerance. No effect on a CPU, whose float32 dots are float32 already.
EXACT_DOT_MODULES = ("test_kernels_decode", "test_kernels_quest", "test_kernels_int8")


@pytest.fixture(autouse=True)
def _float32_dots_on_gpu(request):
    import jax

    if jax.default_backend() != "gpu" or request.module.__name__.rsplit(".", 1)[-1] not in EXACT_DOT_MODULES:
        yield
        return
    with jax.default_matmul_precision("float32"):
        yield


# ------------------------------------------------------------------ subprocess checks started early

_BACKGROUND: dict[tuple, object] = {}


def start_background_runs(module, items) -> None:
    """Start every worker run `module` asks for (`BACKGROUND_RUNS`: argument tuple -> the fixture or test
    that takes the run; tests/test_sharding.py) that a selected test of `module` takes and that is not
    running yet, each a separate process."""
    names = {name for item in items if getattr(item, "module", None) is module
             for name in (*getattr(item, "fixturenames", ()), getattr(item, "originalname", None))}
    for args, taker in getattr(module, "BACKGROUND_RUNS", {}).items():
        if taker in names and args not in _BACKGROUND:
            _BACKGROUND[args] = module.start_worker(*args)


# ------------------------------------------------------------------ the quick suite and the whole set

def run_heavy(config) -> bool:
    """Whether the `heavy` tests run: KVJAX_TEST_HEAVY=1 (.ci/run), or a `-m` expression that names them."""
    return os.environ.get("KVJAX_TEST_HEAVY") == "1" or "heavy" in (config.option.markexpr or "")


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items):
    """The quick suite: `python -m pytest` deselects the tests marked `heavy` (a matrix's further cases, long
    checks) unless `run_heavy` (docs/testing.md). Then start the background worker runs of the selected
    tests once collection knows which will run, so they overlap with the other tests; `take_background_run`
    hands a run to its test. KVJAX_TEST_NO_BACKGROUND=1 turns that off. Under pytest-xdist every worker
    collects every test, so each would start every run: there the module's own fixture starts them
    (`_background_runs`), in the one worker that runs the module (`--dist loadfile`), beside one another."""
    if not run_heavy(config):
        heavy = [item for item in items if item.get_closest_marker("heavy")]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if not item.get_closest_marker("heavy")]
    if os.environ.get("KVJAX_TEST_NO_BACKGROUND") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        start_background_runs(module, items)


@pytest.fixture(autouse=True, scope="module")
def _background_runs(request):
    if not os.environ.get("KVJAX_TEST_NO_BACKGROUND"):
        start_background_runs(request.module, request.session.items)


def take_background_run(args: tuple):
    """The background process started for `args`, or None (then the caller runs it itself)."""
    return _BACKGROUND.pop(tuple(args), None)


# ------------------------------------------------------------------ checks CI must not skip

# KVJAX_TEST_REQUIRE="real kvpress lowering corpus" (.ci/run) turns these skips into a failed run: a test that
# skips because the real model is not fetched, kvpress's venv is absent, the installed JAX lacks a Pallas GPU
# backend (or the private API that simulates a GPU or TPU for lowering), or Debian's licence texts (the default
# real-text corpus) are missing, then fails the session. `native` (`kvjax bench device` sets it) does the same
# for the kernels compiled on a GPU or TPU. Each name maps to the words its skip reasons carry
# (tests/test_real_model.py, tests/test_kvpress_crosscheck.py, the lowering tests' `this JAX has no ...`,
# tests/test_real_tasks.py, tests/test_kernels_native.py).
REQUIRED_SKIPS = {
    "real": ("kvjax fetch",),
    "kvpress": ("no kvpress venv",),
    "lowering": ("this JAX has no", "cannot simulate a"),
    "native": ("native kernels need a GPU or TPU",),
    "corpus": ("no Debian licence texts",),
}
_required_skipped: list[str] = []


def _note_required_skip(report) -> None:
    if not report.skipped:
        return
    reason = str(report.longrepr)
    for name in os.environ.get("KVJAX_TEST_REQUIRE", "").split():
        if any(words in reason for words in REQUIRED_SKIPS[name]):
            _required_skipped.append(f"{report.nodeid or report.fspath}: {reason}")


def pytest_configure(config):
    unknown = set(os.environ.get("KVJAX_TEST_REQUIRE", "").split()) - set(REQUIRED_SKIPS)
    if unknown:
        raise pytest.UsageError(f"KVJAX_TEST_REQUIRE names {sorted(unknown)}; known: {' '.join(REQUIRED_SKIPS)}")


def pytest_collectreport(report):
    _note_required_skip(report)


def pytest_runtest_logreport(report):
    _note_required_skip(report)


def pytest_sessionfinish(session, exitstatus):
    for proc in _BACKGROUND.values():  # runs no test claimed (deselected by a marker, a failure before)
        proc.kill()
    if _required_skipped and not os.environ.get("PYTEST_XDIST_WORKER"):
        print("\nKVJAX_TEST_REQUIRE: these checks skipped but are required here:\n  " + "\n  ".join(_required_skipped))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------ CPU seconds per test (eval.bench_tests)

if os.environ.get("KVJAX_TEST_CPU_LOG"):
    import time

    from kvjax.eval.lib.report import own_cpu_seconds as _cpu_seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Append `cpu_s <tab> wall_s <tab> test id` for each test (setup, call, teardown) to
        $KVJAX_TEST_CPU_LOG (every xdist worker appends to the same file)."""
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(os.environ["KVJAX_TEST_CPU_LOG"], "a") as log:
            log.write(f"{_cpu_seconds() - cpu:.2f}\t{time.perf_counter() - wall:.2f}\t{item.nodeid}\n")
