"""Training HIIM's projector W_proj, with the GAT and the LLM frozen (the model is `medgraph.gnn.graph_tokens`).

W_proj is trained by the likelihood of the gold answer given exactly what HIIM sees inside A2RAG: the
triples GSRM retrieves for the question (A2RAG's default tau, K, N), shown as text in A2RAG's own answer
prompt (`a2rag.answer_conversation`) and, all of them, as graph tokens. Its champion gate compares the
validation answer NLL with A2RAG's text-only answer: the same prompt and triples without graph tokens.
`graph_triples="gold_path"` (the gold path plus distracting neighbours) is an explicit option for
experiments only. It lives above the methods because its examples are A2RAG's prompts.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from medgraph.gnn.graph_tokens import GraphTokenizer, HiimProjector, NodeFeatures
from medgraph.gnn.model import GatModel
from medgraph.kg.graph import KnowledgeGraph, Triple
from medgraph.llm.base import ChatModel, Message
from medgraph.llm.hf import autocast, left_padded_position_ids, release_freed_memory
from medgraph.methods.a2rag import A2RagConfig, answer_conversation, gsrm_items
from medgraph.methods.tools import KnowledgeTools, Passage
from medgraph.qa.item import QaItem
from medgraph.qa.table import load_qa_items
from medgraph.settings import profile_config
from medgraph.stats import paired_difference
from medgraph.storage import Warehouse
from medgraph.tracking import Baseline, Tracking

log = logging.getLogger(__name__)



TEXT_ONLY_BASELINE = ("A2RAG text-only answer (same prompt, triples and passages, no graph tokens), less the "
                      "spread of the gain (half its paired-bootstrap 95% CI over the validation questions)")


@dataclass(frozen=True)
class ProjectorConfig:
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    graph_triples: Literal["gsrm", "gold_path"] = "gsrm"  # A2RAG's GSRM retrieval, or gold path + distractors
    train_items: int | None = None  # training questions retrieved for (a seeded sample; None: all)
    distractors: int = 8  # gold_path only: 1-hop triples of the question's entities added to its gold path
    max_triples: int = 24  # gold_path only: graph tokens per question (GSRM: A2RAG's top_n, as in evaluation)
    passages: bool = True  # GSRM: the prompt also shows T_Text's passages, as A2RAG's answer prompt does
    valid_items: int = 64  # validation questions scored after training (and before, as the baseline)
    eval_every: int = 50
    # Questions per forward and backward pass; the step's gradient is the batch's mean either way. One at a time
    # there is no padding to mask, and each question's activations are kept whole instead of recomputed
    # (`recompute_layers`): a step is three passes over the frozen LLM with recomputation, two without.
    micro_batch_size: int = 1
    recompute_layers: bool = False  # activation checkpointing (`layer_inputs_only`): long prompts, little memory
    seed: int = 0
    bf16: bool = True  # autocast of the (frozen) LLM's passes on CUDA and on CPUs with native bf16
    progress: bool = False

    @classmethod
    def profile(cls, name: str, **overrides: object) -> ProjectorConfig:
        return profile_config(PROJECTOR_PROFILES, "projector", name, **overrides)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# A2RAG's answer prompt shows ~30 triples as text (~750 tokens with SmolLM2's template): a training step costs
# ~10x the old question-only prompt's, so the CPU profiles take fewer, smaller steps and validate at the end only.
# demo: 6 steps gated on 16 validation questions gained 0.046 nats over text-only with a spread of 0.057 (not
# promoted); 18 steps on 48 gained 0.169 [0.120, 0.219], spread 0.049 (promoted; benchmarks/README.md, HIIM).
PROJECTOR_PROFILES = {
    "tiny": ProjectorConfig(steps=6, batch_size=2, train_items=16, valid_items=8, eval_every=6, distractors=4),
    "demo": ProjectorConfig(steps=18, batch_size=4, train_items=40, valid_items=48, eval_every=18, progress=True),
    "full": ProjectorConfig(steps=2000, batch_size=16, micro_batch_size=16, recompute_layers=True, train_items=None,
                            valid_items=500, eval_every=250, progress=True),
}


@dataclass(frozen=True)
class ProjectorExample:
    item: QaItem
    answer: str  # the reply A2RAG's prompt asks for: "<answer>B</answer>", or the short answer in the tag
    triples: tuple[Triple, ...]  # the graph tokens' triples (A2RAG: every retrieved triple)
    context: tuple[Triple, ...]  # the triples the prompt shows as text (A2RAG: the first `context_triples`)
    passages: tuple[Passage, ...] = ()  # T_Text's passages (A2RAG searches with the question by default)

    @property
    def qid(self) -> str:
        return self.item.qid

    def conversation(self, graph_tokens: bool) -> list[Message]:
        """A2RAG's answer prompt for this question, exactly as evaluation builds it: question, facts, passages."""
        return answer_conversation(self.item, self.context, self.passages, graph_tokens=graph_tokens)


