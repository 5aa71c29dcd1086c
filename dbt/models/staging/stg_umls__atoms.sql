-- One row per atom (a name of a concept in one source), with readable column names.
select
    CUI as cui,
    AUI as aui,
    SAB as sab,
    TTY as tty,
    CODE as code,
    STR as name,
    LAT as language,
    TS = 'P' and STT = 'PF' and ISPREF = 'Y' as is_preferred,
    SRL as srl
from {{ source('umls', 'mrconso') }}
