"""Cold-start SFT for Graph-R1: expert demonstrations from the gold paths of `qa.qa_items`.

A small model has never seen our tag format; GRPO from it would sample no
well-formed episode and learn nothing. So the policy first imitates an expert
that knows each question's gold path and walks it with the real environment:

    <think>Find X.</think><search>X</search>                    the question entity
    <think>X is C0001; list its relations.</think><traverse>C0001</traverse>   each hop
    <think>... leads to Y.</think><analyze>C0002</analyze>      the answer concept
    <think>Y is option B.</think><answer>B</answer>

Where a chunk holds the gold evidence (it names both concepts of the last gold
edge within the first `analyze_chunk_chars` characters) and an observation of
the episode has listed it (a search snippet, or a traversal's "texts
mentioning it"), the expert reads that chunk instead of the answer concept:
`<think>... leads to Y; read text T2.</think><analyze>T2</analyze>`, so the
policy learns to reach text through the hypergraph.

Every observation in a demonstration is what the environment really returned,
and the expert only uses a concept after an observation has shown it: a
demonstration whose search misses the entity, or whose hop or answer is not
among the shown edges (a hub's edge list is cut), is dropped, not faked. The
finished episode must be well formed and correct. SFT then minimizes the
negative log-likelihood of the expert's replies only (observations masked,
the same masks as GRPO), token-averaged over each batch.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medgraph.kg.graph import Triple
from medgraph.llm.hf import TransformersChatModel, autocast, autocasts_to_bf16, release_freed_memory
from medgraph.llm.lora import frozen_linears_in_bf16
from medgraph.methods.graph_r1 import EnvStep, GraphR1Config, GraphR1Env, GraphR1State
from medgraph.qa.item import QaItem
from medgraph.rl.grpo import SMALL_ENV, TINY_ENV
from medgraph.rl.model import (
    load_trainable,
    lora_of,
    make_batch,
    token_logprobs,
    trainable_parameters,
)
from medgraph.rl.rewards import episode_reward
from medgraph.rl.rollout import EncodedConversation, encode_conversation
from medgraph.settings import profile_config

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- questions


# --------------------------------------------------------------------------- the expert


@dataclass
class Demonstrations:
    states: list[GraphR1State]
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> count

    def as_metadata(self) -> dict[str, int]:
        return {"demonstrations": len(self.states), **{f"dropped_{k}": v for k, v in sorted(self.dropped.items())}}


Expert = Generator[str, EnvStep, str | None]  # yields replies, receives what each did; returns why it gave up


def _expert(state: GraphR1State, names: dict[str, str], triples: dict[str, Triple],
            evidence_chunks: frozenset[str] = frozenset()) -> Expert:
    """One question's expert walk along its gold path; every concept or chunk it uses was shown first.
    `evidence_chunks` are the chunks whose analyzed text names both concepts of the last gold edge."""
    item, extra = state.item, state.item.extra
    seeds = list(extra.get("seed_cuis") or ())
    if not seeds or seeds[0] not in names:
        return "no question entity"
    entity = seeds[0]
    step = yield f"<think>Find {names[entity]}.</think><search>{names[entity]}</search>"
    if entity not in step.retrieved_ids:
        return "search missed the entity"
    path = [triples.get(edge) for edge in extra.get("gold_path") or ()]
    if any(t is None for t in path):
        return "gold edge not in the graph"
    traversed: list[str] = []
    for triple in path or [None]:  # a "no" has no path: look at the entity's own edges
        if triple is None:
            target = entity
        else:
            target = next((c for c in (triple.src_cui, triple.dst_cui) if c in traversed), None)
            if target is not None:
                continue  # this edge was on the last list already
            target = next((c for c in (triple.src_cui, triple.dst_cui) if c in state.nodes), None)
        if target is None:
            return "path not shown"
        traversed.append(target)
        yield f"<think>{names[target]} is {target}; list its relations.</think><traverse>{target}</traverse>"
    if not path:  # a "no": the other concept is not among the edges; find it and read it
        other = seeds[-1]
        if other == entity or other not in names:
            return "no second entity"
        step = yield f"<think>No edge to {names[other]}; find it.</think><search>{names[other]}</search>"
        if other not in step.retrieved_ids:
            return "search missed the entity"
        yield f"<think>{names[other]} is {other}; read it.</think><analyze>{other}</analyze>"
        yield f"<think>{names[entity]} and {names[other]} are not linked.</think><answer>{item.answer}</answer>"
        return None
    answer = next((c for c in extra.get("answer_cuis") or () if c in state.nodes), None)
    if answer is None:
        return "answer not shown"
    relation = path[-1].relation.replace("_", " ")
    # Chunks in the order the episode first showed them: the earliest listed evidence chunk is read.
    chunk = next((c for c in state.chunk_aliases if c in evidence_chunks), None)
    if chunk is not None:
        alias = state.chunk_aliases[chunk]
        yield f"<think>{relation} leads to {names[answer]}; read text {alias}.</think><analyze>{alias}</analyze>"
    else:
        yield f"<think>{relation} leads to {names[answer]}; read it.</think><analyze>{answer}</analyze>"
    if item.options.get(item.answer, "").lower() == "yes":
        yield f"<think>{names[entity]} and {names[answer]} are linked.</think><answer>{item.answer}</answer>"
    elif item.options:
        yield f"<think>{names[answer]} is option {item.answer}.</think><answer>{item.answer}</answer>"
    else:
        yield f"<think>The answer is {names[answer]}.</think><answer>{names[answer]}</answer>"
    return None


def expert_demonstrations(env: GraphR1Env, items: Sequence[QaItem]) -> Demonstrations:
    """Expert episodes for `items`, stepped together through the real environment (one batched
    retriever call per action type and turn); only well-formed, correct episodes are kept."""
    cuis = {c for item in items for key in ("seed_cuis", "answer_cuis") for c in item.extra.get(key) or ()}
    triples = {t.edge_id: t for t in env.retriever.graph.triples(
        {e for item in items for e in item.extra.get("gold_path") or ()})}
    cuis |= {c for t in triples.values() for c in (t.src_cui, t.dst_cui)}
    names = {cui: node.name for cui, node in env.retriever.nodes(sorted(cuis)).items()}
    evidence = _text_evidence(env, items, triples)
    states = [env.reset(item) for item in items]
    experts = [_expert(state, names, triples, chunks) for state, chunks in zip(states, evidence, strict=True)]
    dropped: Counter[str] = Counter()
    moves: dict[int, str] = {}
    for i, expert in enumerate(experts):
        _next_move(i, expert, None, moves, dropped)
    while moves:
        steps = env.step_batch([(states[i], reply) for i, reply in moves.items()])
        pending, moves = moves, {}
        for i, step in zip(pending, steps, strict=True):
            if states[i].done:
                experts[i].close()
            else:
                _next_move(i, experts[i], step, moves, dropped)
    kept = []
    for state in states:
        if state.done and not state.truncated and episode_reward(state).correct and all(state.well_formed):
            kept.append(state)
        elif state.done:
            dropped["wrong or ill-formed episode"] += 1
    return Demonstrations(kept, dropped)


def _text_evidence(env: GraphR1Env, items: Sequence[QaItem], triples: dict[str, Triple]) -> list[frozenset[str]]:
    """Per item, the chunks that name both concepts of its last gold edge within the characters an
    analyze shows (one query for all items; none where the item has no path or the text is off)."""
    pairs = []
    for item in items:
        last = triples.get((item.extra.get("gold_path") or [""])[-1])
        pairs.append((last.src_cui, last.dst_cui) if last is not None else ())
    if "analyze" not in env.config.actions:
        return [frozenset() for _ in items]
    found = env.retriever.chunks_mentioning_all(pairs)
    return [frozenset(c for c, seen_by in chunks.items() if seen_by <= env.config.analyze_chunk_chars)
            for chunks in found]


def _next_move(i: int, expert: Expert, step: EnvStep | None, moves: dict[int, str], dropped: Counter[str]) -> None:
    try:
        moves[i] = next(expert) if step is None else expert.send(step)
    except StopIteration as stop:
        dropped[stop.value or "expert stopped before answering"] += 1


# --------------------------------------------------------------------------- training


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class SftConfig:
    steps: int = 200
    batch_size: int = 8
    micro_batch_size: int = 4
    # At most this many padded tokens (rows x the longest) per micro-batch, besides `micro_batch_size` rows: short
    # conversations share a forward pass, a long one goes alone, and the activations stay bounded. None: no cap.
    micro_batch_tokens: int | None = None
    # Batches of like lengths (Hugging Face's `group_by_length`): each group of this many batches is drawn from the
    # seeded shuffle, sorted by length, cut into batches, and the batches shuffled. Less padding; every example is
    # still drawn once per epoch. 0: batches in draw order.
    length_groups: int = 0
    lr: float = 2e-5
    # "constant", or "cosine": linear warm-up over the first `warmup_share` of the steps, then a cosine decay to
    # lr / 10 at the last step (nanoGPT's schedule). A constant rate ends wherever its last noisy step left the weights.
    lr_schedule: str = "constant"
    warmup_share: float = 0.0  # a share, so that a run with fewer steps keeps the schedule's shape
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    lora_layers: int | None = None  # adapt only the top N blocks (None: all)
    train_items: int = 2000  # questions the expert tries (it drops some)
    # The datasets the train and validation questions come from (None: all). Graph-R1 trains on the benchmark it
    # is evaluated on; a policy trained on every dataset answers a multiple-choice question like the short-answer
    # demonstrations (a name that is not an option), so the demo names the dataset it evaluates.
    datasets: tuple[str, ...] | None = None
    valid_items: int = 64
    graph_r1: GraphR1Config = field(default_factory=GraphR1Config)
    seed: int = 0
    device: str = "auto"
    bf16: bool = True  # autocast on CUDA and on CPUs with native bf16
    progress: bool = False

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES or not 0.0 <= self.warmup_share < 1.0:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES} with 0 <= warmup_share < 1; got "
                             f"{self.lr_schedule!r}, warmup_share={self.warmup_share}")

    @classmethod
    def profile(cls, name: str, **overrides: object) -> SftConfig:
        return profile_config(SFT_PROFILES, "SFT", name, **overrides)

    def as_dict(self) -> dict[str, object]:
        flat = {k: v for k, v in asdict(self).items() if k != "graph_r1"}
        flat.update({f"env_{k}": v for k, v in asdict(self.graph_r1).items()})
        return flat


SFT_PROFILES = {
    "tiny": SftConfig(steps=2, batch_size=2, micro_batch_size=1, lr=2e-4, lora_r=8, lora_alpha=16, lora_layers=4,
                      train_items=12, valid_items=1, graph_r1=TINY_ENV),
    # `make demo` on a laptop CPU: ~5 minutes; enough to learn the tag protocol and to walk from the concept the
    # question names (36 steps on 150 kgqa_mc questions: 24 of 24 validation episodes did; 12 steps on 60: 10 of
    # 24; benchmarks/README.md `graph_r1_sft.py`), not to answer well.
    "demo": SftConfig(steps=36, batch_size=4, micro_batch_size=1, lr=2e-3, lora_r=16, lora_alpha=32, lora_layers=10,
                      train_items=150, valid_items=8, graph_r1=SMALL_ENV, progress=True),
    "full": SftConfig(steps=600, batch_size=16, micro_batch_size=8, lr=1e-5, train_items=5000, valid_items=200,
                      progress=True),
}


@dataclass
class SftResult:
    policy: TransformersChatModel
    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)


def fits_generation_limit(tokenizer: object, state: GraphR1State, max_new_tokens: int) -> bool:
    """Every expert reply fits in one turn's token budget (else rollouts would cut what SFT taught)."""
    return all(len(tokenizer(m.content, add_special_tokens=False)["input_ids"]) < max_new_tokens
               for m in state.messages if m.role == "assistant")


