"""Chat backend for any OpenAI-compatible server: vLLM, llama.cpp server, Ollama, OpenAI itself.

A batch of conversations becomes concurrent `/chat/completions` requests (a
thread pool): a vLLM server batches them on its side, which is where its
throughput comes from. Transient failures (connection errors, timeouts, 429,
5xx) are retried with exponential backoff; any other 4xx is a configuration
mistake (wrong model name, missing key) and fails at once with the status, the
URL and the server's own message.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import requests

from medgraph.llm.base import (
    ChatModel,
    Completion,
    Conversation,
    GenerationConfig,
    check_no_graph_tokens,
    truncate_at_stop,
)
from medgraph.settings import redact_uri

API_KEY_VARIABLES = ("MEDGRAPH_LLM_API_KEY", "OPENAI_API_KEY")  # the first one set wins
_FINISH = {"stop": "stop", "length": "length", "eos": "stop", "tool_calls": "stop", "content_filter": "stop"}


class LlmRequestError(RuntimeError):
    """A request to an LLM server failed for good (after retries, or a 4xx that retrying cannot fix). Its
    message and URL never show credentials (`redact_uri`): they are printed and logged."""

    def __init__(self, message: str, status: int | None = None, url: str = ""):
        super().__init__(redact_uri(message))
        self.status, self.url = status, redact_uri(url)


def api_key_from_env(env: dict[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return next((env[v] for v in API_KEY_VARIABLES if env.get(v)), None)


def _server_message(response: requests.Response) -> str:
    """The server's own explanation: OpenAI-style `{"error": {"message": ...}}`, else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500].strip() or response.reason or ""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str):
        return error
    if isinstance(body, dict) and body.get("detail"):  # FastAPI (vLLM) validation errors
        return str(body["detail"])[:500]
    return str(body)[:500]


CHAT_REPLY_SHAPE = '{"choices": [{"message": {"content": "..."}, "finish_reason": "..."}], "usage": {...}}'


def _chat_choice(reply: object, url: str) -> tuple[dict, str | None, dict]:
    """The first choice's message, its finish reason and the usage of a chat-completion reply; any other shape (a
    list, null, choices that are not objects) is an LlmRequestError naming the server and the shape expected."""
    def wrong(what: str) -> LlmRequestError:
        return LlmRequestError(f"POST {url}: the reply is not an OpenAI chat completion ({what}; expected "
                               f"{CHAT_REPLY_SHAPE}): {str(reply)[:300]}", url=url)

    if not isinstance(reply, dict):
        raise wrong(f"a JSON {type(reply).__name__}, not an object")
    choices = reply.get("choices")
    if not choices:
        raise wrong("no choices")
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise wrong("choices is not a list of objects")
    message = choices[0].get("message") or {}
    if not isinstance(message, dict):
        raise wrong("the choice's message is not an object")
    usage = reply.get("usage") or {}
    if not isinstance(usage, dict):
        raise wrong("usage is not an object")
    return message, choices[0].get("finish_reason"), usage


