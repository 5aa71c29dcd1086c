"""Chat backend on Amazon Bedrock's Converse API (one request shape for every Bedrock model).

Credentials and region come from the usual AWS chain (environment, profile,
instance role). A batch is sent as concurrent `converse` calls; throttling
and transient service errors are retried with exponential backoff here
(botocore's own retries are turned off so that the policy is in one place).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from medgraph.llm.base import (
    ChatModel,
    Completion,
    Conversation,
    GenerationConfig,
    check_no_graph_tokens,
    truncate_at_stop,
)

RETRYABLE = {"ThrottlingException", "TooManyRequestsException", "ServiceUnavailableException",
             "InternalServerException", "ModelNotReadyException", "ModelTimeoutException"}
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


class BedrockError(RuntimeError):
    """A Converse call failed for good (a client error, or retries ran out)."""


def bedrock_request(model_id: str, conversation: Conversation, config: GenerationConfig) -> dict[str, object]:
    """Converse parameters: system prompts apart, consecutive same-role turns merged (Bedrock
    requires user/assistant alternation, starting with the user)."""
    system = [{"text": m.content} for m in conversation if m.role == "system"]
    messages: list[dict[str, object]] = []
    for m in conversation:
        if m.role == "system":
            continue
        if messages and messages[-1]["role"] == m.role:
            messages[-1]["content"].append({"text": m.content})
        else:
            messages.append({"role": m.role, "content": [{"text": m.content}]})
    if not messages or messages[0]["role"] != "user":
        raise ValueError("a Bedrock conversation must start with a user message (after any system messages)")
    inference: dict[str, object] = {"maxTokens": config.max_new_tokens, "temperature": config.temperature}
    if config.top_p < 1.0:
        inference["topP"] = config.top_p
    if config.stop:
        inference["stopSequences"] = list(config.stop)
    request: dict[str, object] = {"modelId": model_id, "messages": messages, "inferenceConfig": inference}
    if system:
        request["system"] = system
    return request


class BedrockChatModel(ChatModel):
    """Completions from a Bedrock model id (or inference profile) through `bedrock-runtime` `converse`."""

    def __init__(self, model_id: str, *, region: str | None = None, client: object | None = None,
                 max_retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 30.0, concurrency: int = 4,
                 timeout_s: float = 120.0, name: str | None = None):
        self.model_id = model_id
        self.name = name or model_id
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.concurrency = max(1, concurrency)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client("bedrock-runtime", region_name=region, config=Config(
                retries={"total_max_attempts": 1}, read_timeout=timeout_s, max_pool_connections=self.concurrency))
        self.client = client

    def __repr__(self) -> str:
        return f"BedrockChatModel({self.model_id!r})"

    def _converse(self, request: dict[str, object]) -> dict[str, object]:
        from botocore.exceptions import ClientError

        for attempt in range(self.max_retries + 1):
            try:
                return self.client.converse(**request)
            except ClientError as error:
                code = error.response.get("Error", {}).get("Code", "")
                message = error.response.get("Error", {}).get("Message", "")
                if code not in RETRYABLE:
                    raise BedrockError(f"Bedrock converse ({self.model_id}) failed: {code}: {message}") from error
                if attempt == self.max_retries:
                    raise BedrockError(f"Bedrock converse ({self.model_id}) still failing after "
                                       f"{attempt + 1} attempts: {code}: {message}") from error
            delay = min(self.backoff_s * 2 ** attempt, self.max_backoff_s)
            time.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")

    def _complete(self, conversation: Conversation, config: GenerationConfig) -> Completion:
        started = time.perf_counter()
        reply = self._converse(bedrock_request(self.model_id, conversation, config))
        content = reply.get("output", {}).get("message", {}).get("content", [])
        text = "".join(part.get("text", "") for part in content)
        text, stopped = truncate_at_stop(text, config.stop)
        usage = reply.get("usage", {})
        return Completion(
            text=text,
            prompt_tokens=int(usage.get("inputTokens", 0)),
            completion_tokens=int(usage.get("outputTokens", 0)),
            latency_s=time.perf_counter() - started,
            finish_reason="stop" if stopped else _FINISH.get(reply.get("stopReason", ""), "stop"),
            model=self.name,
            extra={"stop_reason": reply.get("stopReason", "")},
        )

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[object] | None = None) -> list[Completion]:
        """Concurrent `converse` calls; `latency_s` is the batch's wall time (each call's in extra)."""
        check_no_graph_tokens(self, graph_tokens)
        config = config or GenerationConfig()
        started = time.perf_counter()
        if self.concurrency == 1 or len(conversations) <= 1:
            completions = [self._complete(c, config) for c in conversations]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(conversations))) as pool:
                completions = list(pool.map(lambda c: self._complete(c, config), conversations))
        latency = time.perf_counter() - started
        return [Completion(c.text, c.prompt_tokens, c.completion_tokens, latency, c.finish_reason, c.model,
                           {**c.extra, "request_latency_s": c.latency_s}) for c in completions]
