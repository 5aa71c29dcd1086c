"""Fanout neighbour sampling over a CSR graph, with plain torch ops.

PyG's NeighborLoader needs `pyg-lib` or `torch-sparse`, and neither installs on
our machines (docs/ARCHITECTURE.md "Stack facts"). A 2-layer GAT over a full UMLS release
(~7M nodes, ~50M edges) cannot run full-batch, so every mini-batch takes its
seed nodes, samples up to k neighbours per node per hop without replacement,
and relabels the visited nodes into a small local graph. All work is tensor
ops over the whole frontier (no Python loop over nodes), so the same code runs
on CPU or, with the CSR on the GPU, on CUDA. When `pyg_lib` is importable and
the graph lives on the CPU, its C++ sampler is used instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

HAS_PYG_LIB = importlib.util.find_spec("pyg_lib") is not None


@dataclass(frozen=True)
class CsrGraph:
    """Out-edges of node i are `indptr[i]:indptr[i+1]`: neighbours `dst`, relation codes `relation`.

    Compact dtypes (int32 neighbours, int16 relations) keep a 50M-edge graph at
    ~0.5 GB, small enough to live on the GPU next to the model.
    """

    indptr: Tensor  # (N+1,) int64
    dst: Tensor  # (E,) int32 or int64
    relation: Tensor  # (E,) int16 or int64

    @property
    def num_nodes(self) -> int:
        return self.indptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.dst.numel()

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    def to(self, device: torch.device | str) -> CsrGraph:
        return CsrGraph(self.indptr.to(device), self.dst.to(device), self.relation.to(device))

    def sources(self) -> Tensor:
        """The source node of every edge (int64), expanded from `indptr`."""
        degree = self.indptr[1:] - self.indptr[:-1]
        return torch.repeat_interleave(torch.arange(self.num_nodes, device=self.device), degree)

    @classmethod
    def from_arrays(cls, indptr: np.ndarray, dst: np.ndarray, relation: np.ndarray) -> CsrGraph:
        """Wrap numpy CSR arrays (e.g. a `GraphIndex`'s) without copying them."""
        return cls(torch.from_numpy(np.asarray(indptr, dtype=np.int64)), torch.from_numpy(dst),
                   torch.from_numpy(relation))


@dataclass
class SampledSubgraph:
    """A PyG-style mini-batch: the local graph around `num_seeds` seed nodes.

    Local node i is global node `node_ids[i]`; the seeds come first, in the
    order given. Messages flow `edge_index[0] -> edge_index[1]`: from a sampled
    neighbour to the node that sampled it, labelled with the relation of the
    stored edge `node -relation-> neighbour`.
    """

    node_ids: Tensor  # (n,) int64 global node positions
    edge_index: Tensor  # (2, m) int64 local ids
    edge_type: Tensor  # (m,) int64 relation codes
    edge_ids: Tensor  # (m,) int64 positions in the sampled CsrGraph's edge arrays
    num_seeds: int
    # Nodes first reached and edges sampled at each hop (nodes: seeds first), stored in that order:
    # what lets a layer skip what cannot reach a seed any more (GatModel.forward).
    hop_nodes: tuple[int, ...] | None = None
    hop_edges: tuple[int, ...] | None = None

    def to(self, device: torch.device | str) -> SampledSubgraph:
        return SampledSubgraph(self.node_ids.to(device), self.edge_index.to(device),
                               self.edge_type.to(device), self.edge_ids.to(device), self.num_seeds,
                               self.hop_nodes, self.hop_edges)

    def drop_edges(self, keep: Tensor) -> SampledSubgraph:
        """The same nodes with only the edges where `keep` is true (order, and so hops, preserved)."""
        hop_edges = None
        if self.hop_edges is not None:
            hop_edges = tuple(int(part.sum()) for part in torch.split(keep, list(self.hop_edges)))
        return SampledSubgraph(self.node_ids, self.edge_index[:, keep], self.edge_type[keep],
                               self.edge_ids[keep], self.num_seeds, self.hop_nodes, hop_edges)


def _distinct_offsets(degree: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """(len(degree), k) distinct uniform offsets in [0, degree) for rows with degree > k.

    Floyd's algorithm, vectorized over rows: k steps of O(k) work each, whatever
    the degree, so hub concepts with 100k neighbours cost the same as leaves.
    """
    chosen = torch.empty((degree.numel(), k), dtype=torch.int64, device=degree.device)
    for i in range(k):
        top = degree - k + i  # draw from [0, top]; if taken, take `top` (never taken yet)
        draw = (torch.rand(degree.numel(), generator=generator, device=degree.device, dtype=torch.float64)
                * (top + 1)).long().minimum(top)
        taken = (chosen[:, :i] == draw[:, None]).any(dim=1)
        chosen[:, i] = torch.where(taken, top, draw)
    return chosen


def sample_hop(graph: CsrGraph, nodes: Tensor, k: int, generator: torch.Generator | None = None
               ) -> tuple[Tensor, Tensor]:
    """Up to k out-edges per node, without replacement (all of them when degree <= k or k < 0).

    Returns (owner, edge): for every sampled edge, the index into `nodes` of the node
    that sampled it and the edge's position in `graph`; grouped by owner, in order.
    """
    start = graph.indptr[nodes]
    degree = graph.indptr[nodes + 1] - start
    take = degree if k < 0 else degree.clamp(max=k)
    owner = torch.repeat_interleave(torch.arange(nodes.numel(), device=nodes.device), take)
    first = torch.cumsum(take, 0) - take
    offset = torch.arange(owner.numel(), device=nodes.device) - first[owner]  # 0..take-1 per owner
    if k >= 0:
        capped = degree > k
        if bool(capped.any()):
            # Capped owners hold exactly k consecutive entries each, in owner order: row-major `chosen`.
            offset[capped[owner]] = _distinct_offsets(degree[capped], k, generator).reshape(-1)
    return owner, start[owner] + offset


def _relabel(known: Tensor, found: Tensor) -> tuple[Tensor, Tensor]:
    """Local ids of `found` given the distinct `known` nodes (local ids 0..len-1), and the new
    nodes in order of first appearance (they get ids len(known), len(known)+1, ...)."""
    combined = torch.cat([known, found])
    unique, inverse = torch.unique(combined, return_inverse=True)
    positions = torch.arange(combined.numel(), device=combined.device)
    first = torch.full((unique.numel(),), combined.numel(), dtype=torch.int64, device=combined.device)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")
    is_new = first >= known.numel()
    new_slots = torch.nonzero(is_new).squeeze(1)
    new_slots = new_slots[torch.argsort(first[new_slots])]
    local = first.clone()  # a known node's first appearance is its local id
    local[new_slots] = known.numel() + torch.arange(new_slots.numel(), device=combined.device)
    return local[inverse[known.numel():]], unique[new_slots]


def sample_neighbors(graph: CsrGraph, seeds: Tensor, fanouts: Sequence[int],
                     generator: torch.Generator | None = None) -> SampledSubgraph:
    """The `len(fanouts)`-hop sampled neighbourhood of distinct `seeds`, in pure torch.

    Hop l samples `fanouts[l]` neighbours of every node first reached in hop l-1
    (the seeds for hop 0); nodes are relabelled in order of discovery, seeds first.
    """
    seeds = seeds.to(device=graph.device, dtype=torch.int64)
    nodes, frontier, frontier_local = seeds, seeds, torch.arange(seeds.numel(), device=graph.device)
    sources, targets, edges, hop_nodes = [], [], [], [seeds.numel()]
    for k in fanouts:
        owner, edge = sample_hop(graph, frontier, k, generator)
        neighbour_local, new_nodes = _relabel(nodes, graph.dst[edge].long())
        sources.append(neighbour_local)
        targets.append(frontier_local[owner])
        edges.append(edge)
        hop_nodes.append(new_nodes.numel())
        frontier_local = nodes.numel() + torch.arange(new_nodes.numel(), device=graph.device)
        nodes, frontier = torch.cat([nodes, new_nodes]), new_nodes
    edge_ids = torch.cat(edges) if edges else torch.empty(0, dtype=torch.int64, device=graph.device)
    edge_index = (torch.stack([torch.cat(sources), torch.cat(targets)]) if edges
                  else torch.empty((2, 0), dtype=torch.int64, device=graph.device))
    return SampledSubgraph(nodes, edge_index, graph.relation[edge_ids].long(), edge_ids, seeds.numel(),
                           tuple(hop_nodes), tuple(e.numel() for e in edges))


def _sample_with_pyg_lib(graph: CsrGraph, seeds: Tensor, fanouts: Sequence[int]) -> SampledSubgraph:
    """The same subgraph from pyg-lib's C++ sampler (CPU only; its own random stream).

    `csc=True` makes it return (row, col) = (sampled neighbour, sampling node),
    which is our message direction; edge ids are positions in `col` = `dst`.
    """
    import pyg_lib

    dst = graph.dst if graph.dst.dtype == torch.int64 else graph.dst.long()
    out = pyg_lib.sampler.neighbor_sample(graph.indptr, dst, seeds.long(), list(fanouts), csc=True,
                                          replace=False, directed=True, disjoint=False, return_edge_id=True)
    row, col, node_ids, edge_ids = out[:4]
    hop_nodes, hop_edges = (tuple(out[4]), tuple(out[5])) if len(out) >= 6 else (None, None)  # newer pyg-lib
    return SampledSubgraph(node_ids, torch.stack([row, col]), graph.relation[edge_ids].long(), edge_ids,
                           seeds.numel(), hop_nodes, hop_edges)


class NeighborSampler:
    """Samples mini-batch subgraphs of one graph with fixed fanouts (e.g. (10, 10) for 2 GAT layers).

    `backend`: "torch" (deterministic given the generator), "pyg_lib", or "auto"
    (pyg-lib when installed and the graph is on the CPU, else torch).
    """

    def __init__(self, graph: CsrGraph, fanouts: Sequence[int], backend: str = "auto"):
        if backend not in ("auto", "torch", "pyg_lib"):
            raise ValueError(f"backend must be auto, torch or pyg_lib, got {backend!r}")
        if backend == "pyg_lib" and not HAS_PYG_LIB:
            raise ImportError("backend='pyg_lib' needs the pyg-lib package")
        on_cpu = graph.device.type == "cpu"
        use_pyg_lib = backend == "pyg_lib" or (backend == "auto" and HAS_PYG_LIB and on_cpu)
        self.graph, self.fanouts = graph, tuple(int(k) for k in fanouts)
        self.backend = "pyg_lib" if use_pyg_lib else "torch"

    def __call__(self, seeds: Tensor, generator: torch.Generator | None = None) -> SampledSubgraph:
        if self.backend == "pyg_lib":
            return _sample_with_pyg_lib(self.graph, seeds, self.fanouts)
        return sample_neighbors(self.graph, seeds, self.fanouts, generator)
