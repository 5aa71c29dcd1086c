"""Multiple choice, one hop (dataset kgqa_mc): "Which of the following may treat <disease>?", one correct
concept and three of the subject's other neighbours of its type.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.qa.drafting import OPTION_LETTERS, Draft, pick_distractors, question_subjects
from medgraph.qa.kg_view import QaGraph


def drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    for relation, subject in question_subjects(graph, rng, None, adjacency_levels=2, concept_levels=2):
        candidates = [c for c in graph.objects(subject, relation) if graph.can_be_named(c)]
        if not candidates:
            continue
        correct = rng.choice(candidates)
        distractors = pick_distractors(graph, subject, relation, "mc", correct, len(OPTION_LETTERS) - 1, rng)
        if len(distractors) < len(OPTION_LETTERS) - 1:
            continue
        option_cuis = [correct, *distractors]
        rng.shuffle(option_cuis)
        letter = OPTION_LETTERS[option_cuis.index(correct)]
        yield Draft(
            question_type="mc",
            fact=(subject, graph.canonical(relation, "mc")),  # the stem: other seeds vary only the options
            question=relation_phrases(relation).mc.format(subject=graph.names[subject]),
            options={letter_: graph.names[cui] for letter_, cui in zip(OPTION_LETTERS, option_cuis)},
            option_cuis=tuple(option_cuis),
            answer=letter,
            answer_cuis=(correct,),
            acceptable_answers=graph.answer_names([correct]),
            path=((subject, relation, correct),),
            seed_cuis=(subject,),
            relations=(relation,),
        )
