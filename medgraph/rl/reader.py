"""A reader adapted to read KG evidence (issue 29): RAFT-style LoRA fine-tuning of the answering model.

RAFT (Zhang et al. 2024, "RAFT: Adapting Language Model to Domain Specific RAG") fine-tunes the reader on
questions whose context mixes the gold document with distractors, and for a share of the questions holds
only distractors, with an answer that cites the evidence. Here the evidence is a question's gold KG facts among
the same concepts' triples under other relations (for multiple choice, the question concept's links to the wrong
options: `methods.baselines.oracle_triples`), every example from the TRAIN split, shown in one of the layouts the
methods' answering calls use (`LAYOUTS`, drawn per example):

    kg_facts    `oracle-evidence` / `rag-kg`: "Here are relevant knowledge graph facts:", numbered triples, then
                the question (`methods.baselines.kg_facts_prompt`)
    a2rag       A2RAG's T_Final prompt: the question first, then "Knowledge graph facts:"
                (`methods.a2rag.answer_conversation`)
    documents   MedRAG's "Here are the relevant documents:" with concept texts as `kg.kg_node_text` writes them
                ("amlodipine. Semantic type: ... Relations: may treat Hypertension; ..."): the facts grouped by
                their subject, and the other options' concepts described without relations
    rag_kg      RAFT's own recipe: what `rag-kg` retrieved for the question (`methods.baselines.rag_kg_evidence`:
                its ranked facts, then its passages), word for word its answering call (`rag_prompt`); a gold
                fact the retriever missed goes to a random rank in place of the lowest-ranked other fact
                (`with_gold_at_rank`), and withheld gold facts leave the rest as retrieved

    gold shown     RAFT's form, quoting the evidence: "The evidence states that amlodipine may treat
                    Hypertension. The answer is <answer>amlodipine</answer>." (the option's text, which every
                    method's parser reads as its letter; `answer_form="letter"`: "... The answer is amlodipine,
                    option A. <answer>A</answer>", `name_the_option`); a 2-hop question's two facts from its
                    concept to the answer (`chain_order`), within the answer budget (`TARGET_TOKENS`)
    a "no" item    "No fact states that. The answer is <answer>no</answer>."  (absent by design)
    gold withheld  "None of the facts answers the question."         (multiple choice only; no answer tag;
                                                                      "documents" in the documents layout)
    no evidence    the same, for a share (`no_evidence_share`) shown nothing at all

Which layouts the profiles use, and why the target quotes the fact instead of citing its number ("Fact 3 states
that ...", which the 135M reader chose before reading: 0.40 vs 0.75 oracle-evidence on validation), is measured in
validation (the history of those runs is in git: `git log -p benchmarks/README.md`).

Where we depart from RAFT: a withheld example's target names no option. RAFT keeps the correct answer there,
which trains the reader to answer from memory; on a KG-derived benchmark that is memorising the KG, which the
no-evidence gate must catch. At evaluation such a reply gets the final-answer rule's constrained second call
(`methods.agent.complete_final_answer`), i.e. the base model's own guess among the options.

Leakage guard: no example shows a fact between two concepts that a validation or test question is about
(`held_out_pairs`): such facts are dropped from the evidence, a question about such a pair is skipped, and
`check_no_leak` refuses a set of examples that still holds one.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from medgraph.kg.graph import KnowledgeGraph, Node, Triple
from medgraph.llm.base import ChatModel, Conversation, assistant, system, user
from medgraph.methods.a2rag import answer_conversation
from medgraph.methods.baselines import (
    EXPERT,
    RagKgConfig,
    documents_section,
    kg_facts_prompt,
    oracle_triples,
    rag_kg_evidence,
    rag_prompt,
    stated_keys,
)
from medgraph.methods.common import answer_instruction, format_question
from medgraph.methods.registry import run_method
from medgraph.methods.tools import KnowledgeTools, Passage
from medgraph.qa.item import QaItem, gold_edge_ids, gold_facts, gold_pairs
from medgraph.rl.model import load_trainable, lora_of
from medgraph.rl.rollout import encode_conversation
from medgraph.rl.sft import SftConfig, SftResult, fit_replies
from medgraph.settings import profile_config
from medgraph.tracking import Baseline

Pair = frozenset[str]

NOT_FOUND = "None of the facts answers the question."
NOT_FOUND_DOCUMENTS = "None of the documents answers the question."

# The answering-call layouts the examples are drawn from (module doc), and the default share of each. rag_kg (what
# rag-kg retrieved) took its 0.3 from the others: on the whole validation split rag-kg@adapted read its own evidence
# with every gold fact in it 47/82 on each of two seeds (without it 32/82), the oracle layout 0.816 on both
# (without 0.856-0.888), no better without evidence.
LAYOUTS = ("kg_facts", "a2rag", "documents", "rag_kg")
DEFAULT_LAYOUTS = (("kg_facts", 0.3), ("a2rag", 0.2), ("documents", 0.2), ("rag_kg", 0.3))
ANSWER_FORMS = ("letter", "text")


def layouts_text(layouts: Sequence[tuple[str, float]]) -> str:
    """Layouts and their weights as one string, "kg_facts:0.3,a2rag:0.2" (MLflow params, benchmark flags)."""
    return ",".join(f"{name}:{weight:g}" for name, weight in layouts)


def parse_layouts(text: str) -> tuple[tuple[str, float], ...]:
    """`layouts_text`'s string back to (name, weight) pairs; `ReaderConfig` checks the names and weights."""
    pairs = [part.split(":") for part in text.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"reader layouts must read name:weight,name:weight (e.g. {layouts_text(DEFAULT_LAYOUTS)}); "
                         f"got {text!r}")
    return tuple((name.strip(), float(weight)) for name, weight in pairs)

