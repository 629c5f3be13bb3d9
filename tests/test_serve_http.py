"""`kvjax serve`: the OpenAI-compatible server answers the official `openai` client on 127.0.0.1.

The server runs in a thread of this process (uvicorn on a free port) over the shipped tiny model; its
answers are compared with `kvjax.generate` on the same tokens and policy.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvjax

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from kvjax.serving.http import ServerConfig, serve_in_background  # noqa: E402
from policy_cases import quick_params  # noqa: E402

NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model():
    return kvjax.load_model("tiny")


@pytest.fixture(scope="module")
def running(model):
    model.tokenizer.chat_template = CHAT_TEMPLATE  # the tiny model's tokenizer has none
    running = serve_in_background(model, ServerConfig(NAME, kvjax.make_policy("full"), max_context=1024,
                                                      steps_per_dispatch=4))
    yield running
    running.stop()
    model.tokenizer.chat_template = None


@pytest.fixture(scope="module")
def server(running):
    return running.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def expected(model, ids, max_new, policy=None, **sampling):
    tokens = kvjax.generate(model, [ids], max_new, policy, **sampling)[0]
    return model.tokenizer.decode([int(t) for t in tokens if t >= 0], skip_special_tokens=True)


PROMPT = "alpha 12 beta 34 gamma 56 alpha"


def test_completion_equals_generate(model, client):
    ids = model.tokenizer(PROMPT)["input_ids"]
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected(model, ids, 12)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens <= 12
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_sampling_and_kv_policy_per_request(model, client):
    ids = model.tokenizer(PROMPT)["input_ids"]
    quest = kvjax.make_policy("quest", token_budget=32, dense_layers=0)
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0.8, top_p=0.9, seed=7,
                                      extra_body={"kv_policy": "quest:token_budget=32,dense_layers=0", "top_k": 20})
    assert reply.choices[0].text == expected(model, ids, 10, quest, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    as_object = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0.8, top_p=0.9,
                                          seed=7, extra_body={"kv_policy": {"name": "quest", "token_budget": 32,
                                                                            "dense_layers": 0}, "top_k": 20})
    assert as_object.choices[0].text == reply.choices[0].text


def test_streamed_chat_equals_the_whole_answer(model, client):
    messages = [{"role": "user", "content": PROMPT}]
    ids = list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected(model, ids, 12)
    parts, finishes = [], []
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True):
        parts.append(chunk.choices[0].delta.content or "")
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == whole.choices[0].message.content
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])


def test_stop_strings_cut_the_text(model, client):
    ids = model.tokenizer(PROMPT)["input_ids"]
    free = expected(model, ids, 12)
    stop = free.strip()[:2]
    assert stop, f"nothing generated to stop on: {free!r}"
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert reply.choices[0].text == free[: free.find(stop)] and reply.choices[0].finish_reason == "stop"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    import json
    import urllib.request

    with urllib.request.urlopen(server + "/health", timeout=30) as response:
        assert json.load(response)["status"] == "ok"


@pytest.mark.parametrize("kwargs, param, status", [
    (dict(temperature=-1.0), "temperature", 400),
    (dict(max_tokens=0), "max_tokens", 400),
    (dict(max_tokens=2000), "max_tokens", 400),  # past the server's 1024-token context
    (dict(extra_body={"kv_policy": "nonsense"}), "kv_policy", 400),
    (dict(extra_body={"kv_policy": "quest:token_budget=abc"}), "kv_policy", 400),
    (dict(model="other"), "model", 404),
])
def test_bad_requests_get_json_errors_naming_the_field(client, kwargs, param, status):
    kwargs = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code == status
    error = info.value.body if isinstance(info.value.body, dict) else {}
    assert error.get("param") == param, info.value.body


@pytest.mark.parametrize("spec", quick_params(["key_int4:token_budget=64", "loki:token_budget=64", "quest:token_budget=64",
                                               "quest_adaptive:token_budget=64", "quest_static:token_budget=64"],
                                              ["key_int4:token_budget=64", "quest:token_budget=64"]))
def test_every_selector_answers_as_generate(model, client, spec):
    """A selector given by name in a request (here selecting in layers 2 and 3 of the tiny model's 4, over a
    prompt of 4 pages a head) answers what `generate` gives; the key sketch selectors answered 500 ("needs the
    state's key sketch") before the batch engine carried each row's sketch."""
    prompt = " ".join([PROMPT] * 6)
    ids = model.tokenizer(prompt)["input_ids"]
    name, budget = spec.split(":token_budget=")
    policy = kvjax.make_policy(name, token_budget=int(budget))
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"kv_policy": spec})
    assert len(ids) > 3 * 16 and reply.choices[0].text == expected(model, ids, 8, policy)


def test_concurrent_requests_queue_and_all_finish(model, server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [f"alpha {i} beta {i + 1}" for i in range(6)]
    results = [None] * len(prompts)

    def ask(i):
        results[i] = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for p, got in zip(prompts, results):
        assert got == expected(model, model.tokenizer(p)["input_ids"], 6)


def test_a_client_gone_mid_stream_stops_its_generation_and_frees_its_pages(model, running, client):
    """A streaming client closes its stream after its first text (`eval/bench_load.py --soak` does it at
    scale): the server stops that generation, every page goes back, and the next answer is `generate`'s."""
    from kvjax.eval.bench_load import ask, wait_idle

    worker = running.app.state.worker
    before = worker.cancelled
    ids = model.tokenizer(PROMPT)["input_ids"]
    assert ask(client, NAME, ids, 400, disconnect_after=1)["disconnected"]
    wait_idle(worker, 120)
    engine = worker.engine
    assert worker.cancelled == before + 1
    assert engine.leaked_pages == 0 and not any(b.pool.live_pages() for b in engine.batches.values())
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected(model, ids, 12)


def test_a_small_soak_loses_nothing_and_leaks_no_page(model):
    """`eval/bench_load.py --soak` in small: 8 streamed requests from 4 clients over two policies, every
    fourth client gone after its first text, probes alone before, under load and after: nothing lost, no
    page held once idle, no engine restart, every probe answered as alone (the server's shapes are
    `running`'s: its programs are compiled already)."""
    from kvjax.eval.bench_load import make_trace, parse_args, run_soak, soak_failures

    args = parse_args(["--soak", "--requests", "8", "--concurrency", "4", "--capacity", "1024", "--steps-per-dispatch",
                       "4", "--prompt-min", "8", "--prompt-max", "40", "--output-min", "8", "--output-max", "12",
                       "--soak-policies", "full", "quest:token_budget=64", "--disconnect-every", "4",
                       "--probe-every", "4", "--timeout", "300"])
    soak = run_soak(model, make_trace(args, model.cfg.vocab_size), args)
    assert soak_failures(soak) == [] and soak["completed"] == 6 and soak["disconnected"] == 2, soak
    assert soak["probes_same_under_load"][1] >= 2 and soak["server_cancelled"] >= 1, soak
