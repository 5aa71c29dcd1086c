-- One node per concept: preferred name, synonyms, semantic types, one
-- definition, and the source vocabularies that name it.
with atoms as (
    select * from {{ ref('stg_umls__atoms') }}
),

concepts as (
    select * from {{ ref('stg_umls__concepts') }}
),

synonyms as (
    select
        a.cui,
        list(distinct a.name order by a.name) filter (where lower(a.name) <> lower(c.preferred_name)) as synonyms,
        list(distinct a.sab order by a.sab) as sources
    from atoms as a
    join concepts as c using (cui)
    group by a.cui
),

types as (
    select
        cui,
        list(semantic_type order by tui) as semantic_types,
        list(tui order by tui) as tuis
    from {{ ref('stg_umls__semantic_types') }}
    group by cui
),

definitions as (
    -- Prefer curated clinical sources, then the longest definition (the most informative).
    select
        cui,
        arg_min(
            definition,
            [case sab when 'MSH' then 0 when 'NCI' then 1 when 'HPO' then 2 when 'CSP' then 3 else 9 end,
             -length(definition)]
        ) as definition
    from {{ ref('stg_umls__definitions') }}
    group by cui
)

select
    c.cui,
    c.preferred_name,
    coalesce(s.synonyms, []) as synonyms,
    coalesce(t.semantic_types, []) as semantic_types,
    coalesce(t.tuis, []) as tuis,
    d.definition,
    s.sources
from concepts as c
left join synonyms as s using (cui)
left join types as t using (cui)
left join definitions as d using (cui)
