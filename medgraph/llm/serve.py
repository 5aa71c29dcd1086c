"""A small OpenAI-compatible HTTP server in front of any ChatModel (`medgraph serve-llm`).

It lets HTTP-only clients (another machine, a notebook, the OpenAI backend in
tests) use an in-process model. Concurrent requests are gathered for a few
milliseconds and sent to the model as one batch, so N clients cost about one
batched `generate` instead of N sequential ones. Endpoints:
`POST /v1/chat/completions` (non-streaming), `GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import regex

from medgraph.llm.base import ChatModel, Completion, GenerationConfig, Message
from medgraph.settings import redact_uri

log = logging.getLogger(__name__)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class BadRequest(ValueError):
    """The request cannot be served as sent (HTTP 400 with this message)."""


@dataclass
class _Job:
    conversation: list[Message]
    config: GenerationConfig
    future: Future


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise BadRequest("only text content parts are supported")
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("message content must be a string or a list of text parts")


def parse_chat_request(body: dict[str, object]) -> tuple[list[Message], GenerationConfig]:
    """The conversation and decoding settings of an OpenAI chat-completions request body.

    Defaults follow the OpenAI API (temperature 1, top_p 1), not GenerationConfig's.
    """
    if body.get("stream"):
        raise BadRequest("streaming is not supported; send stream=false")
    if int(body.get("n") or 1) != 1:
        raise BadRequest("only n=1 is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    conversation = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"each message needs a role in {sorted(_ROLES)} and content, got {str(m)[:200]}")
        conversation.append(Message(_ROLES[m["role"]], _content_text(m.get("content", ""))))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
    choices = body.get("guided_choice") or ()  # vLLM's extension: the reply is one of these strings
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) and c for c in choices):
        raise BadRequest("'guided_choice' must be a list of non-empty strings")
    pattern = body.get("guided_regex")  # vLLM's extension: the reply matches this regular expression
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise BadRequest("'guided_regex' must be a non-empty string")
        try:
            regex.compile(pattern)
        except regex.error as error:
            raise BadRequest(f"'guided_regex' is not a regular expression: {error}") from error
    try:
        config = GenerationConfig(
            max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 256),
            temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
            stop=stop,
            seed=int(body["seed"]) if body.get("seed") is not None else None,
            choices=tuple(choices),
            pattern=pattern,
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(f"bad decoding parameter: {error}") from error
    if config.max_new_tokens < 1 or config.temperature < 0 or not 0 < config.top_p <= 1:
        raise BadRequest("need max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")
    return conversation, config


def completion_response(completion: Completion, model: str) -> dict[str, object]:
    """An OpenAI chat.completion object for one Completion."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": completion.text},
            "finish_reason": completion.finish_reason if completion.finish_reason != "error" else "stop",
        }],
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
    }


class _Batcher:
    """One worker thread owns the model: it gathers jobs for `window_s` and generates them together."""

    def __init__(self, model: ChatModel, window_s: float, max_batch_size: int):
        self.model, self.window_s, self.max_batch_size = model, window_s, max_batch_size
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.batches = 0  # generate calls made (tests and logs: did batching happen?)
        self.thread = threading.Thread(target=self._run, name="llm-batcher", daemon=True)
        self.thread.start()

    def submit(self, conversation: list[Message], config: GenerationConfig) -> Completion:
        job = _Job(conversation, config, Future())
        self.jobs.put(job)
        return job.future.result()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, deadline = [first], time.monotonic() + self.window_s
        while len(jobs) < self.max_batch_size:
            try:
                job = self.jobs.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self.jobs.get()
            if first is None:
                return
            jobs, stopping = self._gather(first)
            groups: dict[GenerationConfig, list[_Job]] = {}
            for job in jobs:  # one generate call per distinct decoding setting
                groups.setdefault(job.config, []).append(job)
            for config, group in groups.items():
                try:
                    completions = self.model.generate([j.conversation for j in group], config)
                    self.batches += 1
                except Exception as error:  # every waiting request must hear about it
                    log.exception("generation failed for a batch of %d", len(group))
                    for job in group:
                        job.future.set_exception(error)
                    continue
                for job, completion in zip(group, completions, strict=True):
                    job.future.set_result(completion)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connection
    server: _HttpServer

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            self._send(200, {"status": "ok", "model": self.server.model_name})
        elif path in ("/v1/models", "/models"):
            self._send(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "medgraph"}]})
        else:
            self._error(404, f"no route GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._error(404, f"no route POST {path}")
            return
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            conversation, config = parse_chat_request(body)
        except (json.JSONDecodeError, BadRequest) as error:
            self._error(400, str(error))
            return
        try:
            completion = self.server.batcher.submit(conversation, config)
        except Exception as error:  # noqa: BLE001 - reported to the client as a server error
            self._error(500, f"generation failed: {type(error).__name__}: {error}", "server_error")
            return
        self._send(200, completion_response(completion, self.server.model_name))


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    batcher: _Batcher
    model_name: str


class LlmServer:
    """A running server; `url` is the OpenAI base URL (ending in /v1). Stop it with `shutdown()`."""

    def __init__(self, model: ChatModel, host: str = "127.0.0.1", port: int = 8000, *,
                 batch_window_s: float = 0.01, max_batch_size: int = 32):
        self.model = model
        self._http = _HttpServer((host, port), _Handler)
        self._http.model_name = model.name
        self._http.batcher = _Batcher(model, batch_window_s, max_batch_size)
        self.host, self.port = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), name="llm-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def batches(self) -> int:
        """How many batched `generate` calls the server has made."""
        return self._http.batcher.batches

    def start(self) -> LlmServer:
        self._thread.start()
        log.info("serving %s at %s", self.model.name, redact_uri(self.url))
        return self

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C stops it): for a foreground `serve-llm`."""
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            self.shutdown()

    def shutdown(self) -> None:
        if self._thread.is_alive():  # socketserver's shutdown() waits forever if serve_forever never ran
            self._http.shutdown()
            self._thread.join()
        self._http.server_close()
        self._http.batcher.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve(model: ChatModel, host: str = "127.0.0.1", port: int = 8000, *, batch_window_s: float = 0.01,
          max_batch_size: int = 32) -> LlmServer:
    """Serve `model` over HTTP from a background thread; port 0 picks a free port (see `.url`)."""
    return LlmServer(model, host, port, batch_window_s=batch_window_s, max_batch_size=max_batch_size).start()
