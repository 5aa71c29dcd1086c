select
    CUI as cui,
    AUI as aui,
    SAB as sab,
    trim(DEF) as definition
from {{ source('umls', 'mrdef') }}
where DEF is not null and trim(DEF) <> ''