def train_sft(model_dir: str | Path, demonstrations: Sequence[GraphR1State], config: SftConfig,
              log_fn: Callable[[int, dict[str, float]], None] | None = None, name: str | None = None) -> SftResult:
    """Masked maximum likelihood of the expert's replies; returns the policy (LoRA not yet merged)."""
    lora = lora_of(config)
    policy = load_trainable(model_dir, lora=lora, device=config.device, max_batch_size=256, name=name)
    usable = [s for s in demonstrations if fits_generation_limit(policy.tokenizer, s, config.graph_r1.max_new_tokens)]
    if not usable:
        raise ValueError(f"no usable demonstrations (of {len(demonstrations)}): they are missing or longer than "
                         f"max_new_tokens={config.graph_r1.max_new_tokens}")
    encoded = [encode_conversation(policy.tokenizer, s.messages, policy.eos_ids) for s in usable]
    history, metrics = fit_replies(policy, encoded, config, log_fn, desc="graph-r1 sft")
    return SftResult(policy, {**metrics, "demonstrations_used": float(len(usable))}, history)


def lr_factor(step: int, config: SftConfig) -> float:
    """The learning rate of 1-based `step` as a share of `config.lr`."""
    if config.lr_schedule == "constant":
        return 1.0
    warmup = int(config.warmup_share * config.steps)
    if step <= warmup:
        return step / warmup
    peak = max(warmup, 1)  # the step at the full rate: the warm-up's last, or the first
    progress = (step - peak) / max(config.steps - peak, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def drawn_batches(n: int, batch_size: int, seed: int, lengths: Sequence[int] | None = None,
                  groups: int = 0) -> Iterator[list[int]]:
    """The example indices of each step's batch, endlessly: `min(batch_size, n)` at a time from epochs over a fresh
    seeded shuffle (a batch may straddle two epochs). With `lengths` and `groups` > 0, `groups` batches' worth of
    draws at a time are sorted by length, cut into batches and shuffled (`SftConfig.length_groups`).
    `fit_replies` trains on these; benchmarks re-draw them."""
    rng = random.Random(seed)
    order: list[int] = []
    size = min(batch_size, n)
    grouped = groups > 1 and lengths is not None
    while True:
        pool: list[int] = []
        while len(pool) < size * (groups if grouped else 1):
            if not order:
                order = rng.sample(range(n), n)
            pool.append(order.pop())
        if not grouped:
            yield pool
            continue
        pool.sort(key=lambda i: lengths[i])
        batches = [pool[start:start + size] for start in range(0, len(pool), size)]
        rng.shuffle(batches)
        yield from batches


def micro_batches(lengths: Sequence[int], rows: int, tokens: int | None = None) -> list[list[int]]:
    """Consecutive positions of `lengths` (sorted by length) grouped into micro-batches of at most `rows`
    rows and, with `tokens`, at most that many padded tokens (rows x the longest); a row longer than `tokens`
    goes alone. The loss sums over tokens, so the grouping changes the memory and the speed, not the gradient."""
    groups: list[list[int]] = []
    for position, length in enumerate(lengths):
        group = groups[-1] if groups else None
        fits = group is not None and len(group) < rows and (
            tokens is None or (len(group) + 1) * max(length, *(lengths[i] for i in group)) <= tokens)
        if fits:
            group.append(position)
        else:
            groups.append([position])
    return groups


def fit_replies(policy: TransformersChatModel, encoded: Sequence[EncodedConversation], config: SftConfig,
                log_fn: Callable[[int, dict[str, float]], None] | None = None,
                desc: str = "sft") -> tuple[list[dict[str, float]], dict[str, float]]:
    """`config.steps` AdamW steps of masked maximum likelihood of the replies in `encoded` (token-averaged over
    each batch of `config.batch_size` conversations, in epochs over a seeded shuffle); the per-step history and
    its summary (first and last train NLL, seconds).
    Only `config`'s optimisation fields are read (steps, batch sizes, lr and its schedule, weight decay, clipping,
    seed, bf16)."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(done + 1, config))
    with frozen_linears_in_bf16(policy.model, autocasts_to_bf16(policy.device, config.bf16)):
        history = _fit_steps(policy, encoded, config, optimizer, scheduler, log_fn, desc)
    seconds = time.perf_counter() - started
    return history, {"train_nll_first": history[0]["train_nll"], "train_nll_last": history[-1]["train_nll"],
                     "train_seconds": seconds, "seconds_per_step": seconds / config.steps}


def _fit_steps(policy: TransformersChatModel, encoded: Sequence[EncodedConversation], config: SftConfig,
               optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               log_fn: Callable[[int, dict[str, float]], None] | None, desc: str) -> list[dict[str, float]]:
    history: list[dict[str, float]] = []
    policy.model.train()
    batches = drawn_batches(len(encoded), config.batch_size, config.seed, [len(e.ids) for e in encoded],
                            config.length_groups)
    for step in tqdm(range(1, config.steps + 1), desc=desc, disable=not config.progress):
        batch_ids = next(batches)
        # Micro-batches of like lengths: each is padded to its longest, and the loss sums over tokens either way.
        batch_ids.sort(key=lambda i: len(encoded[i].ids))
        tokens = sum(encoded[i].policy_tokens for i in batch_ids)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in micro_batches([len(encoded[i].ids) for i in batch_ids], config.micro_batch_size,
                                   config.micro_batch_tokens):
            batch = make_batch([encoded[batch_ids[i]] for i in micro], policy.pad_id, policy.device)
            with autocast(policy.device, config.bf16):
                logp = token_logprobs(policy.model, batch)
            loss = -(logp * batch.mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(policy.model), config.max_grad_norm))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        release_freed_memory()
        record = {"train_nll": total, "grad_norm": grad_norm, "policy_tokens": float(tokens), "lr": lr}
        history.append({"step": step, **record})
        if log_fn:
            log_fn(step, record)
    policy.model.eval()
    return history
