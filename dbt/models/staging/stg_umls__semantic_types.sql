select distinct
    CUI as cui,
    TUI as tui,
    STY as semantic_type,
    STN as tree_number
from {{ source('umls', 'mrsty') }}
