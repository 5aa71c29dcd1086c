"""Multiple choice, two hops (dataset kgqa_mc): "Which of the following may treat a condition with <phenotype>
as a manifestation?", wrong options two edges away through other relations.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.qa.drafting import OPTION_LETTERS, Chain, Draft, pick, two_hop_chains
from medgraph.qa.kg_view import QaGraph


def drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    """"Which of the following may treat a condition with <phenotype> as a manifestation?": a chain
    (see `two_hop_chains`) whose wrong options also lie two edges from the question concept, through other
    relations (of the answer's semantic type), and are verifiably not reached by the asked chain, nor inherited
    from below a bridge the chain goes up to."""
    for chain in two_hop_chains(graph, rng, max_answers=len(OPTION_LETTERS)):
        named = [a for a in chain.answers if graph.can_be_named(a)]
        if not named:
            continue
        correct = rng.choice(named)
        distractors = _two_hop_distractors(graph, chain, correct, len(OPTION_LETTERS) - 1, rng)
        if len(distractors) < len(OPTION_LETTERS) - 1:
            continue
        option_cuis = [correct, *distractors]
        rng.shuffle(option_cuis)
        letter = OPTION_LETTERS[option_cuis.index(correct)]
        path = chain.path_to(graph, correct)
        yield Draft(
            question_type="mc_2hop",
            fact=("chain", chain.subject, graph.canonical(chain.first, "via"), chain.second),
            question=relation_phrases(chain.second).mc.format(subject=chain.about(graph)),
            options={letter_: graph.names[cui] for letter_, cui in zip(OPTION_LETTERS, option_cuis)},
            option_cuis=tuple(option_cuis),
            answer=letter,
            answer_cuis=(correct,),
            acceptable_answers=graph.answer_names([correct]),
            path=path,
            seed_cuis=(chain.subject,),
            relations=(path[0][1], path[1][1]),
        )


def _two_hop_distractors(graph: QaGraph, chain: Chain, answer: str, k: int, rng: random.Random) -> list[str]:
    """Concepts within two edges of the chain's subject, of the answer's semantic type, that the asked
    chain does not reach: no bridge links them by the second relation (either listing), nor, when the chain
    goes up the hierarchy first, a concept under a bridge (`_inheritors`)."""
    seconds = graph.worded_alike(chain.second, "described")
    inheritors = _inheritors(graph, chain)
    taken_names = set(graph.normalized_names[chain.subject])
    for cui in chain.answers:
        taken_names |= graph.normalized_names[cui]
    chosen: list[str] = []

    def acceptable(cui: str) -> bool:
        return (cui not in chosen and cui not in chain.answers and cui != chain.subject and cui not in chain.bridges
                and graph.can_be_named(cui) and not any(graph.linked_by(b, cui, seconds) for b in chain.bridges)
                and not any(graph.in_lineage(cui, a) for a in chain.answers)
                and not (inheritors and _reached_from(graph, inheritors, cui, seconds))
                and not (graph.normalized_names[cui] & taken_names))

    tui = graph.tuis[answer][0] if graph.tuis.get(answer) else None
    for cui in pick(rng, [c for c in sorted(graph.within(chain.subject, 2)) if tui in graph.tuis.get(c, ())],
                     acceptable, k):
        chosen.append(cui)
        taken_names |= graph.normalized_names[cui]
    return chosen


def _inheritors(graph: QaGraph, chain: Chain) -> frozenset[str]:
    """What the second relation's answers are inherited from when the first hop goes up the hierarchy.

    "A broader category of Shortened QT interval is a manifestation of which?" asks about Abnormal QT
    interval; a disease with Shortened QT interval as a manifestation has an abnormal QT interval too (an
    annotation holds for every ancestor of its term: HPO's true-path rule), so it is a second correct answer
    although no edge links it to the bridge. The concepts under the bridges within the subject's reach (the
    subject, its children, the bridges' other children) are the inheritors; deeper descendants are not read
    (a walk down the hierarchy per question). Empty when no bridge is above the subject.
    """
    above = [b for b in chain.bridges if b in graph.ancestors(chain.subject)]
    if not above:
        return frozenset()
    return frozenset({chain.subject, *graph.children.get(chain.subject, ()),
                      *(c for b in above for c in graph.children.get(b, ()))})


def _reached_from(graph: QaGraph, sources: frozenset[str], cui: str, relations: Sequence[str]) -> bool:
    """Some concept of `sources` links to `cui` by one of `relations` (either listing), read from `cui`'s side."""
    return any(s in sources for r in relations
               for s in (*graph.subjects(cui, r), *graph.objects(cui, graph.inverse.get(r, ""))))
