"""Text vectors computed on the fly, kept on local disk per encoder (a content-addressed memo).

GSRM scores the triples of subgraphs it grows around a question's entities; the triples that
`embeddings.edge_embeddings` does not hold (in the demo only the drug and gene-disease relations
are embedded) are encoded when first needed. GSRM tuning, the HIIM projector, A2RAG's evaluation
and the GSRM recall report grow overlapping subgraphs around the same hubs, each in its own
process: in one demo, 48 validation items needed 26,800 triple texts and 338 test items 30,075,
most of them the same. This cache keeps each (encoder, kind, text) vector once.

A vector is stored the first time it is computed and read from then on, so a re-run reads exactly
the vectors of the run before it (a bf16 encoder gives a text slightly different vectors in
different batches; with the cache the first one stays). Keys name the encoder (`encoder_id`: its
weights, pooling, max_length and dtype), the kind (query/document) and the text itself, so a
changed relation phrase or encoder never meets an old vector.

On disk: `<root>/<encoder_id>/<uuid>.npz` shards (16-byte keys, float32 vectors), each written
once (temp file + rename) and never changed, so concurrent processes only ever add files. Many
shards are merged into one on load; past `max_bytes` the oldest shards are deleted.
"""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from medgraph.files import write_atomically
from medgraph.home import HomeLayout

SHARDS_BEFORE_MERGE = 32


def _key(kind: str, text: str) -> bytes:
    return hashlib.blake2b(f"{kind}\n{text}".encode(), digest_size=16).digest()


class TextVectorCache:
    """Vectors of texts by one encoder: `get` what is cached, `put` what was just computed."""

    def __init__(self, root: str | Path, encoder_id: str, max_bytes: int = 1 << 30):
        self.dir = Path(root) / encoder_id
        self.max_bytes = max_bytes
        self._vectors: dict[bytes, np.ndarray] | None = None
        self.hits = self.misses = 0

    def get(self, kind: str, texts: Sequence[str]) -> list[np.ndarray | None]:
        """The cached vector of each text, None where there is none."""
        vectors = self._loaded()
        found = [vectors.get(_key(kind, text)) for text in texts]
        hits = sum(v is not None for v in found)
        self.hits, self.misses = self.hits + hits, self.misses + len(texts) - hits
        return found

    def put(self, kind: str, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Store the vectors of texts not yet cached, as one new shard."""
        if len(texts) != len(vectors):
            raise ValueError(f"{len(texts)} texts but {len(vectors)} vectors")
        cached = self._loaded()
        new = {}
        for text, vector in zip(texts, vectors):
            key = _key(kind, text)
            if key not in cached and key not in new:
                new[key] = np.asarray(vector, dtype=np.float32)
        if new:
            self._write(new)
            cached.update(new)

    def _loaded(self) -> dict[bytes, np.ndarray]:
        if self._vectors is None:
            self._vectors = self._load()
        return self._vectors

    def _shards(self) -> list[tuple[Path, int]]:
        """Complete shards and their sizes, oldest first (the name orders equal times)."""
        shards = []
        for path in self.dir.glob("*.npz"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # merged away by another process meanwhile
                continue
            shards.append((stat.st_mtime, path.name, path, stat.st_size))
        return [(path, size) for _, _, path, size in sorted(shards)]

    def _load(self) -> dict[bytes, np.ndarray]:
        shards = self._shards()
        while shards and sum(size for _, size in shards) > self.max_bytes:
            shards.pop(0)[0].unlink(missing_ok=True)
        vectors: dict[bytes, np.ndarray] = {}
        readable = []
        for path, _ in shards:
            try:
                with np.load(path) as shard:
                    keys, values = shard["keys"], shard["vectors"]
            except (FileNotFoundError, OSError, ValueError, KeyError):  # gone, or not a shard of ours
                continue
            readable.append(path)
            for key, vector in zip(keys, values):
                vectors.setdefault(key.tobytes(), vector)  # the first vector of a text stays
        if len(readable) > SHARDS_BEFORE_MERGE:
            self._write(vectors)
            for path in readable:
                path.unlink(missing_ok=True)
        return vectors

    def _write(self, vectors: dict[bytes, np.ndarray]) -> None:
        if not vectors:
            return
        keys = np.frombuffer(b"".join(vectors), dtype=np.uint8).reshape(len(vectors), 16)
        shard = io.BytesIO()
        np.savez(shard, keys=keys, vectors=np.stack(list(vectors.values())))
        write_atomically(self.dir / f"{uuid.uuid4().hex}.npz", shard.getvalue())

def home_vector_cache(home: str | Path, encoder_id: str) -> TextVectorCache:
    """The cache of a MEDGRAPH_HOME: `$MEDGRAPH_HOME/cache/text_vectors/<encoder_id>/`."""
    return TextVectorCache(HomeLayout(home).text_vectors, encoder_id)
