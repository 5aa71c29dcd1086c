-- MRREL rows turned into readable directed edges. UMLS reads a row
-- (CUI1, REL, CUI2, RELA) as "CUI2 is REL / RELA of CUI1", so the edge runs
-- src = CUI2 -> dst = CUI1: (drug, may_treat, disease), (child, isa, parent).
select
    r.CUI2 as src_cui,
    r.REL as rel,
    nullif(r.RELA, '') as rela,
    r.CUI1 as dst_cui,
    r.SAB as sab,
    r.DIR as asserted_direction,
    coalesce(nullif(r.RELA, ''), l.label, lower(r.REL)) as relation
from {{ source('umls', 'mrrel') }} as r
left join {{ ref('umls_rel_labels') }} as l on l.rel = r.REL
