"""Short answers, one hop (dataset kgqa_short): "What is the mechanism of action of <drug>?", every correct
concept's names kept for F1/EM.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.qa.drafting import Draft, by_name, question_subjects, structure_answers
from medgraph.qa.kg_view import QaGraph


def drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    limits = graph.limits
    for relation, subject in question_subjects(graph, rng, limits.max_answers, adjacency_levels=1, concept_levels=2):
        answers = by_name(graph, graph.objects_worded(subject, relation, "short"))
        if len(answers) > limits.max_answers or structure_answers(graph, (subject,), 1, answers):
            continue
        step = graph.relation_between(subject, answers[0], graph.worded_alike(relation, "short"))
        yield Draft(
            question_type="short_1hop",
            fact=(subject, graph.canonical(relation, "short")),
            question=relation_phrases(relation).short_about(graph.names[subject]),
            options={},
            option_cuis=(),
            answer=graph.names[answers[0]],
            answer_cuis=tuple(answers),
            acceptable_answers=graph.answer_names(answers),
            path=((subject, step, answers[0]),),
            seed_cuis=(subject,),
            relations=(step,),
        )
