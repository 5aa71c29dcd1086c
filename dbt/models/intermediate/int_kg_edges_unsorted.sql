-- Directed, deduplicated edges between KG nodes, before kg_edges sorts them (see
-- kg_edges.sql for what an edge is). A table of its own so that DuckDB runs the
-- aggregation and the sort as two statements: in one, at 10M MRREL rows, the sort
-- fed by the aggregation ran out of memory in 2 GB even with one thread; apart,
-- each spills and both fit (benchmarks/README.md). Only plain aggregates, which
-- spill, where a list() aggregate (the former `sources` list) stays in memory.
with relations as (
    select * from {{ ref('stg_umls__relations') }}
    where src_cui <> dst_cui
      and rel not in ('SY', 'RL')
),

nodes as (
    select cui from {{ ref('kg_nodes') }}
),

-- One row per (edge, source).
edge_sources as (
    select src_cui, rel, rela, dst_cui, sab, any_value(relation) as relation
    from relations
    where src_cui in (select cui from nodes)
      and dst_cui in (select cui from nodes)
    group by src_cui, rel, rela, dst_cui, sab
)

select
    md5(src_cui || '|' || rel || '|' || coalesce(rela, '') || '|' || dst_cui) as edge_id,
    src_cui,
    rel,
    rela,
    any_value(relation) as relation,
    dst_cui,
    min(sab) as sab,
    count(*) as source_count
from edge_sources
group by src_cui, rel, rela, dst_cui
