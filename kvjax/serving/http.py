"""An OpenAI-compatible HTTP server over kvjax generation (`kvjax serve`), on FastAPI and uvicorn.

Notes: docs/modules.md (`kvjax/serving/http.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvjax.models.loading import Model
from kvjax.policies import Policy, make_policy
from kvjax.policies.options import parse_spec

try:  # the `serve` extra: pip install "kvjax[serve]"
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as error:  # pragma: no cover - the message names the fix
    raise ImportError(f"kvjax serve needs FastAPI and uvicorn: pip install 'kvjax[serve]' ({error})") from None


class APIError(Exception):
    """An error answered as OpenAI's JSON error with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ------------------------------------------------------------------------------------- request bodies


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields this server has no use for (user, ...)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_usage": true}: a last chunk with usage
    n: int = Field(default=1, ge=1, le=1)
    kv_policy: str | dict[str, Any] | None = None
    kv_state: str | None = None  # a saved document's id (`kvjax serve --documents`): the prompt is its question


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# ------------------------------------------------------------------------------------------- the worker


@dataclass(eq=False)
class Job:
    """One request: what to generate and where its text goes (`emit`, from the worker thread), and the
    state of its text stream (token ids so far, text sent, the finish reason a stop string set)."""

    prompt_ids: list[int]
    max_tokens: int
    policy: Policy
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    emit: Any  # callable(kind, payload), thread-safe
    cancelled: threading.Event = field(default_factory=threading.Event)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: str = ""  # text already sent: always a prefix of the final text
    stopped_by_string: bool = False
    document: str | None = None  # answered from this saved document (`kvjax.serving.saved_documents`)

    def flush(self, upto: int) -> None:
        if upto > len(self.sent):
            self.emit("delta", self.text[len(self.sent):upto])
            self.sent = self.text[:upto]


class Worker:
    """Runs the engine on one thread (JAX sees a single caller): takes queued jobs first come, first
    served, submits them, steps the engine while it has work, and streams each job's text."""

    def __init__(self, model: Model, chunk_size: int, page_size: int, steps_per_dispatch: int, max_rows: int = 4,
                 capacity: int = 2048, prefix_cache_mb: int = 256, prefill_chunks_per_step: int = 0, backend=None,
                 documents_dir: str | None = None, disk_cache_mb: int = 0, disk_cache_dir: str | None = None):
        from kvjax.serving.batch_engine import BatchEngine
        from kvjax.serving.saved_documents import SavedDocuments
        from kvjax.util.disk_tier import DiskTier

        self.model = model
        # under the prefix cache's memory budget: what it evicts spills here; kept when an engine is replaced
        self.disk = DiskTier(disk_cache_mb << 20, disk_cache_dir) if disk_cache_mb else None
        self.new_engine = lambda: BatchEngine(model, max_rows=max_rows, capacity=capacity, page_size=page_size,  # noqa: E731
                                              chunk_size=chunk_size, steps_per_dispatch=steps_per_dispatch,
                                              prefix_cache_bytes=prefix_cache_mb << 20,
                                              prefill_chunks_per_step=prefill_chunks_per_step, backend=backend,
                                              disk_cache=self.disk)
        self.engine = self.new_engine()
        # saved documents live in the engine's byte-bounded LRU, beside its prefix states
        self.documents = documents_dir and SavedDocuments(documents_dir, model, self.engine.cache, page_size, backend)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: dict[str, Job] = {}
        self.cancelled = 0  # jobs whose client went away before their end (not started, or stopped mid-stream)
        self.thread = threading.Thread(target=self._loop, name="kvjax-serve", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)
        if self.disk is not None:
            self.disk.close()

    def _loop(self) -> None:
        while True:
            try:  # wait for work only when the engine has none
                job = self.jobs.get(block=not self.engine.has_work)
                while True:
                    if job is None:
                        return
                    self._start(job)
                    job = self.jobs.get_nowait()
            except queue.Empty:
                pass
            if not self.engine.has_work:
                continue
            try:
                self.engine.step()
            except Exception as error:  # reported to every running request; the server goes on with a new engine
                failure = APIError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")
                for job in self.running.values():
                    job.emit("error", failure)
                self.running.clear()
                self.engine = self.new_engine()
                if self.documents:
                    self.documents.lru = self.engine.cache
                continue
            for rid in [rid for rid, job in self.running.items() if self.engine.requests[rid].finished]:
                self._finish(rid)

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.cancelled += 1
            return
        sampling = dict(temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, seed=job.seed,
                        on_tokens=self._on_tokens_of(job))
        try:
            if job.document is not None:
                rid = self.documents.submit(self.engine, job.document, job.prompt_ids, job.max_tokens, **sampling)
            else:
                rid = self.engine.submit(np.asarray(job.prompt_ids, np.int32), job.max_tokens, job.policy, **sampling)
        except FileNotFoundError as error:
            job.emit("error", APIError(404, f"kv_state: {error}", param="kv_state"))
            return
        except ValueError as error:
            job.emit("error", APIError(400, str(error)))
            return
        self.running[rid] = job

    def _on_tokens_of(self, job: Job):
        tokenizer = self.model.tokenizer
        hold = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming

        def on_tokens(request, tokens: list[int]) -> bool:
            job.ids.extend(tokens)
            job.text = tokenizer.decode(job.ids, skip_special_tokens=True)
            hit = min((i for i in (job.text.find(s) for s in job.stop) if i >= 0), default=-1)
            if hit >= 0:
                job.text, job.stopped_by_string = job.text[:hit], True
                return True
            # hold back the characters a stop string could start with, and a character split across tokens
            job.flush(len(job.text.rstrip("\ufffd")) - hold)
            return job.cancelled.is_set()

        return on_tokens

    def _finish(self, rid: str) -> None:
        job, request = self.running.pop(rid), self.engine.requests.pop(rid)
        if request.finish_reason == "error":
            job.emit("error", APIError(400, request.error, param="max_tokens", code="context_length_exceeded"))
            return
        if request.finish_reason == "abort" and not job.stopped_by_string:
            self.cancelled += 1
        job.flush(len(job.text))
        finish = "stop" if job.stopped_by_string or request.finish_reason == "stop" else "length"
        job.emit("done", {"finish_reason": finish, "completion_tokens": len(job.ids)})


