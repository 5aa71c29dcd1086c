-- The relation vocabulary of the graph: every (rel, rela) pair with its label and edge count.
select
    e.rel,
    e.rela,
    e.relation,
    l.label as rel_label,
    l.description as rel_description,
    count(*) as edges
from {{ ref('kg_edges') }} as e
left join {{ ref('umls_rel_labels') }} as l on l.rel = e.rel
group by all
order by edges desc
