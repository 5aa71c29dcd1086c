-- One row per concept with its preferred name: the atom UMLS marks preferred
-- (TS=P, STT=PF, ISPREF=Y); a concept whose preferred atom was filtered out
-- falls back to its first preferred-for-term atom, then any atom.
with ranked as (
    select
        cui,
        name,
        row_number() over (
            partition by cui
            order by is_preferred desc, (tty = 'PT') desc, length(name), name
        ) as rank
    from {{ ref('stg_umls__atoms') }}
)
select cui, name as preferred_name
from ranked
where rank = 1