# ---------------------------------------------------------------------------------------------- the app


def build_policy(spec: str | dict | None, default: Policy, page_size: int) -> Policy:
    """The request's `kv_policy` (`kvjax.policies.parse_spec`'s grammar, or its JSON object) or `default`,
    validated against the server's `page_size`; APIError naming `kv_policy`."""
    if spec is None:
        return default
    try:
        return parse_spec(spec, page_size=page_size)
    except (ValueError, TypeError) as error:
        raise APIError(400, f"kv_policy: {error}", param="kv_policy") from None


@dataclass
class ServerConfig:
    model_name: str
    default_policy: Policy
    max_context: int  # prompt + max_tokens, at most
    default_max_tokens: int = 16
    chunk_size: int = 512
    page_size: int = 16
    steps_per_dispatch: int = 16
    max_rows: int = 4  # rows of a decode batch: requests served together
    prefix_cache_mb: int = 256  # prefill states kept for prompts sharing whole chunks (0: off)
    prefill_chunks_per_step: int = 0  # prefill chunks between two dispatches (0: whole prompts first)
    backend: Any = None  # the engine's StepBackend (None: one device; `kvjax.distributed.on_mesh`: heads over a mesh)
    documents_dir: str | None = None  # saved states requests may name by id (`kv_state`) instead of sending them
    disk_cache_mb: int = 0  # a disk tier under the prefix cache (0: none), in `disk_cache_dir` (None: a temporary one)
    disk_cache_dir: str | None = None