@dataclass
class ProjectorResult:
    projector: HiimProjector
    metrics: dict[str, float]  # valid_answer_nll (with graph tokens), valid_answer_nll_text_only, ...
    history: list[dict[str, float]] = field(default_factory=list)
    examples: dict[str, int] = field(default_factory=dict)


def _reply(item: QaItem) -> str:
    return f"<answer>{item.answer if item.options else (list(item.acceptable_answers) or [item.answer])[0]}</answer>"


def load_examples(warehouse: Warehouse, split: str, config: ProjectorConfig, tools: KnowledgeTools | None = None,
                  limit: int | None = None, a2rag: A2RagConfig | None = None) -> list[ProjectorExample]:
    """`qa.qa_items` of one split (a seeded sample of `limit`) with their evidence, retrieved once per
    question: GSRM's top-N with A2RAG's settings (`a2rag`, default A2RagConfig(); needs `tools`), or, with
    `graph_triples="gold_path"`, the gold path plus shuffled distractors. Questions without any triple
    are left out (HIIM answers them text-only)."""
    a2rag = a2rag or A2RagConfig()
    items = load_qa_items(warehouse, split, limit, config.seed)
    passages: list[list[Passage]] = [[] for _ in items]
    if config.graph_triples == "gold_path":
        evidence = _gold_path_evidence(warehouse, items, config)
    elif config.graph_triples == "gsrm":
        if tools is None:
            raise ValueError("graph_triples='gsrm' retrieves with GSRM: pass KnowledgeTools(Retriever(warehouse, encoder))")
        evidence = _gsrm_evidence(tools, items, a2rag)
        if config.passages:  # T_Text with the question, as A2RAG's answer prompt shows them
            passages = tools.passages([item.question for item in items], k=a2rag.text_k) if items else []
    else:
        raise ValueError(f"graph_triples must be 'gsrm' or 'gold_path', got {config.graph_triples!r}")
    return [ProjectorExample(item, _reply(item), tuple(triples), tuple(triples[: a2rag.context_triples]),
                             tuple(found))
            for item, triples, found in zip(items, evidence, passages) if triples]


def projector_examples(warehouse: Warehouse, tools: KnowledgeTools | None, config: ProjectorConfig,
                       a2rag: A2RagConfig | None = None) -> tuple[list[ProjectorExample], list[ProjectorExample]]:
    """(train, validation) examples: `train_items` and `valid_items` seeded samples of the splits, each
    question's triples retrieved once (`tools` may be None with graph_triples="gold_path"), with the A2RAG
    configuration evaluation uses (pass the tuned GSRM tau/K/N)."""
    return (load_examples(warehouse, "train", config, tools, limit=config.train_items, a2rag=a2rag),
            load_examples(warehouse, "validation", config, tools, limit=config.valid_items, a2rag=a2rag))


def _gsrm_evidence(tools: KnowledgeTools, items: Sequence[QaItem], a2rag: A2RagConfig,
                   batch_size: int = 16) -> list[list[Triple]]:
    """A2RAG's T_KG for each question: GSRM's top-N triples, best first."""
    found: list[list[Triple]] = []
    for start in range(0, len(items), batch_size):
        batch = items[start: start + batch_size]
        found += [[t for t, _ in result.triples] for result in gsrm_items(tools, batch, a2rag)]
    return found


def _gold_path_evidence(warehouse: Warehouse, items: Sequence[QaItem], config: ProjectorConfig) -> list[list[Triple]]:
    """Each question's gold path plus shuffled 1-hop distractors of its entities (an experiment, not A2RAG)."""
    rng = random.Random(config.seed)
    graph = KnowledgeGraph(warehouse)
    try:
        gold = {t.edge_id: t for t in graph.triples({e for item in items for e in item.extra["gold_path"]})}
        found = []
        for item in items:
            path = list(item.extra["gold_path"])
            evidence = [gold[e] for e in path if e in gold]
            if not evidence:
                found.append([])
                continue
            nearby = [t for t in graph.one_hop(list(item.extra["seed_cuis"]), limit_per_node=4 * config.distractors)
                      if t.edge_id not in set(path)]
            triples = evidence + rng.sample(nearby, min(config.distractors, len(nearby)))
            rng.shuffle(triples)
            found.append(triples[: config.max_triples])
    finally:
        graph.close()
    return found


