-- Directed, deduplicated edges between KG nodes: src_cui -relation-> dst_cui.
-- UMLS lists most relations in both directions, so both edges are kept (an
-- agent can walk either way). Self-loops and pure synonymy (SY, RL) are not
-- relations between different things and are dropped (int_kg_edges_unsorted).
-- Provenance is `sab` (the first source) and `source_count`; stg_umls__relations
-- has every asserting row.
select * from {{ ref('int_kg_edges_unsorted') }}
-- Sorted by source so one-hop lookups touch few row groups (zone-map pruning).
order by src_cui, relation, dst_cui
