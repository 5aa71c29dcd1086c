"""The GAT encoder of HIIM and its triple-classification head.

A2RAG's HIIM turns retrieved triples into graph tokens z = GNN([emb(h); emb(r); emb(t)])
(docs/ARCHITECTURE.md "The three methods"). The GNN is a 2-layer GAT over node features
(384-d MiniLM node embeddings, projected to `hidden`) whose attention also sees
the relation of every edge (a small embedding: a per-edge linear map of width
`hidden` doubles the cost of a step). It is pretrained by triple
classification: score(h, r, t) = MLP([z_h; e_r; z_t]) says whether a triple is
in UMLS. The first layer of that MLP is the triple vector `encode_triples`
returns, so the graph tokens are exactly what pretraining taught to tell true
triples from corrupted ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv


class GatModel(nn.Module):
    """Node features -> GAT node states z; (z_h, r, z_t) -> triple vector -> logit."""

    def __init__(self, in_dim: int, num_relations: int, hidden: int = 128, heads: int = 4, layers: int = 2,
                 dropout: float = 0.2, edge_dim: int = 16):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        # What a loaded model needs to be used on new triples, travelling with its weights: the
        # relation label of every relation code, and which embedding table (and encoder) made the
        # node features. Set by training.
        self.relation_names: tuple[str, ...] = ()
        self.feature_table: str = ""
        self.feature_encoder_id: str = ""
        self.dropout = dropout
        self.project = nn.Linear(in_dim, hidden)
        self.relation = nn.Embedding(num_relations, hidden)  # e_r of the triple scorer and graph tokens
        self.edge_relation = nn.Embedding(num_relations, edge_dim)  # what attention sees of a relation
        # Heads are concatenated back to `hidden`. No self-loops: the residual connection in
        # `forward` carries a node's own state (and is cheaper).
        self.convs = nn.ModuleList(
            GATConv(hidden, hidden // heads, heads=heads, dropout=dropout, edge_dim=edge_dim,
                    add_self_loops=False)
            for _ in range(layers)
        )
        self.triple = nn.Linear(3 * hidden, hidden)
        self.classify = nn.Linear(hidden, 1)

    def forward(self, x: Tensor, edge_index: Tensor, edge_type: Tensor,
                hop_nodes: Sequence[int] | None = None, hop_edges: Sequence[int] | None = None) -> Tensor:
        """Node states from features x (n, in_dim) and a typed graph over the same n nodes.

        With the hop sizes of a sampled subgraph (nodes and edges stored hop by hop),
        layer l only runs on the nodes and edges that can still reach a seed (PyG's
        "trim to layer"): the seeds' states are the same, and the hop-2 edges are
        processed by the first layer only. The result then has only the first
        `sum(hop_nodes[:2])` rows (seeds and hop-1 nodes).
        """
        h = self.project(x)
        edge_attr = self.edge_relation(edge_type)
        for layer, conv in enumerate(self.convs):
            if hop_nodes is not None and hop_edges is not None:
                reach = len(self.convs) - layer  # hops still to cross for a message to reach a seed
                nodes, edges = sum(hop_nodes[: reach + 1]), sum(hop_edges[:reach])
                h, edge_index, edge_attr = h[:nodes], edge_index[:, :edges], edge_attr[:edges]
            h = F.dropout(h, self.dropout, self.training)
            # Residual: a node whose edges were held out still carries its own features.
            h = h + F.elu(conv(h, edge_index, edge_attr))
        return h

    def relation_codes(self, relations: Sequence[str]) -> Tensor:
        """Relation labels -> the codes the model was trained with (an unknown label is an error)."""
        codes = {name: i for i, name in enumerate(self.relation_names)}
        missing = sorted({r for r in relations if r not in codes})
        if missing:
            raise KeyError(f"relations unknown to this GAT (trained on {len(codes)}): {missing[:5]}")
        return torch.tensor([codes[r] for r in relations], dtype=torch.long)

    def triple_vector(self, z_head: Tensor, relation: Tensor, z_tail: Tensor) -> Tensor:
        """(m, hidden) vectors of triples from the states of their ends and their relation codes."""
        return F.elu(self.triple(torch.cat([z_head, self.relation(relation), z_tail], dim=-1)))

    def score(self, z_head: Tensor, relation: Tensor, z_tail: Tensor) -> Tensor:
        """(m,) logits that the triples are true."""
        vector = F.dropout(self.triple_vector(z_head, relation, z_tail), self.dropout, self.training)
        return self.classify(vector).squeeze(-1)

    def encode_triples(self, x: Tensor, heads: Tensor, relations: Tensor, tails: Tensor,
                       edge_index: Tensor | None = None, edge_type: Tensor | None = None) -> Tensor:
        """Graph tokens of triples: z = GNN([emb(h); emb(r); emb(t)]), one (hidden,) vector per triple.

        `x` holds the features of the nodes the triples mention (local ids in
        `heads`/`tails`). Message passing runs over the triples themselves (the
        retrieved subgraph, as HIIM does) unless another local graph is given.
        """
        if edge_index is None:
            edge_index, edge_type = torch.stack([tails, heads]), relations
        z = self(x, edge_index, edge_type)
        return self.triple_vector(z[heads], relations, z[tails])
