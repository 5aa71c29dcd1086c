"""GAT pretraining by triple classification on the KG (the `gat_model` asset's science).

Positives are the edges of `kg.kg_edges`; negatives are corrupted triples (head
or tail replaced by a random node) that are not in the KG ("filtered"). Edges
are split train/validation/test by a stable hash of their *unordered node
pair*, so an edge (a, r, b) and its reverse-direction twin (b, r', a) — UMLS
lists most relations both ways — always land in the same split, and the
message-passing graph holds training edges only: a held-out triple is never
visible to the model it evaluates. Within a mini-batch, every edge between the
two ends of a scored triple is also dropped from the sampled subgraph, so the
model cannot learn "an edge is true when I can see it" during training and
then face held-out edges it cannot see.

Mini-batches: seed triples -> their distinct end nodes -> fanout neighbour
sampling (medgraph.gnn.sampling) -> GAT on the local graph -> scores. Memory is
the graph plus one batch, so a full UMLS release (~7M nodes, 50M edges) trains
on one GPU. AMP (bf16, or fp16 with a GradScaler) is used on CUDA only; on the
CPU a run is deterministic given the seed, including across a resume from a
checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from medgraph.embed.tables import read_embeddings
from medgraph.files import write_atomically
from medgraph.gnn.model import GatModel
from medgraph.gnn.sampling import CsrGraph, NeighborSampler
from medgraph.kg.csr import GraphIndex, build_graph_index
from medgraph.s3 import S3Lake
from medgraph.settings import profile_config
from medgraph.storage import Lake, Warehouse

log = logging.getLogger(__name__)

TRAIN, VALID, TEST = 0, 1, 2
LogFn = Callable[[int, dict[str, float]], None]

# Fields a resumed run may change: how long it trains and how it reports, not what it computes.
_RESUMABLE_CHANGES = {"epochs", "patience", "device", "progress", "log_every", "checkpoint_every"}


@dataclass(frozen=True)
class GatConfig:
    """Model, sampling and optimisation settings of one pretraining run."""

    hidden: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.2
    edge_dim: int = 16  # relation embedding seen by attention
    fanouts: tuple[int, ...] = (10, 10)  # neighbours per node per hop, one entry per layer
    lr: float = 1e-3
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 512  # positive seed edges per step
    negatives: int = 1  # corrupted triples per positive in training
    epochs: int = 5
    steps_per_epoch: int | None = None  # None: one pass over the training edges
    patience: int = 2  # epochs without a better validation ROC-AUC before stopping
    split: tuple[float, float, float] = (0.9, 0.05, 0.05)
    split_seed: int = 0  # which edges are held out; keep it fixed to compare runs
    seed: int = 0  # initialisation, batch order, sampling, negatives
    eval_edges: int | None = None  # validation/test positives evaluated (None: all)
    eval_batch_size: int = 128  # positives per evaluation step, each with 1 + rank_negatives negatives
    rank_negatives: int = 50  # K filtered negatives per positive for MRR / Hits@10
    device: str = "auto"  # auto: cuda when available
    amp: bool = True  # mixed precision on CUDA (never on the CPU)
    sampler: str = "auto"  # auto | torch | pyg_lib (see NeighborSampler)
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of every epoch only
    log_every: int = 50
    progress: bool = False

    @classmethod
    def profile(cls, name: str, **overrides: object) -> GatConfig:
        """`tiny` (seconds on a CPU, tests), `demo` (minutes on a CPU), `full` (a UMLS release on a GPU)."""
        return profile_config(GAT_PROFILES, "GAT", name, **overrides)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


GAT_PROFILES: dict[str, GatConfig] = {
    "tiny": GatConfig(hidden=64, heads=4, fanouts=(10, 10), lr=3e-3, batch_size=256, epochs=6, patience=3,
                      eval_batch_size=256, log_every=10),
    "demo": GatConfig(hidden=128, heads=4, fanouts=(10, 10), lr=2e-3, batch_size=1024, epochs=3,
                      steps_per_epoch=200, eval_edges=5_000, log_every=50, progress=True),
    "full": GatConfig(hidden=256, heads=8, fanouts=(15, 10), lr=1e-3, batch_size=4096, epochs=3,
                      eval_edges=20_000, eval_batch_size=512, checkpoint_every=2_000, log_every=200,
                      progress=True),
}


@dataclass
class GatResult:
    """A trained model (best validation epoch, CPU, eval mode) and how it got there."""

    model: GatModel
    metrics: dict[str, float]  # valid_* and test_*: roc_auc, accuracy, mrr, hits_at_10; threshold,
    # valid_roc_auc_untrained (the same model untrained, on the same validation edges: the gate's baseline), ...
    history: list[dict[str, float]]  # one entry per epoch
    config: GatConfig
    timings: dict[str, float]  # seconds per phase and training edges_per_second
    graph: dict[str, int] = field(default_factory=dict)  # nodes, relations, edges per split
    relations: tuple[str, ...] = ()  # relation label of every relation code (the model's e_r rows)


# --- data: stable split, message-passing graph, known triples -----------------------------------------------

_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)


def node_hashes(cuis: np.ndarray) -> np.ndarray:
    """64-bit FNV-1a of every CUI (fixed-width bytes): the same on every machine and release,
    unlike Python's salted hash() or node positions, which shift when concepts are added."""
    codes = np.frombuffer(np.ascontiguousarray(cuis).tobytes(), dtype=np.uint8).reshape(len(cuis), -1)
    hashes = np.full(len(cuis), _FNV_OFFSET, dtype=np.uint64)
    for byte in codes.T:  # a loop over the ~8 byte positions, vectorized over all nodes
        mixed = (hashes ^ byte.astype(np.uint64)) * _FNV_PRIME
        hashes = np.where(byte != 0, mixed, hashes)  # padding bytes do not count
    return hashes


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def edge_sources(index: GraphIndex) -> np.ndarray:
    return np.repeat(np.arange(index.num_nodes, dtype=np.int64), np.diff(index.indptr))