# The research fit (`make reproduce`): 135 steps of 8 examples (three quarters of the examples seen once). A constant
# 1e-3 ends where its last batches leave it (validation 0.50-0.79 over three seeds, one fit answering "none found" to
# 29 of 48); a cosine decay from 2e-3 ends calm. With chained 2-hop targets, 90 steps read better than 60; on
# validation drawn as the evaluation draws, 135 steps read better than 90 over three seeds (mean 0.847 vs 0.806, the
# weakest 0.812 vs 0.729) and still answer no better without evidence.
# Micro-batches within 2,048 padded tokens: the same token-summed gradient (up to float rounding); short examples
# share a forward pass and a long retrieved-evidence one goes alone, so the activations stay at about one long
# example's (benchmarks/README.md `clock_bounds.py`: peak memory and seconds per step against fixed sizes).
# Batches of like lengths, 16 batches at a time: padded tokens 1.20x the real ones -> 1.03x; the fit took 0.88x the
# time and read oracle evidence on the 125 validation questions at 0.800 against 0.808 (seed 0; `reader_adapter.py`).
DEMO_FIT = SftConfig(steps=135, batch_size=8, micro_batch_size=8, micro_batch_tokens=2048, length_groups=16, lr=2e-3,
                     lr_schedule="cosine", warmup_share=0.1, lora_r=16, lora_alpha=32)


