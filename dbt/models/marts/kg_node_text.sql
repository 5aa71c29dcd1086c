-- One readable text per node (what retrieval embeds and Graph-R1's `analyze`
-- reads): name, synonyms, types, definition and a few verbalized relations.
{% set max_synonyms = 8 %}
{% set max_relations = 8 %}
with nodes as (
    select * from {{ ref('kg_nodes') }}
),

ranked_edges as (
    -- Informative relations (may_treat, has_manifestation, ...) before hierarchy.
    select
        e.src_cui as cui,
        replace(e.relation, '_', ' ') || ' ' || n.preferred_name as phrase,
        row_number() over (
            partition by e.src_cui
            order by e.relation in ('isa', 'inverse_isa', 'parent_of', 'child_of', 'broader_than', 'narrower_than'),
                     e.relation, n.preferred_name
        ) as rank
    from {{ ref('kg_edges') }} as e
    join nodes as n on n.cui = e.dst_cui
),

relations as (
    select cui, string_agg(phrase, '; ' order by rank) as relations
    from ranked_edges
    where rank <= {{ max_relations }}
    group by cui
)

select
    n.cui,
    n.preferred_name as title,
    concat_ws(' ',
        n.preferred_name || '.',
        case when len(n.synonyms) > 0
             then 'Also known as: ' || array_to_string(n.synonyms[1:{{ max_synonyms }}], '; ') || '.' end,
        case when len(n.semantic_types) > 0
             then 'Semantic type: ' || array_to_string(n.semantic_types, ', ') || '.' end,
        case when n.definition is not null then 'Definition: ' || n.definition end,
        case when r.relations is not null then 'Relations: ' || r.relations || '.' end
    ) as text
from nodes as n
left join relations as r using (cui)
