-- Directed, deduplicated edges between KG nodes: src_cui -relation-> dst_cui.
-- UMLS lists most relations in both directions, so both edges are kept (an
-- agent can walk either way). Self-loops and pure synonymy (SY, RL) are not
-- relations between different things and are dropped.
with relations as (
    select * from {{ ref('stg_umls__relations') }}
    where src_cui <> dst_cui
      and rel not in ('SY', 'RL')
),

nodes as (
    select cui from {{ ref('kg_nodes') }}
)

select
    md5(src_cui || '|' || rel || '|' || coalesce(rela, '') || '|' || dst_cui) as edge_id,
    src_cui,
    rel,
    rela,
    any_value(relation) as relation,
    dst_cui,
    min(sab) as sab,
    list(distinct sab order by sab) as sources
from relations
where src_cui in (select cui from nodes)
  and dst_cui in (select cui from nodes)
group by src_cui, rel, rela, dst_cui
-- Sorted by source so one-hop lookups touch few row groups (zone-map pruning).
order by src_cui, relation, dst_cui