@dataclass(frozen=True)
class ReaderConfig:
    """The examples, the LoRA fit and the validation of a reader adapter."""

    gold_share: float = 0.8  # RAFT's P: examples whose gold facts are shown (multiple choice; yes/no always)
    max_wrong: int = 6  # distractor triples per question at most (as `oracle-evidence`)
    layouts: tuple[tuple[str, float], ...] = DEFAULT_LAYOUTS  # (layout, weight): what share of examples each gets
    # Multiple-choice examples shown no evidence at all (target: nothing found); without them the quoting reader
    # writes "The evidence states that ..." over no evidence and answers from what it learned (+0.15 on `cot`).
    no_evidence_share: float = 0.1
    fit: SftConfig = field(default_factory=lambda: DEMO_FIT)
    # How a target names its answer (`name_the_option`): "text" (the option's text in the tag) or "letter" (the
    # text, then its letter in the tag, which the adapters look up one line early).
    answer_form: str = "text"
    # Copies of each one-hop multiple-choice question among the examples, each drawn afresh (layout, withholding,
    # distractor order): one-hop questions are a fifth of the train split's multiple-choice ones; 2 copies were no
    # reliable gain on validation.
    one_hop_copies: int = 1
    # A one-hop question whose evidence baits a second hop (`baits_a_second_hop`) enters this many times more
    # (times `one_hop_copies`): 52 train questions, under 4% of the examples once. 3 copies were no gain over three
    # seeds on the whole validation split (0.869 mean either way), so one copy, the simpler recipe.
    baited_copies: int = 1
    valid_dataset: str = "kgqa_mc"  # the gate: the first `valid_items` of this dataset in the validation file
    valid_items: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted({name for name, _ in self.layouts} - set(LAYOUTS))
        if unknown or not self.layouts or any(weight <= 0 for _, weight in self.layouts):
            raise ValueError(f"reader layouts must be (name, weight > 0) pairs with names among {LAYOUTS}; "
                             f"got {self.layouts}")
        if self.answer_form not in ANSWER_FORMS:
            raise ValueError(f"reader answer_form must be one of {ANSWER_FORMS}, got {self.answer_form!r}")
        # Shares are probabilities: a value over 1 would silently make every multiple-choice example evidence-free.
        for name in ("gold_share", "no_evidence_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"reader {name} must be within [0, 1], got {getattr(self, name)}")
        for name in ("one_hop_copies", "baited_copies"):
            if getattr(self, name) < 1:
                raise ValueError(f"reader {name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def profile(cls, name: str, **overrides: object) -> ReaderConfig:
        return profile_config(READER_PROFILES, "reader adapter", name, **overrides)

    def but(self, **fit: object) -> ReaderConfig:
        """This config with the given fields of its LoRA fit (`SftConfig`) replaced."""
        return replace(self, fit=replace(self.fit, **fit))

    def as_dict(self) -> dict[str, object]:
        fit = {f"fit_{k}": v for k, v in asdict(self.fit).items()
               if k in ("steps", "batch_size", "micro_batch_size", "micro_batch_tokens", "length_groups", "lr",
                        "lr_schedule", "warmup_share", "lora_r", "lora_alpha", "lora_layers")}
        return {"gold_share": self.gold_share, "max_wrong": self.max_wrong,
                "layouts": layouts_text(self.layouts),
                "no_evidence_share": self.no_evidence_share, "answer_form": self.answer_form,
                "one_hop_copies": self.one_hop_copies, "baited_copies": self.baited_copies,
                "valid_dataset": self.valid_dataset,
                "valid_items": self.valid_items, "seed": self.seed, **fit}


READER_PROFILES = {
    "tiny": ReaderConfig(fit=SftConfig(steps=2, batch_size=2, micro_batch_size=1, lr=1e-3, lora_r=8, lora_alpha=16,
                                       lora_layers=2), valid_items=4),
    "demo": ReaderConfig(fit=replace(DEMO_FIT, progress=True), valid_items=48),
    # Not measured at this size: the demo's schedule at the full profile's rate.
    "full": ReaderConfig(fit=SftConfig(steps=600, batch_size=16, micro_batch_size=8, lr=2e-4, lr_schedule="cosine",
                                       warmup_share=0.05, lora_r=16, lora_alpha=32, progress=True), valid_items=200),
}


@dataclass(frozen=True)
class ReaderExample:
    qid: str
    conversation: Conversation  # system, user (evidence, question, instruction), assistant (the target)
    gold_shown: bool
    pairs: frozenset[Pair]  # the concept pairs of every fact shown (what the leakage guard checks)
    layout: str = "kg_facts"


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


def baits_a_second_hop(graph: KnowledgeGraph, items: Sequence[QaItem]) -> list[bool]:
    """Per item: is it a one-hop multiple-choice question whose answer concept has a fact to a wrong option? Oracle
    evidence shows that fact beside the gold one (every fact between the question's concepts and the wrong options),
    and a reader taught to follow 2-hop chains reads one fact too far ("X isa Y; and that Y manifestation of Z" -> Z).
    One graph query for all items."""
    asked = [item for item in items if item.extra.get("hops") == 1 and item.extra.get("answer_cuis")]
    linked: dict[str, set[str]] = {}
    for triple in graph.one_hop(sorted({c for item in asked for c in item.extra["answer_cuis"]})):
        linked.setdefault(triple.src_cui, set()).add(triple.dst_cui)
    baited = []
    for item in items:
        answers = set(item.extra.get("answer_cuis") or ())
        wrong = {c for c in item.extra.get("option_cuis") or () if c not in answers}
        baited.append(item.extra.get("hops") == 1 and any(linked.get(a, set()) & wrong for a in answers))
    return baited


def name_the_option(item: QaItem, answer_form: str) -> str:
    """The end of a target. `letter`: the answer's text, then its letter ("The answer is Hypertension, option C.
    <answer>C</answer>"). Written in that order the letter is a look-up of the option list ("C. Hypertension"),
    which the first adapter, trained on the letter alone after its citation, never learned: it cited the right
    fact and answered A regardless. `text`: the option's text in the tag ("The answer is
    <answer>Hypertension</answer>."), which every method's parser reads as that option (`parse_answer`): a copy
    of the text it just quoted instead of the look-up back from text to letter, which is where the letter form's
    adapters missed most on validation."""
    text = item.options[item.answer]
    if answer_form == "text":
        return f"The answer is <answer>{text}</answer>."
    return f"The answer is {text}, option {item.answer}. <answer>{item.answer}</answer>"


# The methods' answering calls stop after 64 new tokens (`OracleEvidenceConfig.max_new_tokens`): a target must name
# its answer within that, with a few tokens to spare; a longer 2-hop target quotes only the fact naming the answer.
TARGET_TOKENS = 60


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate of a target's length in tokens, on the long side (SmolLM2 averages ~3.8 characters
    a token on the targets); callers with the reader's tokenizer pass its count instead."""
    return math.ceil(len(text) / 3.5)


def chain_order(item: QaItem, facts: Sequence[Triple]) -> list[Triple]:
    """The facts in the order a reader follows them: from the question's concept to the answer ("Purpura isa
    Subcutaneous hemorrhage; and that Subcutaneous hemorrhage manifestation of Microscopic polyangiitis"), so a
    2-hop answer is read off the last fact quoted, not the bridge of the first."""
    seeds = set(item.extra.get("seed_cuis") or ())
    answers = set(item.extra.get("answer_cuis") or ())

    def place(fact: Triple) -> int:
        ends = {fact.src_cui, fact.dst_cui}
        return 0 if ends & seeds and not ends & answers else 2 if ends & answers else 1
    return sorted(facts, key=place)


def _quoting_target(item: QaItem, cited: Sequence[Triple], answer_form: str,
                    count_tokens: Callable[[str], int] = approx_tokens) -> str:
    """"The evidence states that <fact>; and that <fact>. The answer is ...": RAFT's form (the answer quotes the
    evidence, no pointer to it), so the model chooses what to quote by its content rather than a number first; the
    facts in chain order, and only the fact touching an answer concept when the whole would not fit the answer
    budget."""
    ending = name_the_option(item, answer_form)
    cited = chain_order(item, cited)
    target = f"The evidence states that {'; and that '.join(t.text for t in cited)}. {ending}"
    answers = set(item.extra.get("answer_cuis") or ())
    naming_answer = [t for t in cited if {t.src_cui, t.dst_cui} & answers]
    if count_tokens(target) <= TARGET_TOKENS or not naming_answer or len(naming_answer) == len(cited):
        return target
    return f"The evidence states that {naming_answer[-1].text}. {ending}"


def concept_texts(facts: Sequence[Triple], described: Sequence[str], nodes: dict[str, Node],
                  rng: random.Random) -> list[tuple[str, str]]:
    """The facts as concept texts in `kg.kg_node_text`'s words ("<name>. Semantic type: <types>. Relations:
    <relation> <object>; ..."), one per subject, plus a description of each concept in `described` that is no
    subject (the other options' concepts): (title, text) documents in a seeded order."""
    subjects = list(dict.fromkeys(t.src_cui for t in facts))
    concepts = subjects + [c for c in dict.fromkeys(described) if c not in subjects and c in nodes]
    rng.shuffle(concepts)
    documents = []
    for cui in concepts:
        node = nodes.get(cui)
        name = node.name if node else next(t.src_name for t in facts if t.src_cui == cui)
        parts = [f"{name}."]
        if node and node.semantic_types:
            parts.append(f"Semantic type: {', '.join(node.semantic_types)}.")
        relations = [f"{t.relation.replace('_', ' ')} {t.dst_name}" for t in facts if t.src_cui == cui]
        if relations:
            parts.append(f"Relations: {'; '.join(relations)}.")
        documents.append((name, " ".join(parts)))
    return documents


def _layout_prompt(layout: str, item: QaItem, facts: Sequence[Triple], nodes: dict[str, Node],
                   rng: random.Random) -> Conversation:
    """The system and user turns of `item` with `facts` shown in `layout`."""
    if layout == "kg_facts":
        return kg_facts_prompt(item, facts)
    if layout == "a2rag":
        return answer_conversation(item, facts, [])
    documents = concept_texts(facts, item.extra.get("option_cuis") or (), nodes, rng)
    sections = [documents_section(documents)] if documents else []
    return [system(EXPERT), user("\n\n".join([*sections, format_question(item), answer_instruction(item)]))]


def with_gold_at_rank(ranked: Sequence[Triple], gold: Sequence[Triple], fact_of: Callable[[Triple], int | None],
                      top: int, rng: random.Random) -> list[Triple]:
    """A retriever's ranked facts with the gold facts in them: each gold fact the retriever found keeps its rank,
    each it missed (no listing of that fact among `ranked`) goes to a random rank, and the lowest-ranked other
    facts make room so at most `top` are shown. `fact_of`: which gold fact a triple lists (None: not gold)."""
    found = {fact_of(t) for t in ranked} - {None}
    shown = list(ranked)
    for fact in gold:
        if fact_of(fact) not in found:
            shown.insert(rng.randrange(len(shown) + 1), fact)
            found.add(fact_of(fact))
    while len(shown) > top:
        last_other = max(i for i, t in enumerate(shown) if fact_of(t) is None)
        del shown[last_other]
    return shown


def reader_examples(graph: KnowledgeGraph, items: Sequence[QaItem], config: ReaderConfig,
                    held_out: frozenset[Pair], count_tokens: Callable[[str], int] = approx_tokens,
                    tools: KnowledgeTools | None = None) -> tuple[list[ReaderExample], Counter[str]]:
    """RAFT examples from train questions with options (see the module doc), and counts of what was kept,
    withheld, dropped and skipped. `count_tokens`: the reader's token count of a target (its answer budget);
    `tools`: the retriever of the `rag_kg` layout (required when the config draws it)."""
    rng = random.Random(config.seed)
    layout_rng = random.Random(f"{config.seed}-layout")  # apart from `rng`: the layouts leave the withholding as it was
    names, weights = zip(*config.layouts, strict=True)
    stats: Counter[str] = Counter()
    examples = []
    shown_per_item = oracle_triples(graph, items, config.max_wrong)
    retrieved = _retrieved(tools, items) if "rag_kg" in names else {}
    nodes = graph.nodes({c for item, shown in zip(items, shown_per_item, strict=True)
                         for c in [*(item.extra.get("option_cuis") or ()), *(t.src_cui for t in shown)]}) \
        if "documents" in names else {}
    baited = baits_a_second_hop(graph, items) if config.baited_copies > 1 else [False] * len(items)
    copies = [_copies(item, is_baited, config) for item, is_baited in zip(items, baited, strict=True)]
    for item, shown in ((item, shown) for item, shown, n in zip(items, shown_per_item, copies, strict=True)
                        for _ in range(n)):
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
        fact_of = _gold_fact_index(item, stated)
        is_gold = [fact_of(t) is not None for t in kept]
        has_gold = any(is_gold)
        if not has_gold and (gold_edges or gold_facts(item)):
            stats["skipped_gold_missing"] += 1  # its fact is not in the graph (or was held out): nothing to cite
            continue
        yes_no = _is_yes_no(item)
        withhold = has_gold and not yes_no and rng.random() >= config.gold_share
        gold = [] if withhold else [t for t, is_g in zip(kept, is_gold, strict=True) if is_g]
        if withhold:
            kept = [t for t, is_g in zip(kept, is_gold, strict=True) if not is_g]
        layout = layout_rng.choices(names, weights)[0]
        passages: list[Passage] = []
        if layout == "rag_kg":  # what rag-kg retrieved for the question, the gold facts in it unless withheld
            passages, ranked = retrieved[item.qid]
            ranked_kept = [t for t in ranked if _pair(t) not in held_out]
            stats["dropped_held_out_facts"] += len(ranked) - len(ranked_kept)
            shown = ranked_kept if gold else [t for t in ranked_kept if fact_of(t) is None]
            kept = with_gold_at_rank(shown, gold, fact_of, RagKgConfig.triples_k, layout_rng)
        if config.no_evidence_share and not yes_no and layout_rng.random() < config.no_evidence_share:
            kept, passages, withhold = [], [], True  # the retriever found nothing at all
            stats["no_evidence"] += 1
        conversation = (rag_prompt(item, passages, kept) if layout == "rag_kg"
                        else _layout_prompt(layout, item, kept, nodes, layout_rng))
        target = _target(item, [t for t in kept if fact_of(t) is not None], layout, withhold, has_gold, config,
                         count_tokens)
        stats.update(["gold_withheld" if withhold else "gold_shown", f"layout_{layout}"])
        examples.append(ReaderExample(item.qid, [*conversation, assistant(target)], not withhold,
                                      frozenset(_pair(t) for t in kept), layout))
    return examples, stats


def _target(item: QaItem, gold_shown: list[Triple], layout: str, withhold: bool, has_gold: bool,
            config: ReaderConfig, count_tokens: Callable[[str], int]) -> str:
    """The reply the reader learns: nothing found (gold withheld), the gold facts quoted and the option named,
    or for a "no" question (its fact is absent by design) that no piece of evidence states it."""
    unit = "document" if layout == "documents" else "fact"  # what the layout calls a piece of evidence
    if withhold:
        return NOT_FOUND if unit == "fact" else NOT_FOUND_DOCUMENTS
    if has_gold:
        return _quoting_target(item, gold_shown, config.answer_form, count_tokens)
    return f"No {unit} states that. {name_the_option(item, config.answer_form)}"


def _retrieved(tools: KnowledgeTools | None, items: Sequence[QaItem]) -> dict[str, tuple[list[Passage], list[Triple]]]:
    """rag-kg's evidence (`rag_kg_evidence`, its default config) for every question with options, by qid."""
    if tools is None:
        raise ValueError("the rag_kg reader layout shows what rag-kg retrieves: reader_examples needs `tools`")
    asked = [item for item in items if item.options]
    return dict(zip((item.qid for item in asked), rag_kg_evidence(tools, asked), strict=True))


def _gold_fact_index(item: QaItem, stated: set[str]) -> Callable[[Triple], int | None]:
    """Which of the item's gold facts a triple lists (a fact may be listed both ways, `gold_facts`), or None."""
    listed = gold_facts(item) or ()
    index = {key: i for i, keys in enumerate(listed) for key in keys}
    unlisted = sorted(stated - set(index))  # gold path triples without a listing of their own: a fact each
    index |= {key: len(listed) + n for n, key in enumerate(unlisted)}
    return lambda t: index.get(f"{t.src_cui}|{t.relation}|{t.dst_cui}")


def _copies(item: QaItem, baited: bool, config: ReaderConfig) -> int:
    """How many times a train question enters the examples: one-hop multiple-choice questions `one_hop_copies`
    times, those among them that bait a second hop `baited_copies` times that."""
    if item.extra.get("hops") != 1 or _is_yes_no(item):
        return 1
    return config.one_hop_copies * (config.baited_copies if baited else 1)


def _is_yes_no(item: QaItem) -> bool:
    return bool(item.options) and {text.strip().lower() for text in item.options.values()} <= {"yes", "no", "maybe"}


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
    lora = lora_of(fit)
    reader = load_trainable(model_dir, lora=lora, device=fit.device, max_batch_size=64, name=name)
    encoded = [encode_conversation(reader.tokenizer, e.conversation, reader.eos_ids) for e in examples]
    history, metrics = fit_replies(reader, encoded, fit, log_fn, desc="reader adapter")
    metrics |= {"examples": float(len(examples)), "examples_gold_shown": float(sum(e.gold_shown for e in examples))}
    return SftResult(reader, metrics, history)


# --------------------------------------------------------------------------- validation (the champion gate)

# What the gate reads: the reader with the gold facts among distractors (its ceiling) and with no evidence at all.
READING_CHECKS = {"oracle": "oracle-evidence", "no_evidence": "cot"}


def reading_accuracy(llm: ChatModel, tools: KnowledgeTools, items: Sequence[QaItem],
                     reader: ChatModel | None = None, batch_size: int = 24) -> dict[str, float]:
    """Accuracy, parse failures and the share asked again of the answering model (`reader`, else `llm`) on
    `items`, with the gold facts shown among distractors (`oracle_*`) and with no evidence (`no_evidence_*`)."""
    metrics = {}
    for check, method in READING_CHECKS.items():
        results = run_method(method, items, tools, llm, batch_size=batch_size, reader=reader)
        n = max(len(results), 1)
        metrics |= {f"{check}_accuracy": sum(r.correct for r in results) / n,
                    f"{check}_parse_failures": sum(r.parse_failed for r in results) / n,
                    f"{check}_asked_again": sum(r.extra_answer_call for r in results) / n}
    return metrics


def gate_metrics(base: dict[str, float], adapted: dict[str, float]) -> dict[str, float]:
    """The `valid_*` metrics the reader gate reads (READER_ADAPTER_MODEL.gate) and the base reader's beside them."""
    return {**{f"valid_{k}": v for k, v in adapted.items()}, **{f"valid_base_{k}": v for k, v in base.items()},
            "valid_no_evidence_gain": adapted["no_evidence_accuracy"] - base["no_evidence_accuracy"]}


def base_reader_baseline(base: dict[str, float], name: str) -> Baseline:
    """With no champion, the adapter must read better than the base reader (and not answer better without
    evidence: the gate's bound on `valid_no_evidence_gain`, which is 0 for the base reader)."""
    return Baseline(f"base reader {name}", {"valid_oracle_accuracy": base["oracle_accuracy"],
                                            "valid_no_evidence_gain": 0.0})