def split_edges(index: GraphIndex, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05),
                seed: int = 0) -> np.ndarray:
    """TRAIN / VALID / TEST (int8) for every edge, from a hash of its unordered CUI pair and `seed`:
    all edges between two concepts, in both directions, share one split."""
    if not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"split fractions must sum to 1, got {fractions}")
    hashes = node_hashes(index.cuis)
    a, b = hashes[edge_sources(index)], hashes[index.dst]
    mixed = _splitmix64(np.minimum(a, b) ^ _splitmix64(np.maximum(a, b) ^ np.uint64(seed)))
    unit = (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # uniform in [0, 1)
    split = np.full(index.num_edges, TRAIN, dtype=np.int8)
    split[unit >= fractions[0]] = VALID
    split[unit >= fractions[0] + fractions[1]] = TEST
    return split


def message_passing_graph(index: GraphIndex, split: np.ndarray) -> CsrGraph:
    """The CSR of training edges only: what the GAT sees in training *and* evaluation."""
    keep = split == TRAIN
    counts = np.bincount(edge_sources(index)[keep], minlength=index.num_nodes)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return CsrGraph.from_arrays(indptr, index.dst[keep], index.relation[keep])


class KnownTriples:
    """Every (h, r, t) of the KG as sorted int64 keys: the filter for corrupted triples."""

    def __init__(self, triples: Tensor, num_nodes: int, num_relations: int):
        self.num_nodes, self.num_relations = num_nodes, num_relations
        self.keys = torch.sort(self._key(triples)).values

    def _key(self, triples: Tensor) -> Tensor:
        return (triples[:, 0] * self.num_relations + triples[:, 1]) * self.num_nodes + triples[:, 2]

    def to(self, device: torch.device) -> KnownTriples:
        moved = copy.copy(self)
        moved.keys = self.keys.to(device)
        return moved

    def contains(self, triples: Tensor) -> Tensor:
        key = self._key(triples)
        found = torch.searchsorted(self.keys, key).clamp(max=self.keys.numel() - 1)
        return self.keys[found] == key


@dataclass
class PreparedGraph:
    """Everything training needs from a GraphIndex, built once (it is the slow part on 50M edges)."""

    num_nodes: int
    relations: tuple[str, ...]
    graph_version: str
    split_seed: int
    message_passing: CsrGraph
    train: Tensor  # (n, 3) int64 (h, r, t)
    valid: Tensor
    test: Tensor
    known: KnownTriples

    @property
    def num_relations(self) -> int:
        return len(self.relations)

    def sizes(self) -> dict[str, int]:
        return {"nodes": self.num_nodes, "relations": self.num_relations,
                "message_passing_edges": self.message_passing.num_edges, "train_edges": len(self.train),
                "valid_edges": len(self.valid), "test_edges": len(self.test)}


def prepare_graph(index: GraphIndex, config: GatConfig) -> PreparedGraph:
    """Split the edges, build the training message-passing graph and the filter of known triples."""
    split = split_edges(index, config.split, config.split_seed)
    triples = torch.from_numpy(np.stack([edge_sources(index), index.relation.astype(np.int64),
                                         index.dst.astype(np.int64)], axis=1))
    labels = torch.from_numpy(split)
    return PreparedGraph(
        num_nodes=index.num_nodes,
        relations=tuple(relation for _, _, relation in index.relations),
        graph_version=index.version,
        split_seed=config.split_seed,
        message_passing=message_passing_graph(index, split),
        train=triples[labels == TRAIN], valid=triples[labels == VALID], test=triples[labels == TEST],
        known=KnownTriples(triples, index.num_nodes, len(index.relations)),
    )


FEATURE_TABLE = "node_description_embeddings"  # relation-free node texts: features that cannot leak edges


def node_features(lake: Lake | S3Lake, index: GraphIndex, table: str = FEATURE_TABLE) -> Tensor:
    """(num_nodes, dim) float32 features aligned with the index; zeros for nodes without an embedding."""
    path = lake.table_path("embeddings", table)
    if not lake.exists(path):
        raise FileNotFoundError(f"no node embeddings at {path}: materialize `{table}` before the GAT")
    ids, vectors = read_embeddings(lake, table)
    positions = index.positions([str(i) for i in ids])
    found = positions >= 0
    features = np.zeros((index.num_nodes, vectors.shape[1]), dtype=np.float32)
    features[positions[found]] = vectors[found]
    if not found.all():
        log.warning("%s: %d embedded ids are not KG nodes", table, int((~found).sum()))
    return torch.from_numpy(features)


# --- negatives and scoring ----------------------------------------------------------------------------------


def corrupt(positives: Tensor, num_nodes: int, known: KnownTriples, per_positive: int,
            generator: torch.Generator | None = None, max_tries: int = 20) -> Tensor:
    """`per_positive` corrupted copies of every positive (grouped by positive): head or tail (at random)
    replaced by a random node, redrawn while the triple is a known edge or a self-loop."""
    out = positives.repeat_interleave(per_positive, dim=0)
    rows = torch.arange(out.shape[0], device=out.device)
    column = torch.where(torch.rand(out.shape[0], generator=generator, device=out.device) < 0.5, 0, 2)
    redraw = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    for _ in range(max_tries):
        todo = rows[redraw]
        out[todo, column[todo]] = torch.randint(num_nodes, (todo.numel(),), generator=generator,
                                                device=out.device)
        redraw = known.contains(out) | (out[:, 0] == out[:, 2])
        if not bool(redraw.any()):
            break
    return out


def scored_pair_edges(edge_index: Tensor, heads: Tensor, tails: Tensor, num_nodes: int) -> Tensor:
    """Which edges of a local graph join the two ends of a scored triple (in either direction)."""
    def pair_key(a: Tensor, b: Tensor) -> Tensor:
        return torch.minimum(a, b) * num_nodes + torch.maximum(a, b)

    return torch.isin(pair_key(edge_index[0], edge_index[1]), pair_key(heads, tails))


def score_triples(model: GatModel, sampler: NeighborSampler, features: Tensor, triples: Tensor,
                  generator: torch.Generator | None, amp_dtype: torch.dtype | None) -> Tensor:
    """Logits of a batch of (h, r, t) triples: sample the neighbourhood of their ends, hide the
    edges between every scored pair, run the GAT, score."""
    device = triples.device
    ends, local = torch.unique(torch.cat([triples[:, 0], triples[:, 2]]), return_inverse=True)
    heads, tails = local[: len(triples)], local[len(triples):]
    batch = sampler(ends.to(sampler.graph.device), generator).to(device)
    batch = batch.drop_edges(~scored_pair_edges(batch.edge_index, heads, tails, batch.node_ids.numel()))
    x = features[batch.node_ids.to(features.device)].to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        z = model(x, batch.edge_index, batch.edge_type, batch.hop_nodes, batch.hop_edges)
        logits = model.score(z[heads], triples[:, 1], z[tails])
    return logits.float()


# --- metrics ------------------------------------------------------------------------------------------------


def roc_auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a random positive scores above a random negative), ties counting half (Mann-Whitney)."""
    ordered = np.sort(negative)
    below = np.searchsorted(ordered, positive, side="left")
    not_above = np.searchsorted(ordered, positive, side="right")
    return float((below + not_above).sum() / (2.0 * len(positive) * len(negative)))


def best_threshold(positive: np.ndarray, negative: np.ndarray) -> float:
    """The logit threshold (predict true when >= it) with the best accuracy on these scores."""
    candidates = np.unique(np.concatenate([positive, negative]))
    true_positive = len(positive) - np.searchsorted(np.sort(positive), candidates, side="left")
    true_negative = np.searchsorted(np.sort(negative), candidates, side="left")
    return float(candidates[np.argmax(true_positive + true_negative)])


def accuracy(positive: np.ndarray, negative: np.ndarray, threshold: float) -> float:
    correct = (positive >= threshold).sum() + (negative < threshold).sum()
    return float(correct / (len(positive) + len(negative)))


def ranking_metrics(positive: np.ndarray, ranked_negatives: np.ndarray) -> dict[str, float]:
    """MRR and Hits@10 of every positive among its K negatives (row i of `ranked_negatives`), ties half."""
    above = (ranked_negatives > positive[:, None]).sum(1)
    rank = 1 + above + 0.5 * (ranked_negatives == positive[:, None]).sum(1)
    return {"mrr": float(np.mean(1.0 / rank)), "hits_at_10": float(np.mean(rank <= 10))}


@torch.no_grad()
def evaluate(model: GatModel, sampler: NeighborSampler, features: Tensor, positives: Tensor,
             known: KnownTriples, config: GatConfig, seed: int, amp_dtype: torch.dtype | None,
             ranking: bool = True) -> dict[str, np.ndarray]:
    """Scores of held-out positives, one filtered negative each (classification) and, with `ranking`,
    `rank_negatives` filtered negatives each. Same negatives and samples for the same seed."""
    device = positives.device
    generator = torch.Generator(device=device).manual_seed(seed)
    if config.eval_edges is not None and len(positives) > config.eval_edges:
        pick = torch.randperm(len(positives), generator=generator, device=device)[: config.eval_edges]
        positives = positives[pick.sort().values]
    was_training = model.training
    model.eval()
    k = config.rank_negatives if ranking else 0
    scores: dict[str, list[Tensor]] = {"positive": [], "negative": [], "ranked": []}
    for start in range(0, len(positives), config.eval_batch_size):
        batch = positives[start:start + config.eval_batch_size]
        negatives = corrupt(batch, known.num_nodes, known, 1 + k, generator).view(len(batch), 1 + k, 3)
        logits = score_triples(model, sampler, features, torch.cat([batch, negatives.view(-1, 3)]),
                               generator, amp_dtype)
        others = logits[len(batch):].view(len(batch), 1 + k)
        scores["positive"].append(logits[: len(batch)])
        scores["negative"].append(others[:, 0])
        scores["ranked"].append(others[:, 1:])
    model.train(was_training)
    return {name: torch.cat(values).cpu().numpy() for name, values in scores.items()}


def split_metrics(scores: dict[str, np.ndarray], threshold: float, ranking: bool) -> dict[str, float]:
    metrics = {"roc_auc": roc_auc(scores["positive"], scores["negative"]),
               "accuracy": accuracy(scores["positive"], scores["negative"], threshold)}
    if ranking:
        metrics.update(ranking_metrics(scores["positive"], scores["ranked"]))
    return metrics


# --- training -----------------------------------------------------------------------------------------------


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _place_features(features: Tensor, device: torch.device) -> Tensor:
    """On the GPU when the table takes under half of its free memory, else pinned in host memory."""
    if device.type != "cuda" or features.device == device:
        return features
    if features.numel() * features.element_size() < 0.5 * torch.cuda.mem_get_info(device)[0]:
        return features.to(device)
    return features if features.is_pinned() else features.pin_memory()


def _amp_dtype(device: torch.device, enabled: bool) -> torch.dtype | None:
    if device.type != "cuda" or not enabled:
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _jsonable(config: GatConfig) -> dict[str, object]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.as_dict().items()}


def _new_state() -> dict[str, object]:
    """Training progress: with the model, optimizer and RNG states, all a resumed run needs."""
    return {"step": 0, "epoch": 0, "step_in_epoch": 0, "epoch_loss": 0.0, "epoch_steps": 0, "history": [],
            "best_auc": -1.0, "best_epoch": -1, "best_model": None, "bad_epochs": 0, "stopped": False,
            "train_seconds": 0.0, "edges_seen": 0}


def _save_checkpoint(directory: Path, state: dict[str, object], model: GatModel,
                     optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     generator: torch.Generator, config: GatConfig, data: PreparedGraph) -> None:
    """Write `last.pt` atomically: a crash while saving leaves the previous checkpoint."""
    device = generator.device
    rng = {"generator": generator.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    checkpoint = io.BytesIO()  # the GAT's checkpoint is small: serialize in memory, then one atomic write
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "rng": rng, "state": state, "config": _jsonable(config),
                "split_seed": data.split_seed, "graph_version": data.graph_version,
                "relations": list(data.relations)}, checkpoint)
    write_atomically(directory / "last.pt", checkpoint.getvalue())


def _load_checkpoint(path: Path, model: GatModel, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, generator: torch.Generator, config: GatConfig,
                     data: PreparedGraph) -> dict[str, object]:
    """Restore model, optimizer and RNG states from `path`; returns the saved training state."""
    device = generator.device
    saved = torch.load(path, map_location=device, weights_only=True)
    if saved["graph_version"] != data.graph_version:
        raise ValueError(f"{path} is of graph {saved['graph_version']}, not {data.graph_version}: "
                         f"use a new checkpoint directory or resume=False")
    differ = sorted(k for k, v in _jsonable(config).items()
                    if k not in _RESUMABLE_CHANGES and saved["config"].get(k) != v)
    if differ:
        raise ValueError(f"{path} was trained with other settings ({', '.join(differ)}): "
                         f"use the same config or resume=False")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    generator.set_state(saved["rng"]["generator"].cpu())
    torch.set_rng_state(saved["rng"]["torch"].cpu())
    if device.type == "cuda" and saved["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(saved["rng"]["cuda"].cpu(), device)
    log.info("resumed from %s at step %d (epoch %d)", path, saved["state"]["step"], saved["state"]["epoch"])
    return saved["state"]


def _train_step(model: GatModel, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                sampler: NeighborSampler, features: Tensor, positives: Tensor, known: KnownTriples,
                config: GatConfig, generator: torch.Generator, amp_dtype: torch.dtype | None) -> float:
    """One optimizer step on positive edges and `config.negatives` corrupted triples each; the loss."""
    device = positives.device
    negatives = corrupt(positives, known.num_nodes, known, config.negatives, generator)
    labels = torch.cat([torch.ones(len(positives), device=device),
                        torch.zeros(len(negatives), device=device)])
    logits = score_triples(model, sampler, features, torch.cat([positives, negatives]), generator, amp_dtype)
    # pos_weight: positives weigh as much as their `negatives` corrupted triples together.
    loss = F.binary_cross_entropy_with_logits(logits, labels,
                                              pos_weight=torch.tensor(float(config.negatives), device=device))
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()  # a sync, which also makes the step times honest on CUDA


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On the CPU, torch's deterministic kernels while the block runs. The backward of advanced indexing
    (`index_put_` with accumulate) sums in an order that depends on thread timing on two or more threads, so two
    runs of one seed differed by ~1e-7 in validation ROC-AUC; with these kernels they are identical, at the same
    speed (benchmarks/README.md `gat_train.py`). On CUDA the fast kernels stay (AMP is not bitwise reproducible)."""
    if device.type != "cpu":
        yield
        return
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def fit_gat(data: PreparedGraph, features: Tensor, config: GatConfig,
            checkpoint_dir: str | Path | None = None, resume: bool = True,
            log_fn: LogFn | None = None) -> GatResult:
    """Pretrain a GatModel on prepared splits; `features` is (num_nodes, dim) on any device. On the CPU a run is
    bitwise reproducible given the seed (`deterministic_kernels`)."""
    with deterministic_kernels(pick_device(config.device)):
        return _fit_gat(data, features, config, checkpoint_dir, resume, log_fn)


