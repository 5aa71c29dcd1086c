"""Yes/no (dataset kgqa_yesno): "Is <phenotype> a manifestation of <disease>?", in pairs from one subject: yes
(an edge) and no (a neighbour under another relation).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.kg.shortcuts import content_words
from medgraph.qa.drafting import YES_NO_OPTIONS, Draft, pick_distractors, question_subjects
from medgraph.qa.kg_view import Edge, QaGraph


def drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    """Pairs from one subject and relation: a true edge (yes) and a "no" about a neighbour of the subject
    under another relation, of the true object's semantic type and sharing a word with the subject exactly
    when the true object does. Adjacency, the relation, the object's type and word overlap then say
    nothing about the answer: only the relation between the two concepts does.

    A statement is asked once, in one orientation: "May lisinopril be used to
    treat Hypertension?" comes from both (lisinopril may_treat Hypertension) and
    (Hypertension may_be_treated_by lisinopril).
    """
    asked: set[Edge] = set()
    for relation, subject in question_subjects(graph, rng, None, adjacency_levels=2, concept_levels=2):
        candidates = [c for c in graph.objects(subject, relation) if graph.can_be_named(c)]
        if not candidates:
            continue
        true_object = rng.choice(candidates)
        overlaps = bool(content_words(graph.names[subject]) & content_words(graph.names[true_object]))
        negatives = [c for c in pick_distractors(graph, subject, relation, "yesno", true_object, 20, rng)
                     if bool(content_words(graph.names[subject]) & content_words(graph.names[c])) == overlaps]
        if not negatives:
            continue
        pair = []
        for obj, answer in ((true_object, "A"), (negatives[0], "B")):
            oriented = graph.oriented(subject, relation, obj)
            fact = (oriented[0], graph.canonical(oriented[1], "yesno"), oriented[2])
            pair.append((oriented, fact, answer))
        if any(fact in asked for _, fact, _ in pair):
            continue
        for (s_, r_, o_), fact, answer in pair:
            asked.add(fact)
            yield Draft(
                question_type="yesno",
                fact=fact,
                question=relation_phrases(r_).yesno.format(subject=graph.names[s_], object=graph.names[o_]),
                options=dict(YES_NO_OPTIONS),
                option_cuis=(),
                answer=answer,
                answer_cuis=(o_,) if answer == "A" else (),
                acceptable_answers=(YES_NO_OPTIONS[answer],),
                path=((s_, r_, o_),) if answer == "A" else (),
                seed_cuis=(s_, o_),
                relations=(r_,),
            )
