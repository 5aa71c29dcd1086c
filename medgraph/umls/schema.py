"""Column layouts of the UMLS Metathesaurus RRF files we ingest.

The single source of truth for field names and order; taken from MRFILES.RRF of
a real release and the NLM reference manual. Every RRF data row ends with `|`,
so a well-formed row splits into ``len(columns) + 1`` fields, the last empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMA = "umls"  # the warehouse schema of the ingested tables (`umls.mrconso`, ...)


@dataclass(frozen=True)
class RrfLayout:
    """One META file: its name, what it holds, and its columns in order."""

    name: str  # e.g. "MRCONSO"
    description: str
    columns: tuple[str, ...]
    required: bool = True

    @property
    def filename(self) -> str:
        return f"{self.name}.RRF"

    @property
    def table(self) -> str:
        return self.name.lower()

    @property
    def field_count(self) -> int:
        """Fields per row as split on `|`, including the empty trailing one."""
        return len(self.columns) + 1


MRCONSO = RrfLayout(
    "MRCONSO",
    "Concept names and sources",
    ("CUI", "LAT", "TS", "LUI", "STT", "SUI", "ISPREF", "AUI", "SAUI", "SCUI", "SDUI", "SAB", "TTY",
     "CODE", "STR", "SRL", "SUPPRESS", "CVF"),
)
MRREL = RrfLayout(
    "MRREL",
    "Related Concepts",
    ("CUI1", "AUI1", "STYPE1", "REL", "CUI2", "AUI2", "STYPE2", "RELA", "RUI", "SRUI", "SAB", "SL", "RG",
     "DIR", "SUPPRESS", "CVF"),
)
MRSTY = RrfLayout("MRSTY", "Semantic Types", ("CUI", "TUI", "STN", "STY", "ATUI", "CVF"))
MRDEF = RrfLayout("MRDEF", "Definitions", ("CUI", "AUI", "ATUI", "SATUI", "SAB", "DEF", "SUPPRESS", "CVF"))
MRSAB = RrfLayout(
    "MRSAB",
    "Source Metadata",
    ("VCUI", "RCUI", "VSAB", "RSAB", "SON", "SF", "SVER", "VSTART", "VEND", "IMETA", "RMETA", "SLC", "SCC",
     "SRL", "TFR", "CFR", "CXTY", "TTYL", "ATNL", "LAT", "CENC", "CURVER", "SABIN", "SSN", "SCIT"),
)
# MRFILES describes the others; written by the sample builder, not ingested.
MRFILES = RrfLayout("MRFILES", "Relation Relation", ("FIL", "DES", "FMT", "CLS", "RWS", "BTS"), required=False)

INGESTED: tuple[RrfLayout, ...] = (MRCONSO, MRREL, MRSTY, MRDEF, MRSAB)
LAYOUTS: dict[str, RrfLayout] = {layout.name: layout for layout in (*INGESTED, MRFILES)}

# Integer-valued columns; everything else is text. SRL is a license level 0-9.
INTEGER_COLUMNS: dict[str, frozenset[str]] = {
    "MRCONSO": frozenset({"SRL", "CVF"}),
    "MRREL": frozenset({"CVF"}),
    "MRSTY": frozenset({"CVF"}),
    "MRDEF": frozenset({"CVF"}),
    "MRSAB": frozenset({"SRL", "TFR", "CFR"}),
}

# Identifier formats from the reference manual: C/L/S + 7 digits; AUIs grew past
# 7 digits (A + 7 or 8); TUIs are T + 3 digits.
CUI_PATTERN = re.compile(r"^C\d{7}$")
AUI_PATTERN = re.compile(r"^A\d{7,8}$")
TUI_PATTERN = re.compile(r"^T\d{3}$")


def layout(name: str) -> RrfLayout:
    """The layout of a META file by name (`MRREL`, `mrrel` or `MRREL.RRF`)."""
    key = name.upper().removesuffix(".RRF")
    try:
        return LAYOUTS[key]
    except KeyError:
        raise KeyError(f"unknown RRF file {name!r}; known: {', '.join(sorted(LAYOUTS))}") from None
