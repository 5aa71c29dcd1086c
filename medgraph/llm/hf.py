"""In-process chat backend on transformers: batched generation and HIIM graph tokens.

A batch of conversations is rendered with the model's chat template, sorted by
length and cut into sub-batches of at most `max_batch_size`. Each sub-batch is
generated in two phases, because on a CPU they have opposite costs:

- *prefill*: rows of equal length go through the model together, every other
  row alone, so no prompt is padded. Prefill of a long retrieval prompt is
  matrix-matrix work (batching it gains nothing) and padding it would force
  the attention off its causal fast path onto one that materializes
  batch x heads x L x L scores;
- *decode*: the rows' KV caches are joined, left-padded, into one batch, and
  each step is one forward over all unfinished rows. One decode step costs
  about the same for 1 or 16 rows, which is where batching pays. A row leaves
  the batch as soon as it ends (EOS, a stop string, its token budget), so one
  long reply does not make the others compute to its length; padding columns
  no remaining row needs are dropped with it. Position ids follow each row's
  real length, so a row computes what it would alone (up to float rounding).

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
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

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

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[torch.Tensor | None] | None = None) -> list[Completion]:
        """Completions in input order; sub-batches of similar length, each prefilled then decoded together."""
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
        devices = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            if config.temperature > 0 and config.seed is not None:
                torch.manual_seed(config.seed)
            cache, mask, logits = self._prefill(rows)
            new_tokens = self._decode(rows, cache, mask, logits, config)
        return [self._finish(row, tokens, config) for row, tokens in zip(rows, new_tokens, strict=True)]

    def _prefill_groups(self, rows: list[_Row]) -> list[list[int]]:
        """Which rows prefill together: equal lengths (GRPO's G copies of a prompt), all at once on a GPU."""
        if self.device.startswith("cuda"):
            return [list(range(len(rows)))]
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(len(row), []).append(i)
        return list(groups.values())

    def _prefill(self, rows: list[_Row]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Run the prompts; the joined left-padded KV cache, its attention mask and each row's next-token logits."""
        width = max(len(r) for r in rows)
        per_row: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]  # row -> layer -> (keys, values)
        logits: list[torch.Tensor | None] = [None] * len(rows)
        for group in self._prefill_groups(rows):
            inputs_embeds, mask = self._embed_rows([rows[i] for i in group])
            padded = bool((mask == 0).any())
            cache = DynamicCache(config=self.model.config)
            out = self.model(inputs_embeds=inputs_embeds, attention_mask=mask if padded else None,
                             position_ids=left_padded_position_ids(mask), cache=cache, use_cache=True,
                             logits_to_keep=1)
            for slot, i in enumerate(group):
                per_row[i] = [(layer.keys[slot:slot + 1], layer.values[slot:slot + 1]) for layer in cache.layers]
                logits[i] = out.logits[slot, -1].float()

        def left_padded(tensor: torch.Tensor) -> torch.Tensor:  # zeros before the row's keys, masked out below
            return torch.nn.functional.pad(tensor, (0, 0, width - tensor.shape[-2], 0))

        joined = DynamicCache([(torch.cat([left_padded(row[layer][0]) for row in per_row]),
                                torch.cat([left_padded(row[layer][1]) for row in per_row]))
                               for layer in range(len(per_row[0]))], config=self.model.config)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return joined, mask, torch.stack(logits)

    def _decode(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor, logits: torch.Tensor,
                config: GenerationConfig) -> list[list[int]]:
        """Batched decode steps until every row has ended; finished rows leave the batch."""
        stop = [s for s in config.stop if s]
        window = max((len(s) for s in stop), default=0) + 4  # a stop string spans at most this many new tokens
        eos = set(self.eos_ids)
        tokens: list[list[int]] = [[] for _ in rows]
        active = list(range(len(rows)))  # the row each batch slot holds
        positions = torch.tensor([len(r) for r in rows], device=self.device)
        while True:
            chosen = self._next_tokens(logits, config)
            keep = []
            for slot, (row, token) in enumerate(zip(active, chosen.tolist(), strict=True)):
                tokens[row].append(token)
                ended = (token in eos or len(tokens[row]) >= config.max_new_tokens
                         or (stop and any(s in self.tokenizer.decode(tokens[row][-window:], skip_special_tokens=True)
                                          for s in stop)))
                if not ended:
                    keep.append(slot)
            if not keep:
                return tokens
            if len(keep) < len(active):
                active = [active[slot] for slot in keep]
                index = torch.tensor(keep, device=self.device)
                mask, positions, chosen = mask[index], positions[index], chosen[index]
                lead = int(mask.any(0).long().argmax())  # leading columns that are padding in every remaining row
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[index, :, lead:], layer.values[index, :, lead:]
                mask = mask[:, lead:]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions[:, None],
                             cache=cache, use_cache=True)
            positions = positions + 1
            logits = out.logits[:, -1].float()

    @staticmethod
    def _next_tokens(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
        """Greedy, or temperature + nucleus sampling as OpenAI-style servers do (no top-k)."""
        if config.temperature <= 0:
            return logits.argmax(-1)
        logits = logits / config.temperature
        if config.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - config.top_p
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1)[:, 0]

    def _finish(self, row: _Row, tokens: list[int], config: GenerationConfig) -> tuple[str, int, int, str]:
        """Text, prompt tokens, completion tokens and finish reason of one row."""
        end = next((k for k, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        text, stopped = truncate_at_stop(self.tokenizer.decode(tokens[:end], skip_special_tokens=True), config.stop)
        if stopped:
            return text, len(row), end, "stop"
        if end < len(tokens):  # ended by an end-of-turn token, which counts as generated
            return text, len(row), end + 1, "stop"
        return text, len(row), end, "length"

    def close(self) -> None:
        """Drop the weights (and free GPU memory) once the model is no longer needed."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
