"""HIIM graph tokens: retrieved triples -> GAT triple vectors -> W_proj -> the LLM's input-embedding space.

A2RAG's HIIM (docs/ARCHITECTURE.md) places one soft token per retrieved triple after the
text of the prompt, z = GNN([emb(h); emb(r); emb(t)]) projected by W_proj. The
GAT is the pretrained champion (frozen); W_proj is trained with the LLM frozen
too (`medgraph.rl.hiim`, above the methods: its examples are A2RAG's prompts).
This module holds the model only: the projector, the node features and the
tokenizer that chains them, and the loading of a registered pair.

A registered projector records the GAT version it was trained with and the
LLM it speaks to: `load_champion_graph_tokenizer` pairs them again, and
declines (returns None, so A2RAG falls back to text) for any other LLM.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from medgraph.embed.tables import read_embeddings
from medgraph.gnn.model import GatModel
from medgraph.kg.graph import Triple
from medgraph.llm.base import ChatModel
from medgraph.s3 import S3Lake
from medgraph.settings import redact_uri
from medgraph.storage import Lake, Warehouse
from medgraph.tracking import HIIM_PROJECTOR_MODEL, Tracking

log = logging.getLogger(__name__)


class HiimProjector(nn.Module):
    """W_proj: GAT triple vectors (gat_hidden) -> LLM input embeddings (llm_hidden).

    The output is rescaled to the typical norm of the LLM's token embeddings, so
    graph tokens start on the scale the LLM's first layer expects.
    """

    def __init__(self, gat_hidden: int, llm_hidden: int, token_norm: float):
        super().__init__()
        self.proj = nn.Linear(gat_hidden, llm_hidden)
        self.register_buffer("token_norm", torch.tensor(float(token_norm)))
        # Provenance that travels with the weights (set by training).
        self.llm_name: str = ""
        self.gat_model_uri: str = ""

    def forward(self, triple_vectors: Tensor) -> Tensor:
        projected = self.proj(triple_vectors)
        return F.normalize(projected, dim=-1) * self.token_norm


class NodeFeatures:
    """Node feature vectors by CUI, from the embedding table the GAT was trained on."""

    def __init__(self, lake: Lake | S3Lake, table: str):
        ids, vectors = read_embeddings(lake, table)
        self.table = table
        self.row = {str(cui): i for i, cui in enumerate(ids)}
        self.vectors = torch.from_numpy(np.array(vectors, dtype=np.float32))  # a writable copy

    def __call__(self, cuis: Sequence[str]) -> Tensor:
        """(len(cuis), dim); zeros for a CUI without an embedding (a node added since)."""
        out = torch.zeros(len(cuis), self.vectors.shape[1])
        known = [(i, self.row[c]) for i, c in enumerate(cuis) if c in self.row]
        if known:
            at, rows = zip(*known, strict=True)
            out[list(at)] = self.vectors[list(rows)]
        return out


class GraphTokenizer:
    """Triples -> (n, llm_hidden) graph tokens, with the GAT run over the triples' own subgraph."""

    def __init__(self, gat: GatModel, projector: HiimProjector, features: NodeFeatures):
        self.gat = gat.eval()
        self.projector = projector
        self.features = features

    def triple_vectors(self, triples: Sequence[Triple]) -> Tensor:
        """(n, gat_hidden) frozen GAT encodings z = GNN([emb(h); emb(r); emb(t)])."""
        nodes = list(dict.fromkeys(c for t in triples for c in (t.src_cui, t.dst_cui)))
        local = {cui: i for i, cui in enumerate(nodes)}
        heads = torch.tensor([local[t.src_cui] for t in triples], dtype=torch.long)
        tails = torch.tensor([local[t.dst_cui] for t in triples], dtype=torch.long)
        relations = self.gat.relation_codes([t.relation for t in triples])
        with torch.no_grad():
            return self.gat.encode_triples(self.features(nodes), heads, relations, tails)

    def encode(self, triples: Sequence[Triple]) -> Tensor:
        """Graph tokens for `triples` (at least one), ready for `ChatModel.generate(graph_tokens=...)`."""
        if not triples:
            raise ValueError("graph tokens need at least one triple")
        vectors = self.triple_vectors(triples)
        return self.projector(vectors.to(self.projector.proj.weight.device))


# --- loading the registered pair --------------------------------------------------------------------------


def load_champion_graph_tokenizer(llm: ChatModel, warehouse: Warehouse,
                                  tracking: Tracking) -> GraphTokenizer | None:
    """The champion projector and the GAT it was trained with, for `llm`; None (with the reason
    logged) when none is registered, or it was trained for another LLM, or `llm` takes no graph tokens.
    A registered projector or GAT whose files cannot be read is a ModelUnavailableError naming it."""
    return champion_graph_tokenizer(llm, warehouse, tracking)[0]


_WITHOUT_HIIM = "or answer without graph tokens (--method a2rag-no-hiim)"


def champion_graph_tokenizer(llm: ChatModel, warehouse: Warehouse,
                             tracking: Tracking) -> tuple[GraphTokenizer | None, str]:
    """`load_champion_graph_tokenizer` and why there is none ("" when there is one). Models are read from
    their files without writing anything (`Tracking.load_model`)."""
    import mlflow

    if not llm.supports_graph_tokens:
        return _hiim_off(f"{llm.name} takes text only")
    tracking_uri = tracking.tracking_uri
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).exists():
        # and do not create one by asking
        return _hiim_off(f"no HIIM projector registered (no MLflow database at {redact_uri(tracking_uri)})")
    name = HIIM_PROJECTOR_MODEL.name
    version = tracking.champion_version(name)
    if version is None:
        return _hiim_off(f"no HIIM projector registered (no {name}@champion in {redact_uri(tracking_uri)})")
    projector = tracking.load_model(f"models:/{name}/{version}",
                                    lambda path: mlflow.pytorch.load_model(path, map_location="cpu"),
                                    what_to_do=_WITHOUT_HIIM)
    if projector.llm_name != llm.name or projector.proj.out_features != llm.hidden_size:
        return _hiim_off(f"the champion projector {name} v{version} speaks to {projector.llm_name}, not {llm.name}")
    gat = tracking.load_model(projector.gat_model_uri, lambda path: mlflow.pytorch.load_model(path, map_location="cpu"),
                              what_to_do=_WITHOUT_HIIM)
    tokenizer = GraphTokenizer(gat, projector.to(llm.model.device), NodeFeatures(warehouse.lake, gat.feature_table))
    return tokenizer, ""


def _hiim_off(reason: str) -> tuple[None, str]:
    log.info("HIIM off: %s", reason)
    return None, reason
