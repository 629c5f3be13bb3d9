"""Saved states (kvjax.engine.saved_state): a prefill saved, loaded and continued gives the tokens the state
kept in memory gives, for every policy that keeps state and for int8 and bfloat16 pages; refusals by name."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

import kvjax
from kvjax.engine.saved_state import (
    HEADER_FILE, TENSOR_FILE, SavedStateError, generate_from_state, load_state, question_fed, save_state,
)
from policy_cases import QUICK_CASES, matrix_cases, quick_params

PAGE = 8
DOC = np.random.default_rng(48).integers(3, 120, 90).tolist()
QUESTION = [7, 19, 33, 5, 61]
NEW = 6
OPTIONS = {"quest": {"dense_layers": 1}, "snapkv": {"window": 8, "kernel_size": 3}}


@pytest.fixture(scope="module")
def tiny():
    return kvjax.load_model("tiny")


def _prefill_and_save(model, policy, path, **prefill):
    """The document prefilled with room for the question and the answer (as `generate(decode_last=...)` sizes
    it), saved to `path`."""
    state, logits = kvjax.prefill(model, [DOC], policy, page_size=PAGE, max_new_tokens=len(QUESTION) + NEW, **prefill)
    save_state(state, path, model=model, policy=policy, logits=logits, model_name="tiny")
    return state


def _in_memory(model, policy):
    """The same question answered with the state kept in memory: the evaluation's protocol."""
    return kvjax.generate(model, [DOC + QUESTION], NEW, policy, decode_last=len(QUESTION), page_size=PAGE)


# kvzip left out: its scoring pass runs at prefill only and leaves a state like SnapKV's (and costs minutes here)
CASES = [c for c in matrix_cases(kvjax.load_model("tiny").cfg, PAGE) if c.id != "kvzip"
         and (not c.id.startswith("compose-") or c.id in ("compose-snapkv-quest", "compose-h2o-quest"))]


@pytest.mark.slow
# the quick suite: policy_cases.QUICK_CASES and Loki (a key sketch saved and restored); CI all of CASES
@pytest.mark.parametrize("case", quick_params(CASES, [c for c in CASES if c.id in (*QUICK_CASES, "loki")],
                                              ids=lambda c: c.id))
def test_loaded_state_continues_token_for_token(tiny, case, tmp_path):
    state = _prefill_and_save(tiny, case.policy, tmp_path)
    saved = load_state(tmp_path, tiny, policy=case.policy)
    held = np.asarray(state.page_table)
    assert saved.header["pages"] == len(np.unique(held[held >= 0]))  # the pool holds the pages in use only
    assert (np.asarray(saved.state.lengths) == np.asarray(state.lengths)).all()
    np.testing.assert_array_equal(generate_from_state(tiny, saved, QUESTION, NEW), _in_memory(tiny, case.policy))


@pytest.mark.parametrize("kv_dtype,name", quick_params([("int8", "snapkv"), ("int8", "quest"), ("bfloat16", "h2o")],
                                                       [("int8", "snapkv"), ("bfloat16", "h2o")]))
def test_round_trip_keeps_int8_and_bfloat16_pages(tiny, kv_dtype, name, tmp_path):
    model = tiny.with_kv_dtype(kv_dtype)
    policy = kvjax.make_policy(name, token_budget=32, **OPTIONS.get(name, {}))
    _prefill_and_save(model, policy, tmp_path)
    saved = load_state(tmp_path, model)  # the policy rebuilt from the saved spec
    assert saved.state.page_dtype.name == kv_dtype and saved.policy == policy
    np.testing.assert_array_equal(generate_from_state(model, saved, QUESTION, NEW), _in_memory(model, policy))


def test_saved_state_answers_many_questions_unchanged_or_one_in_place(tiny, tmp_path):
    policy = kvjax.make_policy("quest", token_budget=32, dense_layers=1)
    _prefill_and_save(tiny, policy, tmp_path)
    on_disk = {name: (tmp_path / name).read_bytes() for name in (HEADER_FILE, TENSOR_FILE)}
    saved = load_state(tmp_path, tiny)
    first = generate_from_state(tiny, saved, QUESTION, NEW)
    generate_from_state(tiny, saved, [9, 9, 9], NEW)
    np.testing.assert_array_equal(generate_from_state(tiny, saved, QUESTION, NEW), first)
    # no question: the first token comes from the saved prefill logits
    np.testing.assert_array_equal(generate_from_state(tiny, saved, [], 1), kvjax.generate(tiny, [DOC], 1, policy, page_size=PAGE))

    # loaded for one question (`kvjax generate --state`): decode takes the loaded pool over, no copy
    once = load_state(tmp_path, tiny, once=True)
    pool = once.state.k_pages.unsafe_buffer_pointer()
    fed, _ = question_fed(tiny, once, QUESTION, NEW)
    if jax.default_backend() == "cpu":  # elsewhere the host's pool is copied onto the device by device_put
        assert fed.k_pages.unsafe_buffer_pointer() == pool  # donated in place: read into the device's own memory
    with pytest.raises(ValueError, match="loaded with once=True and has answered its question"):
        generate_from_state(tiny, once, QUESTION, NEW)
    np.testing.assert_array_equal(generate_from_state(tiny, load_state(tmp_path, tiny, once=True), QUESTION, NEW), first)
    # the state kept in memory answers as before, and the files are untouched
    np.testing.assert_array_equal(generate_from_state(tiny, saved, QUESTION, NEW), first)
    assert {name: (tmp_path / name).read_bytes() for name in on_disk} == on_disk


