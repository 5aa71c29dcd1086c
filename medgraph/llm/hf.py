"""In-process chat backend on transformers: batched generation and HIIM graph tokens.

A batch of conversations is rendered with the model's chat template, sorted by
length and cut into sub-batches of at most `max_batch_size`. Each sub-batch is
generated in two phases, because on a CPU they have opposite costs:

- *prefill*: rows of equal length go through the model together, every other
  row alone, so no prompt is padded. Prefill of a long retrieval prompt is
  matrix-matrix work (batching it gains nothing) and padding it would force
  the attention off its causal fast path onto one that materializes
  batch x heads x L x L scores;
- *decode*: the rows' KV caches are joined, left-padded, into one buffer with
  room for the replies (each step writes in place), and each step is one
  forward over all unfinished rows. A step reads every weight once whatever
  the rows (SmolLM2, 2 cores, ~480-token prompts: 61 ms for 1 row, 142 ms for
  24; benchmarks/llm_decode.py), which is where batching pays. A row leaves
  the batch as soon as it ends (EOS, a stop string, its token budget), so one
  long reply does not make the others compute to its length; padding columns
  no remaining row needs are dropped with it. Position ids follow each row's
  real length, so a row computes what it would alone (up to float rounding).

Agent turns extend their conversations, so a `PrefixCache` (on unless
`prefix_cache=False`) keeps the keys/values of recent prompts and replies: a
row's prefill starts from the longest cached prefix of its token ids (graph
tokens included, keyed by their content) and computes only the new tokens;
`Completion.prompt_tokens_computed` counts them. The reused keys/values are
the ones a full prefill would compute (in float32 the greedy replies are
token-identical; tests/test_prefix_cache.py).

Graph tokens (A2RAG's HIIM) enter as soft tokens: the rendered prompt is split
at a marker placed at the end of the last user message, and the row's
embeddings are [embed(text before); graph tokens; embed(text after)], passed
to `generate` as `inputs_embeds`. `prompt_embeddings` builds exactly these
rows for training the projector with the LLM frozen.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import regex
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from medgraph.llm.base import ChatModel, Completion, Conversation, GenerationConfig, truncate_at_stop

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Put at the end of the last user message's text to find where graph tokens go in the rendered prompt.
GRAPH_MARKER = "<<medgraph:graph-tokens:5f0c>>"


def resolve_device(device: str = "auto") -> str:
    """`auto`: CUDA when there is a GPU, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def forked_rng(device: str) -> contextlib.AbstractContextManager:
    """torch.random.fork_rng over the CPU generator and, on CUDA, the device's: what runs inside may seed
    freely and the caller's random state is restored after."""
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    return torch.random.fork_rng(devices=devices)


