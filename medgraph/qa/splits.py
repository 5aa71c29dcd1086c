"""Leak-free splits by fact: a question's facts are the unordered concept pairs of its gold path; questions that
share a fact join (transitively) into components and each component lands whole in one split.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from medgraph.qa.drafting import DATASET_OF_TYPE, OPTION_LETTERS, Draft
from medgraph.qa.kg_view import Edge

SPLIT_NAMES = ("train", "validation", "test")
# Hashed with every split key. Changed once, on 2026-12-07 (it was empty): earlier choices had read misses of the
# old test split; the questions now in test were never looked at to choose anything. Choices are made on
# validation; test is read only for the report. Changing it again re-draws every split.
SPLIT_SALT = "medgraph-2026-12-07"


def question_id(question_type: str, fact: Sequence[str]) -> str:
    """A qid that depends only on the fact asked about, so it is stable across seeds and runs."""
    digest = hashlib.sha1("|".join((question_type, *fact)).encode("utf-8")).hexdigest()[:16]
    return f"{DATASET_OF_TYPE[question_type]}-{digest}"


def split_of(key: str, fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> str:
    """train / validation / test from the sha1 of `SPLIT_SALT` and `key`: stable, never random."""
    position = int(hashlib.sha1(f"{SPLIT_SALT}|{key}".encode()).hexdigest()[:15], 16) / 16**15
    bound = 0.0
    for name, fraction in zip(SPLIT_NAMES, fractions):
        bound += fraction
        if position < bound:
            return name
    return SPLIT_NAMES[-1]


Pair = tuple[str, str]  # an unordered concept pair, stored sorted


def concept_pair(a: str, b: str) -> Pair:
    return (a, b) if a <= b else (b, a)


def gold_pairs_of(path: Iterable[Edge]) -> tuple[Pair, ...]:
    """The unordered concept pairs of a gold path, each once, in path order."""
    return tuple(dict.fromkeys(concept_pair(src, dst) for src, _, dst in path))


def fact_key(src: str, relation: str, dst: str) -> str:
    return f"{src}|{relation}|{dst}"


def fact_keys(edge: Edge, inverse: Mapping[str, str]) -> tuple[str, ...]:
    """The keys that state one edge: itself, and the reverse listing under its inverse relation (UMLS lists
    most relations twice); the edge's own key first."""
    src, relation, dst = edge
    reverse = {inverse[relation]} if relation in inverse else set()
    reverse |= {r for r, inv in inverse.items() if inv == relation}
    return (fact_key(src, relation, dst), *sorted(fact_key(dst, r, src) for r in reverse))


def draft_facts(draft: Draft) -> set[Pair]:
    """What a question asks or rewards, as unordered pairs: its gold path; for a 1-hop question every
    (question entity, correct answer) too (each is scored correct); for a "no", the pair it asks about."""
    facts = set(gold_pairs_of(draft.path))
    if draft.question_type in ("mc", "short_1hop"):
        facts |= {concept_pair(draft.seed_cuis[0], answer) for answer in draft.answer_cuis}
    if not draft.path:
        facts.add(concept_pair(*draft.seed_cuis[:2]))
    return facts


def fact_components(facts_per_item: Sequence[set[Pair]]) -> list[Pair]:
    """For each item, its component of the fact graph, named by the component's smallest pair.

    Items that share a fact (an unordered pair) are joined, transitively (union-find over pairs).
    """
    parent: dict[Pair, Pair] = {}

    def root(pair: Pair) -> Pair:
        parent.setdefault(pair, pair)
        while parent[pair] != pair:
            parent[pair] = parent[parent[pair]]  # path halving
            pair = parent[pair]
        return pair

    for facts in facts_per_item:
        if not facts:
            raise ValueError("a question without facts cannot be split by fact")
        ordered = sorted(facts)
        for other in ordered[1:]:
            a, b = root(ordered[0]), root(other)
            if a != b:
                parent[max(a, b)] = min(a, b)  # a root stays its component's smallest pair
    return [root(min(facts)) for facts in facts_per_item]