def _check_inputs(data: PreparedGraph, features: Tensor, config: GatConfig) -> None:
    if features.shape[0] != data.num_nodes:
        raise ValueError(f"features have {features.shape[0]} rows for {data.num_nodes} nodes")
    if len(config.fanouts) != config.layers:
        raise ValueError(f"one fanout per GAT layer: {config.layers} layers, fanouts {config.fanouts}")


def _timings(state: dict, started: float, prepared: float, trained: float) -> dict[str, float]:
    """Seconds of setup, training and evaluation (to now), and the training edges per second."""
    finished = time.perf_counter()
    return {"setup_seconds": prepared - started, "train_seconds": state["train_seconds"],
            "eval_seconds": finished - trained, "total_seconds": finished - started,
            "edges_per_second": state["edges_seen"] / max(state["train_seconds"], 1e-9)}


def _epoch_batches(state: dict, train_edges: int, config: GatConfig, device: torch.device) -> Iterator[Tensor]:
    """The rest of the current epoch's batches, as rows of the training edges. The batch order depends on (seed,
    epoch) only: a run resumed mid-epoch sees the same batches."""
    epoch, steps_per_epoch = state["epoch"], config.steps_per_epoch or math.ceil(train_edges / config.batch_size)
    order = torch.randperm(train_edges, generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch))
    order = order.to(device)
    for i in tqdm(range(state["step_in_epoch"], steps_per_epoch), desc=f"gat epoch {epoch}", unit="step",
                  initial=state["step_in_epoch"], total=steps_per_epoch, disable=not config.progress):
        batch = torch.arange(i * config.batch_size, (i + 1) * config.batch_size, device=device)
        yield order[batch % train_edges]