@functools.cache
def cpu_has_bf16() -> bool:
    """Native bf16 matmuls (AVX512-BF16 or AMX); elsewhere bf16 on the CPU is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: assume emulated
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def release_freed_memory() -> None:
    """Give the memory of freed tensors back to the OS (glibc's `malloc_trim`; nothing elsewhere). A fit's
    activations and a generation's keys/values change shape every call (prompts of every length), and glibc
    keeps the freed blocks in its heaps: without this a CPU process grows call after call. About a millisecond."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns memory its own way
        return None


def autocasts_to_bf16(device: str, bf16: bool = True, generation: bool = False) -> bool:
    """Whether `autocast(device, bf16, generation)` casts to bf16 on this machine."""
    if bf16 and str(device).startswith("cuda"):
        return True
    return bf16 and not generation and str(device) == "cpu" and cpu_has_bf16()


def autocast(device: str, bf16: bool = True, generation: bool = False) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; on CPUs with native bf16 only for training passes (forward and
    backward over whole sequences: 1.6x faster for SmolLM2 on an EPYC), not for generation, whose
    one-token steps pay a cast of every weight (48 tokens: 9.5 s instead of 6.3 s). Master weights
    stay float32."""
    if autocasts_to_bf16(device, bf16, generation):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    """The weights' dtype. None (the default): bfloat16 on CUDA, float32 on the CPU. `auto`: bfloat16 on
    CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32.

    The CPU default stays float32 because bf16 rounding makes greedy replies depend on the batch
    (a question batched with others can get a different reply than alone) and on prefix caching;
    benchmarks/llm_dtype.py measures the speed-up and answer agreement of each choice side by side.
    `int8` (CPU only) is returned as the string: float32 weights whose Linear layers are then
    quantized dynamically (see `quantize_int8`).
    """
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype == "auto":
        native = device.startswith("cuda") or (device == "cpu" and cpu_has_bf16())
        return torch.bfloat16 if native else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "int8":
        if device != "cpu":
            raise ValueError("dtype int8 (dynamic quantization) runs on the CPU only; use bfloat16 on a GPU")
        return "int8"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, int8 or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """int8 dynamic quantization of every Linear layer (weights int8, activations quantized per call)."""
    import warnings

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


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


def _head(row: _Row, length: int) -> _Row:
    """The first `length` positions of a row (graph tokens count one position each)."""
    if row.graph is None or length <= len(row.before):
        return _Row(row.before[:length])
    in_graph = length - len(row.before)
    if in_graph <= row.graph.shape[0]:
        return _Row(row.before, row.graph[:in_graph], [])
    return _Row(row.before, row.graph, (row.after or [])[:in_graph - row.graph.shape[0]])


# A start that several rows of one call share is prefilled once for them when it is at least this long: a
# shorter one costs about as much as the extra forward call saves.
SHARED_PREFIX_MIN = 32

# Graph tokens have no token ids: in cache keys they are negative ids, one per (graph-token tensor
# content, position in it), so a cached prefix matches across graph tokens only when they are the same.
_GRAPH_ID_STRIDE = 1 << 20


@dataclass
class _CachedPrefix:
    """The keys/values of one token sequence (a prompt and the reply generated after it)."""

    key: torch.Tensor  # (T,) int64 on the CPU: token ids, graph tokens as negative ids
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, heads, T, head_dim)
    nbytes: int


class PrefixCache:
    """Past keys/values of recent conversations, so that a turn prefills only what is new in its prompt.

    Entries are token sequences (a prompt and the reply generated after it) with their keys/values.
    A new prompt reuses the longest common prefix with any entry, compared token id by token id (a
    chat template may re-tokenize an earlier reply differently; only the matching part is reused,
    and the keys/values of position i depend on tokens 0..i only). Different conversations share
    prefixes too (a system prompt, a demonstration). Memory is bounded: least recently used
    entries go first once `max_bytes` is exceeded, and an entry that is a prefix of a newer one,
    or that a newer one continues (all but a short tail), is dropped as redundant.
    """

    # An entry that served a prompt and differs from it only in this many last tokens (a reply
    # re-tokenized at its stop string) is superseded by that prompt's own entry.
    SUPERSEDED_TAIL = 16

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, _CachedPrefix] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.evicted = 0
        self._next_id = 0
        self._graph_ids: dict[bytes, int] = {}
        self._weights: tuple[int, int] | None = None

    def clear(self) -> None:
        self.entries.clear()
        self._graph_ids.clear()
        self.nbytes = 0

    def check_weights(self, model: torch.nn.Module) -> None:
        """Forget everything once the weights changed (a trainer's optimizer step, an adapter swapped in)."""
        # In-place updates bump a tensor's version counter, so this sees optimizer steps without reading weights.
        fingerprint = (id(model), sum(p._version for p in model.parameters()))
        if fingerprint != self._weights:
            self.clear()
            self._weights = fingerprint

    def key(self, row: _Row) -> torch.Tensor:
        """The row's token ids, its graph tokens (if any) as ids standing for their content and position."""
        ids = list(row.before)
        if row.graph is not None:
            content = row.graph.detach().to("cpu", torch.float32).contiguous()
            digest = hashlib.blake2b(content.numpy().tobytes(), digest_size=16).digest()
            base = self._graph_ids.setdefault(digest, len(self._graph_ids) + 1) * _GRAPH_ID_STRIDE
            ids += [-(base + j) for j in range(row.graph.shape[0])]
            ids += row.after or []
        return torch.tensor(ids, dtype=torch.long)

    @staticmethod
    def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
        n = min(len(a), len(b))
        differs = (a[:n] != b[:n]).nonzero()
        return int(differs[0, 0]) if len(differs) else n

    def longest_prefix(self, key: torch.Tensor, limit: int) -> tuple[int | None, int]:
        """The entry sharing the longest prefix (at most `limit` tokens) with `key`, and that length."""
        best, best_length = None, 0
        for entry_id, entry in self.entries.items():
            length = min(self._common_prefix(key, entry.key), limit)
            if length > best_length:
                best, best_length = entry_id, length
        if best is not None:
            self.entries.move_to_end(best)
        return best, best_length

    def prefix(self, entry_id: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :length], v[:, :, :length]) for k, v in self.entries[entry_id].layers]

    def add(self, key: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]],
            served_by: tuple[int | None, int] = (None, 0)) -> None:
        """Keep `layers` (cloned) for `key`; `served_by`: the entry and length the prompt's prefill reused."""
        for entry_id, entry in list(self.entries.items()):
            shared = self._common_prefix(key, entry.key)
            superseded = entry_id == served_by[0] and len(entry.key) - served_by[1] <= self.SUPERSEDED_TAIL
            if shared == len(entry.key) or superseded:
                self._drop(entry_id)
        layers = [(k.clone(), v.clone()) for k, v in layers]  # not views: they would keep a whole batch alive
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes:
            return
        self.entries[self._next_id] = _CachedPrefix(key, layers, nbytes)
        self._next_id += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.evicted += 1

    def _drop(self, entry_id: int) -> None:
        self.nbytes -= self.entries.pop(entry_id).nbytes