@pytest.fixture(scope="module")
def saved_snapkv(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("snapkv")
    _prefill_and_save(tiny, kvjax.make_policy("snapkv", token_budget=32, **OPTIONS["snapkv"]), path)
    return path


def _damaged(source, tmp_path, damage):
    import shutil

    target = tmp_path / "state"
    shutil.copytree(source, target)
    damage(target)
    return target


def _truncate(path):
    file = path / TENSOR_FILE
    file.write_bytes(file.read_bytes()[: os.path.getsize(file) // 2])


def _flip_byte(path):
    data = bytearray((path / TENSOR_FILE).read_bytes())
    data[-3] ^= 0xFF
    (path / TENSOR_FILE).write_bytes(bytes(data))


def _flip_header_byte(path):  # inside the safetensors header: its JSON no longer parses
    data = bytearray((path / TENSOR_FILE).read_bytes())
    data[9] = ord("#")
    (path / TENSOR_FILE).write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (_truncate, "truncated"),
    (_flip_byte, "corrupt \\(checksum"),
    (_flip_header_byte, "corrupt \\(safetensors header"),
    (lambda p: (p / HEADER_FILE).write_text('{"format": "kvjax.saved_state", "vers'), "corrupt header"),
    (lambda p: os.remove(p / TENSOR_FILE), "state.safetensors is missing"),
])
def test_damaged_files_are_refused_by_name(tiny, saved_snapkv, tmp_path, damage, message):
    with pytest.raises(SavedStateError, match=message):
        load_state(_damaged(saved_snapkv, tmp_path, damage), tiny)


def test_states_saved_with_older_checksums_are_still_checked(tiny, saved_snapkv, tmp_path):
    import json
    import shutil

    from kvjax.util.tensor_file import file_checksum

    current = load_state(saved_snapkv, tiny)
    for kind in ("crc32", "blake2b"):  # format version 1's checksums (before xxh3-64)
        older = tmp_path / kind
        shutil.copytree(saved_snapkv, older)
        header = json.loads((older / HEADER_FILE).read_text())
        header.update(version=1, checksum={kind: file_checksum(older / TENSOR_FILE, kind), "bytes": header["checksum"]["bytes"]})
        (older / HEADER_FILE).write_text(json.dumps(header))
        loaded = load_state(older, tiny)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(current.state)))
        _flip_byte(older)
        with pytest.raises(SavedStateError, match=f"corrupt \\(checksum {kind} "):
            load_state(older, tiny)
    header["checksum"] = {"md5": "0", "bytes": header["checksum"]["bytes"]}
    (older / HEADER_FILE).write_text(json.dumps(header))
    with pytest.raises(SavedStateError, match="names no checksum this kvjax knows"):
        load_state(older, tiny)


def test_another_model_is_refused(tiny, saved_snapkv):
    other_config = dataclasses.replace(tiny, cfg=dataclasses.replace(tiny.cfg, rms_norm_eps=1e-5))
    with pytest.raises(SavedStateError, match="saved for another model \\(tiny, config"):
        load_state(saved_snapkv, other_config)
    other_weights = dataclasses.replace(tiny, params=jax.tree.map(lambda x: x * 1.01, tiny.params))
    with pytest.raises(SavedStateError, match="another model's weights"):
        load_state(saved_snapkv, other_weights)


def test_another_page_size_or_page_dtype_is_refused(tiny, saved_snapkv):
    with pytest.raises(SavedStateError, match="saved with page size 8, page size 16 was asked for"):
        load_state(saved_snapkv, tiny, page_size=16)
    with pytest.raises(SavedStateError, match="float32 pages, int8 pages were asked for"):
        load_state(saved_snapkv, tiny, page_dtype="int8")


def test_a_policy_that_cannot_continue_is_refused(tiny, saved_snapkv, tmp_path):
    with pytest.raises(SavedStateError, match="policy .*'h2o'.* cannot continue"):
        load_state(saved_snapkv, tiny, policy=kvjax.make_policy("h2o", token_budget=32))
    with pytest.raises(SavedStateError, match="cannot continue"):  # the same method at another budget
        load_state(saved_snapkv, tiny, policy=kvjax.make_policy("snapkv", token_budget=64, **OPTIONS["snapkv"]))
    heads = matrix_cases(tiny.cfg, PAGE)[[c.id for c in matrix_cases(tiny.cfg, PAGE)].index("locret")].policy.heads
    _prefill_and_save(tiny, kvjax.make_policy("locret", token_budget=32, local_tail=8, stabilizers=4, heads=heads), tmp_path)
    with pytest.raises(SavedStateError, match="cannot rebuild policy 'locret' .*heads= is required"):
        load_state(tmp_path, tiny)
    assert load_state(tmp_path, tiny, heads=heads).policy.name == "locret"  # its data given back