def _count_step(state: dict, loss: float, step_started: float, config: GatConfig) -> None:
    state["train_seconds"] += time.perf_counter() - step_started
    state["edges_seen"] += config.batch_size
    state["epoch_loss"] += loss
    state["epoch_steps"] += 1
    state["step"] += 1
    state["step_in_epoch"] += 1


def _end_epoch(state: dict, model: GatModel, valid_auc: float, epoch_started: float, config: GatConfig) -> dict:
    """Record an epoch's validation ROC-AUC in `state`: keep the best weights, stop after `patience` epochs
    without a gain, and move to the next epoch. The epoch's history record."""
    epoch = state["epoch"]
    record = {"epoch": epoch, "step": state["step"], "train_loss": state["epoch_loss"] / max(state["epoch_steps"], 1),
              "valid_roc_auc": valid_auc, "seconds": time.perf_counter() - epoch_started}
    state["history"].append(record)
    if valid_auc > state["best_auc"]:
        state.update(best_auc=valid_auc, best_epoch=epoch, bad_epochs=0,
                     best_model={k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    else:
        state["bad_epochs"] += 1
        state["stopped"] = state["bad_epochs"] >= config.patience
    state.update(epoch=epoch + 1, step_in_epoch=0, epoch_loss=0.0, epoch_steps=0)
    log.info("gat epoch %d: loss %.4f, valid ROC-AUC %.4f (best %.4f at epoch %d)%s", epoch, record["train_loss"],
             valid_auc, state["best_auc"], state["best_epoch"], ", early stop" if state["stopped"] else "")
    return record


def _final_metrics(model: GatModel, sampler: NeighborSampler, features: Tensor, valid: Tensor, test: Tensor,
                   known: Tensor, config: GatConfig, amp_dtype: torch.dtype | None) -> dict[str, float]:
    """Validation and test metrics of the model: the threshold is chosen on validation, then applied to test."""
    valid_scores = evaluate(model, sampler, features, valid, known, config, config.seed + 1, amp_dtype)
    test_scores = evaluate(model, sampler, features, test, known, config, config.seed + 2, amp_dtype)
    threshold = best_threshold(valid_scores["positive"], valid_scores["negative"])
    metrics = {f"valid_{k}": v for k, v in split_metrics(valid_scores, threshold, True).items()}
    metrics.update({f"test_{k}": v for k, v in split_metrics(test_scores, threshold, True).items()})
    return {**metrics, "threshold": threshold}


def _fit_gat(data: PreparedGraph, features: Tensor, config: GatConfig, checkpoint_dir: str | Path | None,
             resume: bool, log_fn: LogFn | None) -> GatResult:
    _check_inputs(data, features, config)
    started = time.perf_counter()
    device = pick_device(config.device)
    amp_dtype = _amp_dtype(device, config.amp)
    features = _place_features(features, device)
    sampler = NeighborSampler(data.message_passing.to(device), config.fanouts, config.sampler)
    known = data.known.to(device)
    train, valid, test = data.train.to(device), data.valid.to(device), data.test.to(device)
    torch.manual_seed(config.seed)
    model = GatModel(features.shape[1], data.num_relations, config.hidden, config.heads, config.layers,
                     config.dropout, config.edge_dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    # The champion gate's baseline: this architecture and initialisation untrained, scored exactly as the
    # final model is (same validation edges, negatives and neighbour samples: evaluate seeds its own generator).
    untrained = evaluate(model, sampler, features, valid, known, config, config.seed + 1, amp_dtype)
    untrained_auc = roc_auc(untrained["positive"], untrained["negative"])
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    generator = torch.Generator(device=device).manual_seed(config.seed)  # negatives and neighbour samples
    state = _new_state()
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
    if checkpoint_dir and resume and (checkpoint_dir / "last.pt").exists():
        state = _load_checkpoint(checkpoint_dir / "last.pt", model, optimizer, scaler, generator, config, data)

    def checkpoint() -> None:
        if checkpoint_dir:
            _save_checkpoint(checkpoint_dir, state, model, optimizer, scaler, generator, config, data)

    prepared = time.perf_counter()
    model.train()
    while state["epoch"] < config.epochs and not state["stopped"]:
        epoch_started = time.perf_counter()
        for rows in _epoch_batches(state, len(train), config, device):
            step_started = time.perf_counter()
            loss = _train_step(model, optimizer, scaler, sampler, features, train[rows], known, config, generator,
                               amp_dtype)
            _count_step(state, loss, step_started, config)
            if config.checkpoint_every and state["step"] % config.checkpoint_every == 0:
                checkpoint()
            if log_fn and state["step"] % config.log_every == 0:
                train_loss = state["epoch_loss"] / state["epoch_steps"]
                log_fn(state["step"], {"train_loss": train_loss, "epoch": state["epoch"]})
        scores = evaluate(model, sampler, features, valid, known, config, config.seed + 1, amp_dtype, ranking=False)
        record = _end_epoch(state, model, roc_auc(scores["positive"], scores["negative"]), epoch_started, config)
        checkpoint()
        if log_fn:
            log_fn(state["step"], {k: v for k, v in record.items() if k != "step"})

    trained = time.perf_counter()
    if state["best_model"] is not None:
        model.load_state_dict(state["best_model"])
    metrics = _final_metrics(model, sampler, features, valid, test, known, config, amp_dtype)
    metrics.update(best_epoch=float(state["best_epoch"]), steps=float(state["step"]),
                   valid_roc_auc_untrained=untrained_auc)
    timings = _timings(state, started, prepared, trained)
    if log_fn:
        log_fn(state["step"], {**metrics, "edges_per_second": timings["edges_per_second"]})
    model.relation_names = tuple(data.relations)
    return GatResult(model.cpu().eval(), metrics, state["history"], config, timings, data.sizes(), data.relations)


def train_gat(warehouse: Warehouse, config: GatConfig, checkpoint_dir: str | Path | None = None,
              resume: bool = True, log_fn: LogFn | None = None) -> GatResult:
    """Pretrain the GAT on `kg.kg_edges` with `embeddings.node_description_embeddings` (relation-free) as node features.

    `checkpoint_dir` holds `last.pt` (model, optimizer, step, RNG states, config,
    split seed); with `resume`, a run continues from it. `log_fn(step, metrics)`
    receives training loss, per-epoch validation and the final metrics (e.g. to
    log them to MLflow).
    """
    started = time.perf_counter()
    index = build_graph_index(warehouse)
    features = node_features(warehouse.lake, index)
    data = prepare_graph(index, config)
    load_seconds = time.perf_counter() - started
    log.info("gat data: %s in %.1fs", data.sizes(), load_seconds)
    result = fit_gat(data, features, config, checkpoint_dir, resume, log_fn)
    result.timings["load_seconds"] = load_seconds
    result.model.feature_table = FEATURE_TABLE
    result.model.feature_encoder_id = feature_encoder_id(warehouse)
    return result


def feature_encoder_id(warehouse: Warehouse, table: str = FEATURE_TABLE) -> str:
    """The encoder that made the node features (graph tokens of new triples must use the same one)."""
    with warehouse.connect(read_only=True) as con:
        ids = [row[0] for row in con.execute(f"SELECT DISTINCT encoder_id FROM embeddings.{table}").fetchall()]
    if len(ids) != 1:
        raise ValueError(f"embeddings.{table} mixes encoders {ids}: re-embed it with one encoder")
    return ids[0]
