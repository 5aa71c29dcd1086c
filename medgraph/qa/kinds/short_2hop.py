"""Short answers two edges away (dataset kgqa_short): chains, "Which drug may treat a condition with <phenotype>
as a manifestation?", and intersections, "What has <phenotype> as a manifestation and is associated with
the gene <gene>?", in turn.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from medgraph.kg.relation_phrases import relation_phrases
from medgraph.qa.drafting import Draft, by_name, ranked_pages, structure_answers, two_hop_chains
from medgraph.qa.kg_view import SUBJECT_BATCH, QaGraph


def _chain_drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    for chain in two_hop_chains(graph, rng, graph.limits.max_answers):
        # An answer the bridge inherits from below it is right too (`Chain.inherited_answers`): accepted, and
        # counted against the limit on correct concepts and in the adjacency check.
        answers = (*chain.answers, *by_name(graph, chain.inherited_answers(graph)))
        if len(answers) > graph.limits.max_answers or structure_answers(graph, (chain.subject,), 2, answers):
            continue
        path = chain.path_to(graph, answers[0])
        yield Draft(
            question_type="short_2hop",
            fact=("chain", chain.subject, graph.canonical(chain.first, "via"), chain.second),
            question=relation_phrases(chain.second).short_about(chain.about(graph), described=True),
            options={},
            option_cuis=(),
            answer=graph.names[answers[0]],
            answer_cuis=tuple(answers),
            acceptable_answers=graph.answer_names(answers),
            path=path,
            seed_cuis=(chain.subject,),
            relations=(path[0][1], path[1][1]),
        )


def _intersection_drafts(graph: QaGraph, rng: random.Random, attempts: int = 3) -> Iterator[Draft]:
    """"What <clause about e1> and <clause about e2>?": concepts linked to two question
    entities, where each constraint alone allows more answers than both together.

    The gold path runs e1 -> answer -> e2 through the answer.
    """
    limits = graph.limits
    for answer in itertools.islice(_answers(graph, rng), limits.max_intersection_tries):
        constraints: dict[str, list[str]] = {}
        for relation, objects in sorted(graph.out[answer].items()):
            seeds = [o for o in objects if graph.is_seed(o)]
            if graph.usable_relation(relation) and seeds:
                constraints[relation] = seeds
        relations = sorted(constraints)
        for _ in range(attempts):
            if len(relations) >= 2:
                q1, q2 = rng.sample(relations, 2)
                e1, e2 = rng.choice(constraints[q1]), rng.choice(constraints[q2])
            elif relations and len(constraints[relations[0]]) >= 2:
                q1 = q2 = relations[0]
                e1, e2 = rng.sample(constraints[q1], 2)
            else:
                break
            (q1, e1), (q2, e2) = sorted([(graph.canonical(q1, "clause"), e1), (graph.canonical(q2, "clause"), e2)])
            if graph.both_hierarchical(q1, q2):
                continue
            first, second = graph.subjects_worded(e1, q1, "clause"), graph.subjects_worded(e2, q2, "clause")
            answers = first & second
            if not (1 <= len(answers) <= limits.max_answers) or answers in (first, second) \
                    or structure_answers(graph, (e1, e2), 1, answers):
                continue
            ordered = by_name(graph, answers)
            canonical = ordered[0]
            # e1 -> answer: preferably the inverse of the constraint, else any edge.
            inverses = [graph.inverse[r] for r in graph.worded_alike(q1, "clause") if r in graph.inverse]
            back = graph.relation_between(e1, canonical, [*inverses, *sorted(graph.out.get(e1, {}))])
            if back is None:
                continue
            asked = graph.relation_between(canonical, e1, graph.worded_alike(q1, "clause"))
            forward = graph.relation_between(canonical, e2, graph.worded_alike(q2, "clause"))
            first_clause = relation_phrases(q1).clause.format(object=graph.names[e1])
            second_clause = relation_phrases(q2).clause.format(object=graph.names[e2])
            yield Draft(
                question_type="short_2hop",
                fact=("intersection", e1, q1, e2, q2),
                question=f"What {first_clause} and {second_clause}?",
                options={},
                option_cuis=(),
                answer=graph.names[canonical],
                answer_cuis=tuple(ordered),
                acceptable_answers=graph.answer_names(ordered),
                path=((e1, back, canonical), (canonical, forward, e2)),
                seed_cuis=(e1, e2),
                relations=(asked, forward),  # answer -> e1, answer -> e2
            )
            break


def _answers(graph: QaGraph, rng: random.Random) -> Iterator[str]:
    """The concepts an intersection can be asked about, in a pseudo-random order drawn from `rng`: nameable,
    with seed objects (nameable, no hub) under two usable relations, or two under one; the neighbourhoods
    of each batch read together.

    The same as every nameable concept with an edge, less those `_intersection_drafts` would skip at once
    (without drawing from `rng`): DuckDB drops them in one pass. On a synthetic 10M-MRREL release most
    concepts are such, and reading their neighbourhoods was most of question generation's time.
    """
    sql = """
        SELECT e.cui AS a, NULL AS b, row_number() OVER (ORDER BY md5($salt || e.cui), e.cui) AS rank
        FROM (SELECT e.src_cui AS cui FROM kg.kg_edges e JOIN qa_concepts o ON o.cui = e.dst_cui
              WHERE e.src_cui <> e.dst_cui AND NOT o.ambiguous AND o.degree <= $max_degree
                AND NOT list_contains($skip, e.relation)
              GROUP BY e.src_cui HAVING count(DISTINCT e.relation) >= 2 OR count(DISTINCT e.dst_cui) >= 2) e
        JOIN qa_concepts q ON q.cui = e.cui WHERE NOT q.ambiguous
    """
    params = {"salt": f"{rng.getrandbits(64):016x}", "max_degree": graph.limits.max_degree,
              "skip": sorted(graph.limits.skip_relations)}
    for page in ranked_pages(graph, sql, params, SUBJECT_BATCH):
        graph.prefetch({cui for cui, _ in page}, adjacency_levels=2, concept_levels=3, expand_hubs=False)
        yield from (cui for cui, _ in page)


def drafts(graph: QaGraph, rng: random.Random) -> Iterator[Draft]:
    """Chains and intersections in turn."""
    streams = [_chain_drafts(graph, rng), _intersection_drafts(graph, rng)]
    while streams:
        for stream in list(streams):
            draft = next(stream, None)
            if draft is None:
                streams.remove(stream)
            else:
                yield draft