def test_a_question_past_the_room_is_refused_before_any_work(tiny, saved_snapkv):
    saved = load_state(saved_snapkv, tiny)
    with pytest.raises(kvjax.CacheCapacityError, match=f"room for {saved.room}; load it with extra_tokens="):
        generate_from_state(tiny, saved, QUESTION, saved.room)
    roomy = load_state(saved_snapkv, tiny, extra_tokens=saved.room + 40)  # a wider pool and read bound
    assert roomy.state.num_pages > saved.state.num_pages
    assert generate_from_state(tiny, roomy, QUESTION, saved.room).shape == (1, saved.room)


@pytest.mark.slow  # about 30 s of CPU: compiles for one device and for a 2x2 mesh
def test_a_state_moves_between_one_device_and_a_mesh():
    """tests/_saved_state_mesh_worker.py on 4 simulated CPU devices (a subprocess: XLA_FLAGS before jax starts)."""
    import json
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_saved_state_mesh_worker.py")
    run = subprocess.run([sys.executable, worker], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["devices"] == out["pool_devices"] == 4
    assert out["pool_shard_shape"][:2] == [1, 1]  # one pool per (data shard, head shard)
    assert out["loaded_on_mesh_reads_the_same"]  # each head reads the pages it read on one device
    assert out["saved_on_mesh_reads_the_same"]  # the shards' pools merged into one, exactly
    assert out["loaded_on_mesh"] == out["reference"] == out["saved_on_mesh"]
    assert "2 sequences and 2 kv heads cannot split over 4 data" in out["indivisible"]
    assert out["cli_code"] == 0 and out["cli_mesh"] == out["cli_expected"]


@pytest.mark.slow
def test_cli_prefill_then_generate_from_the_saved_state(tiny, tmp_path, capsys):
    import json

    from kvjax.cli import main

    document, question = "The secret code is blue seven. " * 3, " The secret code is"
    doc_ids = tiny.tokenizer(document)["input_ids"]
    q_ids = tiny.tokenizer(question, add_special_tokens=False)["input_ids"]
    option = ["--policy", "snapkv", "--policy-option", "token_budget=16", "--policy-option", "window=4"]
    assert main(["prefill", "--prompt", document, "--save", str(tmp_path), *option, "--room", str(len(q_ids) + NEW),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(doc_ids)
    assert main(["generate", "--state", str(tmp_path), "--prompt", question, "--max-new-tokens", str(NEW), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    policy = kvjax.make_policy("snapkv", token_budget=16, window=4)
    expected = kvjax.generate(tiny, [doc_ids + q_ids], NEW, policy, decode_last=len(q_ids))[0]
    assert answer["token_ids"] == [int(t) for t in expected if t >= 0]
    assert main(["generate", "--state", str(tmp_path / "absent"), "--prompt", "x"]) == 2
    assert "no saved state here" in capsys.readouterr().err


@pytest.mark.slow
def test_server_answers_concurrent_questions_from_a_saved_document(tiny, tmp_path):
    import threading

    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from kvjax.serving.http import ServerConfig, serve_in_background

    policy = kvjax.make_policy("snapkv", token_budget=32, **OPTIONS["snapkv"])
    _prefill_and_save(tiny, policy, tmp_path / "report")
    saved = load_state(tmp_path / "report", tiny)
    questions = ["alpha 12 beta", "gamma 56", "alpha 12 beta"]
    expected = []
    for question in questions:
        ids = tiny.tokenizer(question, add_special_tokens=False)["input_ids"]
        tokens = generate_from_state(tiny, saved, ids, NEW)[0]
        expected.append(tiny.tokenizer.decode([int(t) for t in tokens if t >= 0], skip_special_tokens=True))
    running = serve_in_background(tiny, ServerConfig("tiny", kvjax.make_policy("full"), max_context=1024, page_size=PAGE,
                                                     steps_per_dispatch=4, documents_dir=str(tmp_path),
                                                     prefix_cache_mb=0, disk_cache_mb=64))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
        answers = [None] * len(questions)

        def ask(i):
            reply = client.completions.create(model="tiny", prompt=questions[i], max_tokens=NEW, temperature=0,
                                              extra_body={"kv_state": "report"})
            answers[i] = reply.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert answers == expected
        stats = running.app.state.worker.documents.stats
        assert (stats.loads, stats.lookups) == (1, 3)  # loaded once, then served from the engine's cache
        import json
        import urllib.request

        with urllib.request.urlopen(running.url.removesuffix("/v1") + "/health") as reply:
            disk = json.load(reply)["disk_cache"]
        assert disk["hits"] == 2 and disk["entries"] == 1  # no memory budget: the state lives on the disk tier
        with pytest.raises(openai.NotFoundError, match="no saved document 'absent'"):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"kv_state": "absent"})
        with pytest.raises(openai.BadRequestError, match="room"):
            client.completions.create(model="tiny", prompt="x", max_tokens=saved.room, extra_body={"kv_state": "report"})
    finally:
        running.stop()