def _message_text(content: object) -> str:
    """`message.content` as text: a string, or a list of content parts (newer servers)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class OpenAIChatModel(ChatModel):
    """Completions from an OpenAI-compatible `/v1/chat/completions` endpoint."""

    def __init__(self, model: str, base_url: str, *, api_key: str | None = None, timeout_s: float = 120.0,
                 max_retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 20.0, concurrency: int = 8,
                 raise_on_error: bool = True, name: str | None = None, guided_choice: bool = True):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.model_id = model  # the server's name for it (`model` in each request)
        self.name = name or model
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.timeout_s, self.max_retries, self.concurrency = timeout_s, max_retries, concurrency
        # time.monotonic() by which every request must have ended (the caller's own time limit, e.g.
        # `medgraph ask --timeout`): each request waits at most until then, and no retry starts after it.
        self.deadline: float | None = None
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        # False: a request that fails for good becomes a Completion with finish_reason "error" (and the
        # message in extra["error"]) instead of failing the whole batch.
        self.raise_on_error = raise_on_error
        # Send a closed set of replies (`GenerationConfig.choices`) as vLLM's `guided_choice` and a reply pattern
        # (`GenerationConfig.pattern`) as its `guided_regex`, which vLLM and `medgraph.llm.serve` honour; False for
        # servers that reject unknown fields (then the reply is free text).
        self.guided_choice = guided_choice
        self._local = threading.local()  # one requests.Session per worker thread
        self._sessions: list[requests.Session] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OpenAIChatModel({self.model_id!r}, base_url={redact_uri(self.base_url)!r})"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers["Content-Type"] = "application/json"
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def _send(self, payload: dict[str, object], timeout: float) -> requests.Response:
        """One POST whose whole reply must arrive within `timeout` seconds. requests' own timeout bounds each read
        of the socket, so a server that sends a byte at a time would otherwise hold the call without end."""
        ends = time.monotonic() + timeout
        response = self._session().post(self.url, json=payload, timeout=timeout, stream=True)
        body: list[bytes] = []
        try:
            # read1: whatever one socket read brings (iter_content would block until its whole chunk size came).
            while chunk := response.raw.read1(1 << 16, decode_content=True):
                body.append(chunk)
                if time.monotonic() > ends:
                    raise requests.Timeout(f"the reply took longer than {timeout:g} s in all (timeout_s; "
                                           f"{sum(map(len, body))} bytes had come)")
        finally:
            response.close()
        response._content = b"".join(body)  # what .json() and .text read
        return response

    def _payload(self, conversation: Conversation, config: GenerationConfig) -> dict[str, object]:
        payload: dict[str, object] = {
            "model": self.model_id,
            "messages": [m.as_dict() for m in conversation],
            "max_tokens": config.max_new_tokens,
            "temperature": config.temperature,
            "top_p": config.top_p,
        }
        if config.stop:
            payload["stop"] = list(config.stop)
        if config.seed is not None:
            payload["seed"] = config.seed
        if config.choices and self.guided_choice:
            payload["guided_choice"] = list(config.choices)
        if config.pattern and self.guided_choice:
            payload["guided_regex"] = config.pattern
        return payload

    def _backoff(self, attempt: int, response: requests.Response | None) -> float:
        retry_after = response.headers.get("Retry-After") if response is not None else None
        if retry_after:
            try:
                return min(float(retry_after), self.max_backoff_s)
            except ValueError:
                pass
        delay = min(self.backoff_s * 2 ** attempt, self.max_backoff_s)
        return delay * (0.5 + random.random() / 2)  # jitter: concurrent retries do not arrive together

    def _post(self, payload: dict[str, object]) -> dict[str, object]:
        """POST with retries on connection errors, timeouts, 429 and 5xx; the decoded JSON reply."""
        problem = ""
        for attempt in range(self.max_retries + 1):
            response = None
            timeout = self.timeout_s
            if self.deadline is not None:
                timeout = min(timeout, self.deadline - time.monotonic())
                if timeout <= 0:
                    raise LlmRequestError(f"POST {self.url}: no reply before the caller's time limit ran out"
                                          + (f" ({problem})" if problem else ""), None, self.url)
            try:
                response = self._send(payload, timeout)
            except (requests.ConnectionError, requests.Timeout) as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError as error:
                        raise LlmRequestError(f"POST {self.url}: the server sent a reply that is not JSON: "
                                              f"{response.text[:300]!r}", response.status_code, self.url) from error
                message = _server_message(response)
                if response.status_code != 429 and response.status_code < 500:
                    raise LlmRequestError(f"POST {self.url} failed with HTTP {response.status_code} "
                                          f"(model {self.model_id!r}): {message}", response.status_code, self.url)
                problem = f"HTTP {response.status_code}: {message}"
            if attempt < self.max_retries:
                pause = self._backoff(attempt, response)
                if self.deadline is not None:
                    pause = min(pause, max(0.0, self.deadline - time.monotonic()))
                time.sleep(pause)
        status = response.status_code if response is not None else None
        raise LlmRequestError(f"POST {self.url} failed after {self.max_retries + 1} attempts: {problem}",
                              status, self.url)

    def _complete(self, conversation: Conversation, config: GenerationConfig) -> Completion:
        started = time.perf_counter()
        try:
            reply = self._post(self._payload(conversation, config))
        except LlmRequestError as error:
            if self.raise_on_error:
                raise
            return Completion("", 0, 0, time.perf_counter() - started, "error", self.name, {"error": str(error)})
        message, finish_reason, usage = _chat_choice(reply, self.url)
        text, stopped = truncate_at_stop(_message_text(message.get("content")), config.stop)  # servers differ here
        finish = "stop" if stopped else _FINISH.get(finish_reason or "stop", "stop")
        return Completion(
            text=text,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=time.perf_counter() - started,
            finish_reason=finish,
            model=self.name,
            extra={"usage_reported": bool(usage), "server_model": reply.get("model", "")},
        )

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[object] | None = None) -> list[Completion]:
        """One concurrent request per conversation.

        `latency_s` is the wall time of the whole batch, as for every backend; each
        request's own time is in `extra["request_latency_s"]`.
        """
        check_no_graph_tokens(self, graph_tokens)
        config = config or GenerationConfig()
        started = time.perf_counter()
        if len(conversations) <= 1 or self.concurrency == 1:
            completions = [self._complete(c, config) for c in conversations]
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="openai-chat")
                pool = self._pool
            completions = list(pool.map(lambda c: self._complete(c, config), conversations))
        latency = time.perf_counter() - started
        return [replace(c, latency_s=latency, extra={**c.extra, "request_latency_s": c.latency_s})
                for c in completions]

    def models(self) -> list[str]:
        """The model ids the server offers (`GET /models`): a cheap check of URL and key."""
        response = self._session().get(f"{self.base_url}/models", timeout=self.timeout_s)
        if response.status_code >= 400:
            raise LlmRequestError(f"GET {self.base_url}/models failed with HTTP {response.status_code}: "
                                  f"{_server_message(response)}", response.status_code, f"{self.base_url}/models")
        return [m["id"] for m in response.json().get("data", [])]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            for session in self._sessions:
                session.close()
            self._sessions.clear()
