"""In-process chat backend on transformers: batched generation and HIIM graph tokens.

A batch of conversations is rendered with the model's chat template, sorted by
length, cut into sub-batches of at most `max_batch_size`, left-padded and
decoded in one `model.generate` call per sub-batch. Left padding keeps every
row's last prompt token in the last column, which is where generation
continues; position ids follow the attention mask, so a padded row computes
the same thing as the row alone (up to float rounding).

Graph tokens (A2RAG's HIIM) enter as soft tokens: the rendered prompt is split
at a marker placed at the end of the last user message, and the row's
embeddings are [embed(text before); graph tokens; embed(text after)], passed
to `generate` as `inputs_embeds`. `prompt_embeddings` builds exactly these
rows for training the projector with the LLM frozen.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers import GenerationConfig as HfGenerationConfig

from medgraph.llm.base import ChatModel, Completion, Conversation, GenerationConfig, truncate_at_stop

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Put at the end of the last user message's text to find where graph tokens go in the rendered prompt.
GRAPH_MARKER = "<<medgraph:graph-tokens:5f0c>>"


def resolve_device(device: str = "auto") -> str:
    """`auto`: CUDA when there is a GPU, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """bfloat16 on CUDA and float32 elsewhere unless told (bf16 matmuls are slow on most CPUs)."""
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def left_padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows (0 at each row's first real token), as `generate` computes them.

    Pass them to a plain forward call on `prompt_embeddings` rows: without them most
    models number positions from the first column, padding included.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class _StopOnStrings(StoppingCriteria):
    """Ends a row once its generated text contains a stop string.

    transformers' own `stop_strings` works, but precomputes a table over the whole
    vocabulary on every `generate` call (6-10 s for SmolLM2's 49k tokens on a CPU);
    decoding a short tail of each row per step costs microseconds.
    """

    def __init__(self, tokenizer: object, stop: Sequence[str], prompt_length: int):
        self.tokenizer, self.stop, self.prompt_length = tokenizer, tuple(s for s in stop if s), prompt_length
        self.window = max(len(s) for s in self.stop) + 4  # a stop string spans at most this many new tokens

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        start = max(self.prompt_length, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        done = [any(s in tail for s in self.stop) for tail in tails]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@dataclass
class _Row:
    """One conversation, tokenized: either whole (`before` only) or split around its graph tokens."""

    before: list[int]
    graph: torch.Tensor | None = None
    after: list[int] | None = None

    def __len__(self) -> int:
        graph = 0 if self.graph is None else self.graph.shape[0]
        return len(self.before) + graph + len(self.after or ())


class TransformersChatModel(ChatModel):
    """A local Hugging Face causal LM (a checkpoint directory) with a chat template.

    `model` and `tokenizer` are the transformers objects (for trainers); `pad_id` and
    `eos_ids` the tokens generation pads with and stops at. One caller at a time: the
    sampling seed is set on torch's global generator (the HTTP server serializes calls).
    """

    supports_graph_tokens = True

    def __init__(self, model_dir: str | Path, *, name: str | None = None, device: str = "auto",
                 dtype: str | torch.dtype | None = None, max_batch_size: int = 16):
        model_dir = Path(model_dir).expanduser().resolve()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json in it)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name = name or model_dir.name
        self.model_dir = model_dir
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{model_dir}: the tokenizer has no chat template; an instruction-tuned model is needed")
        # Parameters keep their requires_grad: a trainer decides what is frozen (`model.requires_grad_(False)`).
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.hidden_size = self.model.get_input_embeddings().embedding_dim
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    def __repr__(self) -> str:
        return f"TransformersChatModel({self.name!r}, device={self.device!r}, dtype={self.dtype})"

    def _eos_ids(self) -> list[int]:
        """Every token that ends a reply: the generation config's and the tokenizer's end tokens."""
        ids = self.model.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        if not ids:
            raise ValueError(f"{self.model_dir}: neither the tokenizer nor the generation config names an EOS token")
        return ids

    # -- prompts ---------------------------------------------------------------------------------------

    def render(self, conversation: Conversation, marker: str | None = None) -> str:
        """The chat-template text of a conversation, ready for the assistant's reply.

        With `marker`, it is appended to the last user message (where graph tokens go).
        """
        messages = [m.as_dict() for m in conversation]
        if marker is not None:
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last_user is None:
                raise ValueError("graph tokens need a user message to follow, and the conversation has none")
            messages[last_user] = {**messages[last_user], "content": messages[last_user]["content"] + marker}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        # The chat template already writes any BOS token: add no special tokens twice.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _row(self, conversation: Conversation, graph: torch.Tensor | None) -> _Row:
        if graph is None:
            return _Row(self._encode(self.render(conversation)))
        if graph.dim() != 2 or graph.shape[1] != self.hidden_size:
            raise ValueError(f"graph tokens must have shape (n, {self.hidden_size}), got {tuple(graph.shape)}")
        parts = self.render(conversation, GRAPH_MARKER).split(GRAPH_MARKER)
        if len(parts) != 2:
            raise ValueError("the chat template dropped or repeated the graph-token marker; cannot place graph tokens")
        return _Row(self._encode(parts[0]), graph, self._encode(parts[1]))

    def _rows(self, conversations: Sequence[Conversation],
              graph_tokens: Sequence[torch.Tensor | None] | None) -> list[_Row]:
        if graph_tokens is not None and len(graph_tokens) != len(conversations):
            raise ValueError(f"{len(graph_tokens)} graph-token tensors for {len(conversations)} conversations")
        graphs = graph_tokens if graph_tokens is not None else [None] * len(conversations)
        return [self._row(c, g) for c, g in zip(conversations, graphs, strict=True)]

    def _embed_rows(self, rows: Sequence[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.model.get_input_embeddings()
        width = max(len(r) for r in rows)
        embeds, masks = [], []
        for row in rows:
            pieces = [embed(torch.tensor(row.before, dtype=torch.long, device=self.device))]
            if row.graph is not None:
                pieces += [row.graph.to(device=self.device, dtype=embed.weight.dtype),
                           embed(torch.tensor(row.after, dtype=torch.long, device=self.device))]
            pad = width - len(row)
            pieces.insert(0, torch.zeros(pad, self.hidden_size, dtype=embed.weight.dtype, device=self.device))
            embeds.append(torch.cat(pieces))
            masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(row), dtype=torch.long)]))
        return torch.stack(embeds), torch.stack(masks).to(self.device)

    def prompt_embeddings(self, conversations: Sequence[Conversation],
                          graph_tokens: Sequence[torch.Tensor | None] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact model input `generate` uses: (inputs_embeds (B, T, hidden), attention_mask (B, T)).

        Rows are LEFT-padded: padding (zero vectors, mask 0) comes first, and every row's
        prompt ends in the last column, right before the assistant's reply. To train on
        answers, append their token embeddings on the right (mask 1) and give the forward
        call `left_padded_position_ids(mask)`. Gradients flow into the graph tokens; the
        text embeddings come from the model's embedding matrix as it is.
        """
        return self._embed_rows(self._rows(conversations, graph_tokens))

    # -- generation ------------------------------------------------------------------------------------

    def _hf_config(self, config: GenerationConfig) -> HfGenerationConfig:
        sampling = config.temperature > 0
        options: dict[str, object] = {"max_new_tokens": config.max_new_tokens, "do_sample": sampling,
                                      "pad_token_id": self.pad_id, "eos_token_id": self.eos_ids}
        if sampling:  # plain temperature / nucleus sampling, as OpenAI-style servers do (no top-k)
            options.update(temperature=config.temperature, top_p=config.top_p, top_k=0)
        return HfGenerationConfig(**options)

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[torch.Tensor | None] | None = None) -> list[Completion]:
        """Completions in input order; sub-batches of similar length, one `model.generate` each."""
        config = config or GenerationConfig()
        started = time.perf_counter()
        rows = self._rows(conversations, graph_tokens)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths: little padding
        results: dict[int, tuple[str, int, int, str]] = {}
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start:start + self.max_batch_size]
            for i, result in zip(batch, self._generate_rows([rows[i] for i in batch], config), strict=True):
                results[i] = result
        latency = time.perf_counter() - started
        return [Completion(text=text, prompt_tokens=prompt, completion_tokens=generated, latency_s=latency,
                           finish_reason=finish, model=self.name)
                for text, prompt, generated, finish in (results[i] for i in range(len(rows)))]

    @torch.inference_mode()
    def _generate_rows(self, rows: list[_Row], config: GenerationConfig) -> list[tuple[str, int, int, str]]:
        if any(r.graph is not None for r in rows):
            inputs_embeds, mask = self._embed_rows(rows)
            inputs, prompt_length = {"inputs_embeds": inputs_embeds, "attention_mask": mask}, 0
        else:
            width = max(len(r) for r in rows)
            ids = torch.tensor([[self.pad_id] * (width - len(r)) + r.before for r in rows], device=self.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
            inputs, prompt_length = {"input_ids": ids, "attention_mask": mask}, width
        stop = [s for s in config.stop if s]
        criteria = StoppingCriteriaList([_StopOnStrings(self.tokenizer, stop, prompt_length)] if stop else [])
        devices = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            if config.temperature > 0 and config.seed is not None:
                torch.manual_seed(config.seed)
            out = self.model.generate(**inputs, generation_config=self._hf_config(config), stopping_criteria=criteria)
        # With input_ids the output starts with the prompt; with inputs_embeds it holds only new tokens.
        new_tokens = out[:, prompt_length:].tolist()
        return [self._finish(row, tokens, config) for row, tokens in zip(rows, new_tokens, strict=True)]

    def _finish(self, row: _Row, tokens: list[int], config: GenerationConfig) -> tuple[str, int, int, str]:
        """Text, prompt tokens, completion tokens and finish reason of one row (padding excluded)."""
        ends = set(self.eos_ids) | {self.pad_id}
        end = next((k for k, t in enumerate(tokens) if t in ends), len(tokens))
        text, stopped = truncate_at_stop(self.tokenizer.decode(tokens[:end], skip_special_tokens=True), config.stop)
        if stopped:
            return text, len(row), end, "stop"
        if end < len(tokens):  # ended by an end-of-turn token, which counts as generated
            return text, len(row), end + int(tokens[end] in self.eos_ids), "stop"
        return text, len(row), end, "length"

    def close(self) -> None:
        """Drop the weights (and free GPU memory) once the model is no longer needed."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