def answer_nll(llm: ChatModel, examples: Sequence[ProjectorExample], graph_tokens: Sequence[Tensor | None]) -> Tensor:
    """Mean per-token negative log-likelihood of each example's answer (B,), the LLM frozen, under A2RAG's
    answer prompt: with graph tokens (and the prompt's note about them), or text-only when `graph_tokens`
    is None.

    Prompt rows come left-padded from `prompt_embeddings`; the answer tokens are
    appended on the right (right-padded), with positions counted from each row's
    first real token.
    """
    embed = llm.model.get_input_embeddings()
    with_tokens = graph_tokens is not None
    prompts, prompt_mask = llm.prompt_embeddings([e.conversation(with_tokens) for e in examples], graph_tokens)
    eos = llm.tokenizer.eos_token or ""
    answers = [llm.tokenizer(e.answer + eos, add_special_tokens=False)["input_ids"] for e in examples]
    width = max(len(a) for a in answers)
    answer_ids = torch.full((len(examples), width), llm.pad_id, dtype=torch.long)
    answer_mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, ids in enumerate(answers):
        answer_ids[i, : len(ids)] = torch.tensor(ids)
        answer_mask[i, : len(ids)] = 1
    answer_ids, answer_mask = answer_ids.to(prompts.device), answer_mask.to(prompts.device)
    inputs = torch.cat([prompts, embed(answer_ids)], dim=1)
    mask = torch.cat([prompt_mask, answer_mask], dim=1)
    # Logits of the last width + 1 positions only (prompt_len - 1 onwards): the logit at position p predicts
    # token p + 1, so logits[:, j] predicts answer token j. All positions' logits are (B, L, vocab): 2-3 GB at
    # 8 prompts of ~1,500 tokens, with their gradients as much again, for the few the answer needs.
    logits = llm.model(inputs_embeds=inputs, attention_mask=mask, position_ids=left_padded_position_ids(mask),
                       logits_to_keep=width + 1).logits
    predicted = logits[:, :width].float()
    token_nll = F.cross_entropy(predicted.transpose(1, 2), answer_ids, reduction="none")
    return (token_nll * answer_mask).sum(1) / answer_mask.sum(1)


def _item_nlls(llm: ChatModel, tokenizer: GraphTokenizer | None, examples: Sequence[ProjectorExample],
               batch_size: int, bf16: bool = False) -> list[float]:
    """Each example's answer NLL, with graph tokens from `tokenizer`, or text-only when it is None."""
    values: list[float] = []
    with torch.no_grad(), autocast(str(llm.model.device), bf16):
        for start in range(0, len(examples), batch_size):
            batch = examples[start: start + batch_size]
            tokens = [tokenizer.encode(e.triples) for e in batch] if tokenizer else None
            values += [float(v) for v in answer_nll(llm, batch, tokens)]
    return values


