"""Multiple choice, two hops (dataset kgqa_mc): "Which of the following may treat a condition with <phenotype>
as a manifestation?", wrong options two edges away through other relations.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

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
    goes up the hierarchy first, a concept under a bridge (`Chain.inherited_answers`)."""
    seconds = graph.worded_alike(chain.second, "described")
    inherited = chain.inherited_answers(graph)
    taken_names = set(graph.normalized_names[chain.subject])
    for cui in chain.answers:
        taken_names |= graph.normalized_names[cui]
    chosen: list[str] = []

    def acceptable(cui: str) -> bool:
        return (cui not in chosen and cui not in chain.answers and cui != chain.subject and cui not in chain.bridges
                and graph.can_be_named(cui) and not any(graph.linked_by(b, cui, seconds) for b in chain.bridges)
                and not any(graph.in_lineage(cui, a) for a in chain.answers)
                and cui not in inherited
                and not (graph.normalized_names[cui] & taken_names))

    tui = graph.tuis[answer][0] if graph.tuis.get(answer) else None
    for cui in pick(rng, [c for c in sorted(graph.within(chain.subject, 2)) if tui in graph.tuis.get(c, ())],
                     acceptable, k):
        chosen.append(cui)
        taken_names |= graph.normalized_names[cui]
    return chosen