class _GrowingLayer(DynamicLayer):
    """One layer's keys/values of a decode batch, left-padded, in a buffer with room for the replies: each step
    writes its token in place. DynamicLayer appends with torch.cat, which allocates and copies the whole cache at
    every step; at 24 rows of 1,900 tokens that was 69% of a decode step (8 rows: 47%). `keys`/`values` are
    views of the filled part, as DynamicLayer's tensors are to the model."""

    def __init__(self, batch: int, width: int, room: int, like: torch.Tensor):
        """Room for `batch` rows of `width` columns plus `room` for decoding, filled row by row with `put`;
        `like`: a tensor of the keys' dtype, device, heads and head size."""
        super().__init__()
        self.is_initialized, self.device = True, like.device
        self._allocate(batch, width + room, like)
        self._filled(width)

    @classmethod
    def of_rows(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], width: int, room: int) -> _GrowingLayer:
        """`rows`: each row's (keys, values), (1, heads, length <= width, head_dim), right-aligned at `width`."""
        layer = cls(len(rows), width, room, rows[0][0])
        for slot, (keys, values) in enumerate(rows):
            layer.put(slot, keys, values)
        return layer

    def put(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one row's (1, heads, length, head_dim) keys/values into batch slot `slot`, right-aligned."""
        width = self.length
        pad = width - keys.shape[-2]
        self._keys[slot, :, :pad] = 0  # masked out, but must not be NaN (0 x NaN is NaN in the attention)
        self._values[slot, :, :pad] = 0
        self._keys[slot, :, pad:width], self._values[slot, :, pad:width] = keys[0], values[0]

    def _allocate(self, batch: int, capacity: int, like: torch.Tensor) -> None:
        shape = (batch, like.shape[1], capacity, like.shape[3])
        self._keys, self._values = like.new_empty(shape), like.new_empty(shape)

    def _filled(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:  # out of room (a longer reply than reserved): grow by doubling
            keys, values = self.keys, self.values
            self._allocate(keys.shape[0], max(end, 2 * self._keys.shape[-2]), keys)
            self._keys[:, :, :self.length], self._values[:, :, :self.length] = keys, values
        self._keys[:, :, self.length:end] = key_states
        self._values[:, :, self.length:end] = value_states
        self._filled(end)
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, lead: int) -> None:
        """Only the batch rows `rows`, without the first `lead` columns (padding no remaining row needs)."""
        self._keys = self._keys.index_select(0, rows)[:, :, lead:]  # one copy, the room included
        self._values = self._values.index_select(0, rows)[:, :, lead:]
        self._filled(self.length - lead)


def _growing_cache(layers: list[list[tuple[torch.Tensor, torch.Tensor]]], width: int, room: int,
                   config: object) -> DynamicCache:
    """A DynamicCache over `_GrowingLayer`s: `layers[layer]` holds each row's (keys, values) of that layer."""
    cache = DynamicCache(config=config)
    cache.layers = [_GrowingLayer.of_rows(rows, width, room) for rows in layers]
    return cache


@dataclass(frozen=True)
class _Reuse:
    """What a row's prefill takes from the prefix cache: its cache key, the entry and how many tokens of it."""

    key: torch.Tensor | None = None
    entry: int | None = None
    length: int = 0


class _PatternConstraint:
    """Greedy decoding of replies that match a regular expression (`GenerationConfig.pattern`, vLLM's
    `guided_regex`): each step takes the token the model ranks first among those that keep the reply a prefix of
    a match (the `regex` module's partial matching), and an end-of-turn token only once the reply matches."""

    CANDIDATES = 64  # the model's best tokens tried first; the whole vocabulary only when none of them fits

    def __init__(self, pattern: str, tokenizer, eos: set[int], vocabulary: list[str]):
        self.compiled = regex.compile(pattern)
        self.tokenizer, self.eos, self.vocabulary = tokenizer, eos, vocabulary
        self.special = set(tokenizer.all_special_ids) - eos

    def _fits(self, text: str, token: int, complete: bool) -> bool:
        if token in self.eos:
            return complete
        if token in self.special:
            return False
        return self.compiled.fullmatch(text + self.vocabulary[token], partial=True) is not None

    def next_token(self, scores: torch.Tensor, reply: list[int]) -> int:
        """The allowed token `scores` rank first after `reply`."""
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        complete = self.compiled.fullmatch(text) is not None
        best = scores.topk(min(self.CANDIDATES, scores.numel())).indices.tolist()
        # A complete reply ends unless one of the model's best tokens extends the match; an incomplete one searches
        # the whole vocabulary, best first, for a token that continues it.
        for ranked in (best,) if complete else (best, scores.argsort(descending=True).tolist()):
            for token in ranked:
                # A token's text alone can differ from what it adds to a sequence (a character split over bytes):
                # the sequence's own decoding has the last word.
                if self._fits(text, token, complete) and (
                        token in self.eos or self.compiled.fullmatch(
                            self.tokenizer.decode([*reply, token], skip_special_tokens=True), partial=True)):
                    return token
        return min(self.eos)  # complete, or nothing continues a match: end the reply

    def mask(self, logits: torch.Tensor, replies: list[list[int]]) -> torch.Tensor:
        allowed = torch.full_like(logits, float("-inf"))
        for slot, reply in enumerate(replies):
            allowed[slot, self.next_token(logits[slot], reply)] = 0.0
        return logits + allowed


class TransformersChatModel(ChatModel):
    """A local Hugging Face causal LM (a checkpoint directory) with a chat template.

    `model` and `tokenizer` are the transformers objects (for trainers); `pad_id` and
    `eos_ids` the tokens generation pads with and stops at. One caller at a time: the
    sampling seed is set on torch's global generator (the HTTP server serializes calls).
    `prefix_cache_mb` bounds the prefix cache: 1 GB holds ~22k tokens of SmolLM2-135M's keys/values (46 KB a
    token in float32), a lockstep batch of 24 agent conversations; with the decode batch's caches it is the
    evaluations' share of `make demo`'s memory peak (README).
    """

    supports_graph_tokens = True

    def __init__(self, model_dir: str | Path, *, name: str | None = None, device: str = "auto",
                 dtype: str | torch.dtype | None = None, max_batch_size: int = 32, prefix_cache: bool = True,
                 prefix_cache_mb: int = 1024):
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
        weights = torch.float32 if self.dtype == "int8" else self.dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=weights)
        self.model.to(self.device).eval()
        if self.dtype == "int8":
            self.model = quantize_int8(self.model)
        self.hidden_size = self.model.get_input_embeddings().embedding_dim
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        # Reusing keys/values needs caches that keep every position (not a sliding window's last few).
        plain = all(type(layer).__name__ == "DynamicLayer" for layer in DynamicCache(config=self.model.config).layers)
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache and plain else None

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

    def _vocabulary(self) -> list[str]:
        """Each token's text alone (what a pattern-constrained step checks first), decoded once per model."""
        if getattr(self, "_token_texts", None) is None:
            self._token_texts = self.tokenizer.batch_decode([[token] for token in range(len(self.tokenizer))])
        return self._token_texts

    def count_tokens(self, text: str) -> int:
        """How many tokens `text` takes in a reply (e.g. against a `max_new_tokens` budget)."""
        return len(self._encode(text))

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
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights(self.model)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths: little padding
        results: dict[int, tuple[str, int, int, str, int]] = {}
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start:start + self.max_batch_size]
            for i, result in zip(batch, self._generate_rows([rows[i] for i in batch], config), strict=True):
                results[i] = result
        latency = time.perf_counter() - started
        return [Completion(text=text, prompt_tokens=prompt, completion_tokens=generated, latency_s=latency,
                           finish_reason=finish, model=self.name, prompt_tokens_computed=computed)
                for text, prompt, generated, finish, computed in (results[i] for i in range(len(rows)))]

    def clear_prefix_cache(self) -> None:
        """Forget the cached keys/values (they are also dropped by themselves when the weights change)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @torch.inference_mode()
    def _generate_rows(self, rows: list[_Row], config: GenerationConfig) -> list[tuple[str, int, int, str, int]]:
        with forked_rng(self.device):
            if config.temperature > 0 and config.seed is not None:
                torch.manual_seed(config.seed)
            seeded = self._prefill_shared_prefixes(rows)
            reuse = self._cached_prefixes(rows)
            cache, mask, logits = self._prefill(rows, reuse, room=config.max_new_tokens)
            new_tokens = self._decode(rows, cache, mask, logits, config, reuse)
        return [(*self._finish(row, tokens, config), len(row) - used.length + extra)
                for row, tokens, used, extra in zip(rows, new_tokens, reuse, seeded, strict=True)]

    def _prefill_shared_prefixes(self, rows: list[_Row]) -> list[int]:
        """Prefill once what several rows of this call start with, into the prefix cache; per row, its share
        of the tokens that cost (so that `prompt_tokens_computed` still adds up to what the model ran).

        Rows of one call often share a long start: a method's system prompt and demonstrations across its
        questions, GRPO's G copies of one prompt. Without this each row would compute it (the cache is looked
        up before the call). Shortest shared start first, so that a longer one continues a shorter one.
        """
        shares = [0] * len(rows)
        if self.prefix_cache is None or len(rows) < 2:
            return shares
        keys = [self.prefix_cache.key(row) for row in rows]
        starts: dict[tuple[int, ...], int] = {}  # a shared start -> the first row that begins with it
        for i, key in enumerate(keys):
            # Each row keeps at least its last token to compute (its next-token logits come from it).
            length = min(max(PrefixCache._common_prefix(key, other) for j, other in enumerate(keys) if j != i),
                         len(key) - 1)
            if length >= SHARED_PREFIX_MIN:
                starts.setdefault(tuple(key[:length].tolist()), i)
        for start in sorted(starts, key=len):
            key = torch.tensor(start, dtype=torch.long)
            entry, cached = self.prefix_cache.longest_prefix(key, len(start))
            if len(start) - cached < SHARED_PREFIX_MIN:
                continue
            head = _head(rows[starts[start]], len(start))
            prefilled, _, _ = self._prefill([head], [_Reuse(key, entry, cached)])
            self.prefix_cache.add(key, [(layer.keys, layer.values) for layer in prefilled.layers],
                                  served_by=(entry, cached))
            sharing = [i for i, other in enumerate(keys) if len(other) > len(start)
                       and PrefixCache._common_prefix(key, other) == len(start)]
            cost, first = divmod(len(start) - cached, len(sharing))
            for rank, i in enumerate(sharing):
                shares[i] += cost + (rank < first)
        return shares

    def _cached_prefixes(self, rows: list[_Row]) -> list[_Reuse]:
        """Each row's longest cached prefix; at least its last token is left to compute (for its logits)."""
        if self.prefix_cache is None:
            return [_Reuse() for _ in rows]
        reuse = []
        for row in rows:
            key = self.prefix_cache.key(row)
            entry, length = self.prefix_cache.longest_prefix(key, len(row) - 1)
            reuse.append(_Reuse(key, entry, length))
        return reuse

    def _prefill_groups(self, rows: list[_Row], reuse: list[_Reuse]) -> list[list[int]]:
        """Which rows prefill together: equal lengths (GRPO's G copies of a prompt), all at once on a GPU.

        Rows that continue a cached prefix go together only with rows of the same prefix length and
        length, so that no row is padded on either side of its cached keys.
        """
        cuda = self.device.startswith("cuda")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (row, used) in enumerate(zip(rows, reuse, strict=True)):
            groups.setdefault((0, 0) if cuda and not used.length else (used.length, len(row)), []).append(i)
        return list(groups.values())

    def _prefill(self, rows: list[_Row], reuse: list[_Reuse], room: int = 0
                 ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Run the prompts (past their cached prefixes); the joined left-padded KV cache (with `room` columns
        reserved for decoding), its attention mask and each row's next-token logits."""
        width = max(len(r) for r in rows)
        joined: DynamicCache | None = None
        logits: list[torch.Tensor | None] = [None] * len(rows)
        for group in self._prefill_groups(rows, reuse):
            inputs_embeds, mask = self._embed_rows([rows[i] for i in group])
            cached = reuse[group[0]].length
            if cached:  # the group's rows have equal lengths: no padding; only the new tokens are computed
                past = [self.prefix_cache.prefix(reuse[i].entry, cached) for i in group]
                # Copied once into a buffer with room for the new tokens (a DynamicCache built from them copies
                # them twice, and the forward call's torch.cat a third time).
                cache = _growing_cache([[p[layer] for p in past] for layer in range(len(past[0]))], cached,
                                       len(rows[group[0]]) - cached, self.model.config)
                inputs_embeds, mask = inputs_embeds[:, cached:], mask[:, cached:]
                position_ids = torch.arange(cached, cached + mask.shape[1], device=self.device).expand(len(group), -1)
            else:
                cache = DynamicCache(config=self.model.config)
                position_ids = left_padded_position_ids(mask)
            padded = bool((mask == 0).any())
            out = self.model(inputs_embeds=inputs_embeds, attention_mask=mask if padded else None,
                             position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1)
            # Each group's keys/values go straight into the joined cache: holding every group's cache until all
            # are prefilled doubled the keys/values in memory (~1 GB at 24 rows of 1,000 tokens).
            if joined is None:
                joined = DynamicCache(config=self.model.config)
                joined.layers = [_GrowingLayer(len(rows), width, room, layer.keys) for layer in cache.layers]
            for slot, i in enumerate(group):
                for target, layer in zip(joined.layers, cache.layers, strict=True):
                    target.put(i, layer.keys[slot:slot + 1], layer.values[slot:slot + 1])
                logits[i] = out.logits[slot, -1].float()
            del cache, out

        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return joined, mask, torch.stack(logits)

    def _decode(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor, logits: torch.Tensor,
                config: GenerationConfig, reuse: list[_Reuse]) -> list[list[int]]:
        """Batched decode steps until every row has ended; finished rows leave the batch (and leave their
        keys/values, prompt and reply, to the prefix cache)."""
        stop = [s for s in config.stop if s]
        window = max((len(s) for s in stop), default=0) + 4  # a stop string spans at most this many new tokens
        eos = set(self.eos_ids)
        choices = [self._encode(c) for c in config.choices]
        pattern = (_PatternConstraint(config.pattern, self.tokenizer, eos, self._vocabulary())
                   if config.pattern else None)
        tokens: list[list[int]] = [[] for _ in rows]
        active = list(range(len(rows)))  # the row each batch slot holds
        positions = torch.tensor([len(r) for r in rows], device=self.device)
        while True:
            if choices:
                logits = self._only_choices(logits, [tokens[row] for row in active], choices)
            if pattern is not None:
                logits = pattern.mask(logits, [tokens[row] for row in active])
            chosen = self._next_tokens(logits, config)
            keep = []
            for slot, (row, token) in enumerate(zip(active, chosen.tolist(), strict=True)):
                tokens[row].append(token)
                ended = (token in eos or len(tokens[row]) >= config.max_new_tokens
                         or (choices and tokens[row] in choices)
                         or (stop and any(s in self.tokenizer.decode(tokens[row][-window:], skip_special_tokens=True)
                                          for s in stop)))
                if not ended:
                    keep.append(slot)
                elif self.prefix_cache is not None:
                    self._remember(rows[row], reuse[row], tokens[row], cache, slot)
            if not keep:
                return tokens
            if len(keep) < len(active):
                active = [active[slot] for slot in keep]
                index = torch.tensor(keep, device=self.device)
                mask, positions, chosen = mask[index], positions[index], chosen[index]
                lead = int(mask.any(0).long().argmax())  # leading columns that are padding in every remaining row
                for layer in cache.layers:
                    layer.keep(index, lead)
                mask = mask[:, lead:]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions[:, None],
                             cache=cache, use_cache=True)
            positions = positions + 1
            logits = out.logits[:, -1].float()

    def _remember(self, row: _Row, used: _Reuse, tokens: list[int], cache: DynamicCache, slot: int) -> None:
        """Keep a finished row's keys/values: its prompt and every reply token that went through the model."""
        fed = tokens[:-1]  # the last token chosen was never fed back
        length = len(row) + len(fed)  # its real columns, the last ones of the left-padded cache
        layers = [(layer.keys[slot:slot + 1, :, -length:], layer.values[slot:slot + 1, :, -length:])
                  for layer in cache.layers]
        key = torch.cat([used.key, torch.tensor(fed, dtype=torch.long)])
        self.prefix_cache.add(key, layers, served_by=(used.entry, used.length))

    @staticmethod
    def _only_choices(logits: torch.Tensor, replies: list[list[int]], choices: list[list[int]]) -> torch.Tensor:
        """Logits with every token masked out that does not continue one of `choices` from each row's reply
        so far: greedy decoding then writes the allowed reply the model ranks first, token by token."""
        allowed = torch.full_like(logits, float("-inf"))
        for slot, reply in enumerate(replies):
            following = {c[len(reply)] for c in choices if len(c) > len(reply) and c[:len(reply)] == reply}
            allowed[slot, list(following)] = 0.0
        return logits + allowed

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
        if stopped or (config.choices and text in config.choices):
            return text, len(row), end, "stop"
        if end < len(tokens):  # ended by an end-of-turn token, which counts as generated
            return text, len(row), end + 1, "stop"
        return text, len(row), end, "length"

    def close(self) -> None:
        """Drop the weights (and free GPU memory) once the model is no longer needed."""
        self.clear_prefix_cache()
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
