"""A reader adapted to read KG evidence (issue 29): RAFT-style LoRA fine-tuning of the answering model.

RAFT (Zhang et al. 2024, "RAFT: Adapting Language Model to Domain Specific RAG") fine-tunes the reader on
questions whose context mixes the gold document with distractors, and for a share of the questions holds
only distractors, with an answer that cites the evidence. Here a document is a KG fact, laid out as the
methods show facts (`oracle-evidence` / `rag-kg`: "Here are relevant knowledge graph facts:" and numbered
triples, `methods.baselines.kg_facts_prompt`); the distractors are the same concepts' triples under other
relations (for multiple choice, the question concept's links to the wrong options:
`methods.baselines.oracle_triples`); and every example comes from the TRAIN split.

    gold shown     "Fact 3 states that amlodipine may treat Hypertension. The answer is amlodipine, option A.
                    <answer>A</answer>"
    a "no" item    "No fact states that. The answer is no, option B. <answer>B</answer>"  (absent by design)
    gold withheld  "None of the facts answers the question."         (multiple choice only; no answer tag)

Where we depart from RAFT: a withheld example's target names no option. RAFT keeps the correct answer there,
which trains the reader to answer from memory; on a KG-derived benchmark that is memorising the KG, which the
no-evidence gate must catch. At evaluation such a reply gets the final-answer rule's constrained second call
(`methods.agent.complete_final_answer`), i.e. the base model's own guess among the options.

Leakage guard: no example shows a fact between two concepts that a validation or test question is about
(`held_out_pairs`): such facts are dropped from the evidence, a question about such a pair is skipped, and
`check_no_leak` refuses a set of examples that still holds one.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from medgraph.eval.questions import QaItem
from medgraph.kg.graph import KnowledgeGraph, Triple
from medgraph.llm.base import Conversation, assistant
from medgraph.methods.baselines import kg_facts_prompt, oracle_triples, stated_keys
from medgraph.methods.common import gold_edge_ids, gold_facts, gold_pairs
from medgraph.rl.model import LoraSettings, load_trainable
from medgraph.rl.rollout import encode_conversation
from medgraph.rl.sft import SftConfig, SftResult, fit_replies

Pair = frozenset[str]

NOT_FOUND = "None of the facts answers the question."


@dataclass(frozen=True)
class ReaderConfig:
    """The examples and the LoRA fit of a reader adapter."""

    gold_share: float = 0.8  # RAFT's P: examples whose gold facts are shown (multiple choice; yes/no always)
    max_wrong: int = 6  # distractor triples per question at most (as `oracle-evidence`)
    fit: SftConfig = field(default_factory=lambda: SftConfig(
        steps=60, batch_size=8, micro_batch_size=4, lr=1e-3, lora_r=16, lora_alpha=32, lora_layers=None))
    seed: int = 0

    def as_dict(self) -> dict[str, object]:
        fit = {f"fit_{k}": v for k, v in asdict(self.fit).items()
               if k in ("steps", "batch_size", "micro_batch_size", "lr", "lora_r", "lora_alpha", "lora_layers")}
        return {"gold_share": self.gold_share, "max_wrong": self.max_wrong, "seed": self.seed, **fit}


@dataclass(frozen=True)
class ReaderExample:
    qid: str
    conversation: Conversation  # system, user (facts, question, instruction), assistant (the target)
    gold_shown: bool
    pairs: frozenset[Pair]  # the concept pairs of every fact shown (what the leakage guard checks)


def _pair(triple: Triple) -> Pair:
    return frozenset((triple.src_cui, triple.dst_cui))


def question_pairs(item: QaItem) -> set[Pair]:
    """The concept pairs a question is about: its gold pairs and the ends of its gold facts (both listings)."""
    pairs = set(gold_pairs(item) or ())
    for keys in gold_facts(item) or ():
        for key in keys:
            src, _, dst = key.split("|", 2)
            pairs.add(frozenset((src, dst)))
    return pairs


def held_out_pairs(items: Iterable[QaItem]) -> frozenset[Pair]:
    """Every concept pair the given (validation and test) questions are about."""
    return frozenset(pair for item in items for pair in question_pairs(item))


def name_the_option(item: QaItem) -> str:
    """The end of a target: the answer's text, then its letter ("The answer is Hypertension, option C.
    <answer>C</answer>"). Written in that order the letter is a look-up of the option list ("C. Hypertension"),
    which the first adapter, trained on the letter alone after its citation, never learned: it cited the right
    fact and answered A regardless."""
    return f"The answer is {item.options[item.answer]}, option {item.answer}. <answer>{item.answer}</answer>"


def reader_examples(graph: KnowledgeGraph, items: Sequence[QaItem], config: ReaderConfig,
                    held_out: frozenset[Pair]) -> tuple[list[ReaderExample], Counter[str]]:
    """RAFT examples from train questions with options (see the module doc), and counts of what was kept,
    withheld, dropped and skipped."""
    rng = random.Random(config.seed)
    stats: Counter[str] = Counter()
    examples = []
    for item, shown in zip(items, oracle_triples(graph, items, config.max_wrong), strict=True):
        if not item.options:
            stats["skipped_no_options"] += 1
            continue
        if question_pairs(item) & held_out:
            stats["skipped_held_out_question"] += 1
            continue
        kept = [t for t in shown if _pair(t) not in held_out]
        stats["dropped_held_out_facts"] += len(shown) - len(kept)
        gold_edges = set(gold_edge_ids(item) or ())
        stated = stated_keys(item, [t for t in kept if t.edge_id in gold_edges])
        is_gold = [f"{t.src_cui}|{t.relation}|{t.dst_cui}" in stated for t in kept]
        has_gold = any(is_gold)
        if not has_gold and (gold_edges or gold_facts(item)):
            stats["skipped_gold_missing"] += 1  # its fact is not in the graph (or was held out): nothing to cite
            continue
        yes_no = {text.strip().lower() for text in item.options.values()} <= {"yes", "no", "maybe"}
        if has_gold and not yes_no and rng.random() >= config.gold_share:
            kept = [t for t, gold in zip(kept, is_gold, strict=True) if not gold]
            target, shown_gold = NOT_FOUND, False
        elif has_gold:
            cited = [k for k, gold in enumerate(is_gold, start=1) if gold]
            numbers = " and ".join(str(k) for k in cited)
            quotes = "; and that ".join(kept[k - 1].text for k in cited)
            target = (f"Fact{'s' if len(cited) > 1 else ''} {numbers} state{'' if len(cited) > 1 else 's'} that "
                      f"{quotes}. {name_the_option(item)}")
            shown_gold = True
        else:  # a "no" question: the fact it asks about is absent by design
            target, shown_gold = f"No fact states that. {name_the_option(item)}", True
        stats["gold_shown" if shown_gold else "gold_withheld"] += 1
        conversation = [*kg_facts_prompt(item, kept), assistant(target)]
        examples.append(ReaderExample(item.qid, conversation, shown_gold, frozenset(_pair(t) for t in kept)))
    return examples, stats


def check_no_leak(examples: Sequence[ReaderExample], held_out: frozenset[Pair]) -> None:
    """Refuse examples that show a fact between two concepts a validation or test question is about."""
    leaks = [(e.qid, sorted(pair)) for e in examples for pair in e.pairs & held_out]
    if leaks:
        raise ValueError(f"{len(leaks)} facts in the reader's training examples join concept pairs of validation or "
                         f"test questions, e.g. question {leaks[0][0]} shows a fact between {leaks[0][1]}")


def train_reader_adapter(model_dir: str | Path, examples: Sequence[ReaderExample], config: ReaderConfig,
                         held_out: frozenset[Pair],
                         log_fn: Callable[[int, dict[str, float]], None] | None = None,
                         name: str | None = None) -> SftResult:
    """LoRA on the base reader: masked maximum likelihood of the example targets; the reader (LoRA unmerged)."""
    check_no_leak(examples, held_out)
    if not examples:
        raise ValueError("no reader examples: the train split has no questions with options and gold facts")
    fit = config.fit
    lora = LoraSettings(fit.lora_r, fit.lora_alpha, fit.lora_layers) if fit.lora_r else None
    reader = load_trainable(model_dir, lora=lora, device=fit.device, max_batch_size=64, name=name)
    encoded = [encode_conversation(reader.tokenizer, e.conversation, reader.eos_ids) for e in examples]
    history, metrics = fit_replies(reader, encoded, fit, log_fn, desc="reader adapter")
    metrics |= {"examples": float(len(examples)), "examples_gold_shown": float(sum(e.gold_shown for e in examples))}
    return SftResult(reader, metrics, history)