def create_app(model: Model, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `model` (its worker thread starts now; `app.state.worker.close()` stops it)."""
    if model.tokenizer is None:
        raise ValueError("kvjax serve needs a model with a tokenizer")
    app = FastAPI(title="kvjax", description="OpenAI-compatible completions over kvjax's compressed KV caches")
    worker = Worker(model, config.chunk_size, config.page_size, config.steps_per_dispatch, config.max_rows,
                    config.max_context, config.prefix_cache_mb, config.prefill_chunks_per_step, config.backend,
                    config.documents_dir, config.disk_cache_mb, config.disk_cache_dir)
    app.state.worker = worker
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = where[0] if where else None
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
        return APIError(400, message, param=param).response()

    @app.get("/health")
    async def health():
        disk = worker.disk and {"bytes": worker.disk.bytes, "entries": len(worker.disk),
                                "hit_rate": worker.disk.stats.hit_rate, **dataclasses.asdict(worker.disk.stats)}
        return {"status": "ok", "model": config.model_name, "queued": worker.jobs.qsize(), "running": len(worker.running),
                "disk_cache": disk}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "kvjax"}]}

    def check_model(body: _Sampling) -> None:
        if body.model != config.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")

    def tokens_of_prompt(body: CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of several strings is not supported)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):  # a saved document's question continues it: no special tokens
            return list(model.tokenizer(prompt, add_special_tokens=body.kv_state is None)["input_ids"])
        if any(not 0 <= t < model.cfg.vocab_size for t in prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {model.cfg.vocab_size})", param="prompt")
        return list(prompt)

    def tokens_of_chat(body: ChatBody) -> list[int]:
        if not getattr(model.tokenizer, "chat_template", None):
            raise APIError(400, f"{config.model_name} has no chat template; use /v1/completions", param="messages")
        messages = [m.model_dump() for m in body.messages]
        return list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    def make_job(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, emit) -> Job:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_tokens = max_tokens or config.default_max_tokens
        if len(prompt_ids) + max_tokens > config.max_context:
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds this "
                                f"server's context of {config.max_context} tokens", param="max_tokens",
                           code="context_length_exceeded")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if body.kv_state is not None and (config.documents_dir is None or body.kv_policy is not None):
            raise APIError(400, "kv_state: this server has no saved documents (kvjax serve --documents DIR)"
                           if config.documents_dir is None else "kv_state: a saved document decodes under its saved "
                           "policy; drop kv_policy", param="kv_state")
        return Job(prompt_ids, max_tokens, build_policy(body.kv_policy, config.default_policy, config.page_size), body.temperature,
                   body.top_p, body.top_k, body.seed if body.seed is not None else 0, tuple(s for s in stop if s), emit,
                   document=body.kv_state)

    async def run(body: _Sampling, prompt_ids: list[int], max_tokens: int | None, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = make_job(body, prompt_ids, max_tokens, lambda kind, payload: loop.call_soon_threadsafe(
            events.put_nowait, (kind, payload)))
        worker.submit(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind_name = "chat.completion" if chat else "text_completion"
        usage = lambda n: {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
                           "total_tokens": len(prompt_ids) + n}

        if not body.stream:
            text = []
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    raise payload
                if kind == "delta":
                    text.append(payload)
                    continue
                content = "".join(text)
                choice = ({"index": 0, "message": {"role": "assistant", "content": content}} if chat
                          else {"index": 0, "text": content, "logprobs": None})
                return {"id": rid, "object": kind_name, "created": int(time.time()), "model": config.model_name,
                        "choices": [dict(choice, finish_reason=payload["finish_reason"])],
                        "usage": usage(payload["completion_tokens"])}

        chunk_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                body_delta = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": body_delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": chunk_name, "created": int(time.time()),
                                          "model": config.model_name, "choices": [choice]}) + "\n\n"

        async def stream():
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    kind, payload = await events.get()
                    if kind == "error":
                        body_error = {"error": {"message": payload.message, "type": payload.kind}}
                        yield "data: " + json.dumps(body_error) + "\n\n"
                        return
                    if kind == "delta":
                        yield chunk(payload, None)
                        continue
                    yield chunk(None, payload["finish_reason"])
                    if (body.stream_options or {}).get("include_usage"):  # OpenAI's usage chunk: no choices
                        yield "data: " + json.dumps({"id": rid, "object": chunk_name, "created": int(time.time()),
                                                     "model": config.model_name, "choices": [],
                                                     "usage": usage(payload["completion_tokens"])}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
            finally:
                job.cancelled.set()  # a client that went away stops its generation

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        check_model(body)
        return await run(body, tokens_of_prompt(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        check_model(body)
        return await run(body, tokens_of_chat(body), body.max_completion_tokens or body.max_tokens, chat=True)

    return app


@dataclass
class BackgroundServer:
    """A server running on a thread of this process (tests, benchmarks): `url` is its `/v1` base URL."""

    app: Any
    server: Any  # uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.app.state.worker.close()


def serve_in_background(model: Model, config: ServerConfig, host: str = "127.0.0.1", port: int = 0,
                        timeout: float = 60.0) -> BackgroundServer:
    """Start the server on a thread and return once it accepts connections (port 0: a free port)."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    app = create_app(model, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        app.state.worker.close()
        raise RuntimeError(f"the server did not start within {timeout:g} s")
    return BackgroundServer(app, server, thread, f"http://{host}:{port}/v1")


def serve(model: Model, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted."""
    import uvicorn

    app = create_app(model, config)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        app.state.worker.close()


__all__ = ["APIError", "BackgroundServer", "ServerConfig", "build_policy", "create_app", "serve", "serve_in_background"]
