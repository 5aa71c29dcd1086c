-- One readable text per node (what retrieval embeds and Graph-R1's `analyze`
-- reads): name, synonyms, types, definition and a few verbalized relations.
-- `description` is what a node *is* without its relations (name, synonyms,
-- types): the GAT's node features, which must not spell out the edges it is
-- asked to predict.
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
),

described as (
    select
        n.cui,
        n.preferred_name as title,
        concat_ws(' ',
            n.preferred_name || '.',
            case when len(n.synonyms) > 0
                 then 'Also known as: ' || array_to_string(n.synonyms[1:{{ max_synonyms }}], '; ') || '.' end,
            case when len(n.semantic_types) > 0
                 then 'Semantic type: ' || array_to_string(n.semantic_types, ', ') || '.' end
        ) as description,
        n.definition
    from nodes as n
)

select
    d.cui,
    d.title,
    concat_ws(' ',
        d.description,
        case when d.definition is not null then 'Definition: ' || d.definition end,
        case when r.relations is not null then 'Relations: ' || r.relations || '.' end
    ) as text,
    d.description
from described as d
left join relations as r using (cui)