def fact_splits(facts_per_item: Sequence[set[Pair]], fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> list[str]:
    """The split of each item such that no fact occurs in two splits: a whole component per split, from
    the hash of its smallest pair (an item alone with its facts keeps its split whatever else is generated)."""
    return [split_of("|".join(component), fractions) for component in fact_components(facts_per_item)]


def bound_answer_shares(drafts: Sequence[Draft], split_per_draft: Sequence[str], order: Sequence[int],
                        max_share: float, max_share_per_relation: float) -> list[int]:
    """The drafts kept (indices, in `order`) so that in each (dataset, split) of n questions no answer concept
    answers more than `max_share` x n, nor more than `max_share_per_relation` x m of the m that ask by one relation
    chain; a concept that answers at most `max_share` of all the dataset's drafts (or one draft) may answer one
    question of a split whatever its size. Yes/no questions are bounded elsewhere (half yes, half no).

    A hub that answers most questions makes "always say the hub" a shortcut that beats chance (the majority rule
    of `medgraph.kg.shortcuts`); the generator drops the excess rather than leave the blocking check to fire. A
    split too small to hold a hub at its share (a dense graph's test split: its facts join one large component,
    which lands in train) gets none of the hub's questions. Drafts are taken in `order` (the split files' draw
    order), in passes until none more fits: a bound only grows with the kept questions, so what held when a
    question was taken holds at the end."""
    bounded = [i for i in order if drafts[i].question_type != "yesno"]
    pooled = Counter(DATASET_OF_TYPE[drafts[i].question_type] for i in bounded)
    answered = Counter((DATASET_OF_TYPE[drafts[i].question_type], c) for i in bounded for c in drafts[i].answer_cuis)
    frequent = {key for key, count in answered.items() if count > max(1.0, max_share * pooled[key[0]])}
    kept = [i for i in order if drafts[i].question_type == "yesno"]
    per_answer: Counter[tuple] = Counter()
    per_group: Counter[tuple] = Counter()
    waiting = bounded
    while True:
        still_waiting = []
        for index in waiting:
            draft = drafts[index]
            dataset = DATASET_OF_TYPE[draft.question_type]
            group = (dataset, split_per_draft[index])
            bounds = ((group, max_share), ((*group, draft.relations), max_share_per_relation))
            # Every correct concept counts: a short answer's majority rule is right wherever it is among them.
            if any(per_answer[(*key, answer)] + 1
                   > max(0.0 if (dataset, answer) in frequent else 1.0, share * (per_group[key] + 1))
                   for key, share in bounds for answer in draft.answer_cuis):
                still_waiting.append(index)
                continue
            kept.append(index)
            for key, _ in bounds:
                per_group[key] += 1
                per_answer.update((*key, answer) for answer in draft.answer_cuis)
        if len(still_waiting) == len(waiting):
            return kept
        waiting = still_waiting


def balance_answer_positions(drafts: Sequence[Draft], split_per_draft: Sequence[str]) -> list[Draft]:
    """Multiple choice: the correct option's letter rotates A, B, C, D over each (question type, split) in
    qid order, so every letter is right in a quarter of each split (to within one item); the rotation goes on
    from one type to the next of the same dataset, so the dataset's split is balanced as well (a small test
    split of one 1-hop and one 2-hop question gets two letters, not "A" twice).

    A per-item shuffle is fair only in expectation: with seed 0 on the demo KG, D was right for 38 of 100
    validation and 31 of 72 test 2-hop items (train: 203 of 800), so a reader that leans to D looked like it
    reads, and no shortcut rule fitted on train can see it. The correct option swaps places with the option at
    its letter; the distractors keep their shuffled order otherwise."""
    rank: dict[tuple[str, str], list[int]] = {}
    for index, (draft, split) in enumerate(zip(drafts, split_per_draft, strict=True)):
        if len(draft.options) == len(OPTION_LETTERS) and draft.answer in OPTION_LETTERS:
            rank.setdefault((draft.question_type, split), []).append(index)
    balanced = list(drafts)
    turn: Counter[tuple[str, str]] = Counter()  # (dataset, split) -> questions rotated so far
    for (question_type, split), indices in sorted(rank.items()):
        indices.sort(key=lambda i: question_id(drafts[i].question_type, drafts[i].fact))
        start = turn[(DATASET_OF_TYPE[question_type], split)]
        turn[(DATASET_OF_TYPE[question_type], split)] += len(indices)
        for position, index in enumerate(indices, start=start):
            draft = drafts[index]
            option_cuis = list(draft.option_cuis)
            names = [draft.options[letter] for letter in OPTION_LETTERS]
            here, there = OPTION_LETTERS.index(draft.answer), position % len(OPTION_LETTERS)
            option_cuis[here], option_cuis[there] = option_cuis[there], option_cuis[here]
            names[here], names[there] = names[there], names[here]
            balanced[index] = replace(draft, option_cuis=tuple(option_cuis), answer=OPTION_LETTERS[there],
                                      options=dict(zip(OPTION_LETTERS, names, strict=True)))
    return balanced
