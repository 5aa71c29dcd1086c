-- Every name of every node (preferred names and synonyms from all sources),
-- normalized for exact lookup; sorted so DuckDB's zone maps prune a point lookup
-- to a single row group.
select distinct
    a.cui,
    a.name,
    {{ normalize_name('a.name') }} as normalized_name,
    a.is_preferred
from {{ ref('stg_umls__atoms') }} as a
where a.cui in (select cui from {{ ref('kg_nodes') }})
  and {{ normalize_name('a.name') }} <> ''
order by normalized_name, cui