@contextmanager
def layer_inputs_only(model: torch.nn.Module) -> Iterator[None]:
    """Activation checkpointing on the frozen LLM while W_proj trains (`ProjectorConfig.recompute_layers`): the
    backward pass keeps each decoder layer's input and recomputes the rest. Kept whole, the activations of
    A2RAG's answer prompts are ~1 MB per token (6.9 GB peak for 2 prompts on a 1M-row synthetic release, 3.5 GB
    with this; benchmarks/README.md "The model steps"). Transformers checkpoints a layer only in training mode, so
    only the layer modules themselves are marked training: their attention and MLP stay in eval mode (no
    dropout), and the loss and gradients are the ones without it."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    modes = [layer.training for layer in layers]
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.training = True  # the attribute, not .train(): that would reach the layer's dropout too
    try:
        yield
    finally:
        model.activation_checkpointing_disable()
        for layer, mode in zip(layers, modes, strict=True):
            layer.training = mode


def accumulate_batch_gradient(llm: ChatModel, projector: HiimProjector, triple_vectors: dict[str, Tensor],
                              batch: Sequence[ProjectorExample], config: ProjectorConfig) -> float:
    """Add the gradient of the batch's mean answer NLL to W_proj's, `config.micro_batch_size` questions per
    forward and backward pass; returns that mean."""
    recompute = layer_inputs_only(llm.model) if config.recompute_layers else nullcontext()
    total = 0.0
    with autocast(str(llm.model.device), config.bf16), recompute:
        for start in range(0, len(batch), config.micro_batch_size):
            micro = batch[start: start + config.micro_batch_size]
            tokens = [projector(triple_vectors[e.qid].to(llm.model.device)) for e in micro]
            loss = answer_nll(llm, micro, tokens).sum() / len(batch)
            loss.backward()
            total += float(loss.detach())
    return total


def token_embedding_norm(llm: ChatModel) -> float:
    weight = llm.model.get_input_embeddings().weight.detach().float()
    return float(weight.norm(dim=-1).median())


def train_projector(llm: ChatModel, gat: GatModel, features: NodeFeatures, train: Sequence[ProjectorExample],
                    valid: Sequence[ProjectorExample], config: ProjectorConfig,
                    log_fn: Callable[[int, dict[str, float]], None] | None = None) -> ProjectorResult:
    """Train W_proj (only) on answer likelihood; report validation NLL with graph tokens, untrained graph
    tokens, and text-only (the gate's baseline), all on the same validation questions and prompts."""
    if not getattr(llm, "supports_graph_tokens", False) or not hasattr(llm, "prompt_embeddings"):
        raise TypeError(f"{llm.name}: training W_proj needs an in-process transformers model (graph tokens)")
    if not train or not valid:
        raise ValueError(f"projector training needs train and validation questions with retrieved triples "
                         f"(found {len(train)} train, {len(valid)} validation): materialize qa/qa_items")
    torch.manual_seed(config.seed)
    llm.model.requires_grad_(False)
    gat.requires_grad_(False)
    token_norm = token_embedding_norm(llm)
    projector = HiimProjector(gat.triple.out_features, llm.hidden_size, token_norm)
    projector.llm_name = llm.name
    projector.to(llm.model.device)
    tokenizer = GraphTokenizer(gat, projector, features)
    optimizer = torch.optim.AdamW(projector.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    valid = list(valid)[: config.valid_items]
    # Frozen GAT: each training question's triple vectors are computed once.
    cached = {e.qid: tokenizer.triple_vectors(e.triples) for e in train}
    text_only_items = _item_nlls(llm, None, valid, config.batch_size, config.bf16)
    text_only = sum(text_only_items) / max(len(text_only_items), 1)
    final_items = _item_nlls(llm, tokenizer, valid, config.batch_size, config.bf16)  # untrained, until validated
    history = [{"step": 0, "valid_answer_nll": sum(final_items) / max(len(final_items), 1)}]
    log.info("projector: text-only valid NLL %.4f, untrained graph tokens %.4f (token norm %.3f)",
             text_only, history[0]["valid_answer_nll"], token_norm)
    rng = random.Random(config.seed)
    started = time.perf_counter()
    for step in tqdm(range(1, config.steps + 1), desc="hiim projector", disable=not config.progress):
        batch = rng.sample(list(train), min(config.batch_size, len(train)))
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_batch_gradient(llm, projector, cached, batch, config)
        optimizer.step()
        # Every question is a pass of its own length: without this glibc keeps the freed activations, and the
        # reproduce run's process grew all through the fit (to 8.6 GB; 4.7 GB is the step's working set).
        release_freed_memory()
        record = {"train_answer_nll": loss}
        if step % config.eval_every == 0 or step == config.steps:
            final_items = _item_nlls(llm, tokenizer, valid, config.batch_size, config.bf16)
            record["valid_answer_nll"] = sum(final_items) / max(len(final_items), 1)
            history.append({"step": step, **record})
        if log_fn:
            log_fn(step, record)
    seconds = time.perf_counter() - started
    best = history[-1]["valid_answer_nll"]
    # The gain over text-only on the same validation questions, and how much it varies with which questions are
    # drawn: half the width of its paired-bootstrap 95% CI. The gate asks for a gain larger than that spread.
    gain = paired_difference(text_only_items, final_items)
    spread = (gain.ci_high - gain.ci_low) / 2
    metrics = {"valid_answer_nll": best, "valid_answer_nll_text_only": text_only,
               "valid_answer_nll_untrained": history[0]["valid_answer_nll"],
               "valid_nll_gain_over_text_only": text_only - best, "valid_nll_gain_ci_low": gain.ci_low,
               "valid_nll_gain_ci_high": gain.ci_high, "valid_nll_gain_spread": spread,
               "train_seconds": seconds, "steps_per_second": config.steps / max(seconds, 1e-9)}
    if not math.isfinite(best):
        raise FloatingPointError(f"projector training diverged: validation NLL {best}")
    return ProjectorResult(projector.cpu().eval(), metrics, history,
                           {"train": len(train), "valid": len(valid)})


def text_only_baseline(result: ProjectorResult) -> Baseline:
    """The projector gate's baseline: A2RAG's text-only answer on the same validation questions and triples."""
    return Baseline(TEXT_ONLY_BASELINE, {"valid_answer_nll": result.metrics["valid_answer_nll_text_only"]
                                         - result.metrics["valid_nll_gain_spread"]})


def log_projector_result(tracking: Tracking, result: ProjectorResult, llm_name: str, gat_model_uri: str) -> str:
    """Log a trained projector in the active run (metrics, history and example counts, the model with the
    LLM and GAT it pairs with); returns the logged model's URI."""
    import mlflow

    result.projector.gat_model_uri = gat_model_uri
    mlflow.log_metrics(result.metrics)
    mlflow.log_dict({"history": result.history, "examples": result.examples}, "training.json")
    return tracking.log_torch_model(result.projector, metadata={"llm": llm_name, "gat_model_uri": gat_model_uri})


