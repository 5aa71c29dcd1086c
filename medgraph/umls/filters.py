"""Row filters applied while ingesting a release (what MetamorphoSys would subset)."""

from __future__ import annotations

from dataclasses import dataclass, field

from medgraph.umls.schema import RrfLayout


def _sql_list(values: tuple[str, ...]) -> str:
    return "(" + ", ".join("'" + v.replace("'", "''") + "'" for v in values) + ")"


@dataclass(frozen=True)
class IngestFilters:
    """Which rows of a release to keep.

    - `languages`: MRCONSO.LAT values to keep; None keeps all.
    - `excluded_suppress`: SUPPRESS flags to drop (O obsolete, E editor-suppressed,
      Y suppressible); the MetamorphoSys default drops all three.
    - `sabs`: source-vocabulary allow-list (SAB; RSAB in MRSAB); None keeps all.
    - `max_srl`: highest source restriction level kept (0 = no additional
      restrictions ... 4; 9 = SNOMED CT affiliate terms); None keeps all.
      Files without an SRL column take their source's SRL from MRSAB.
    """

    languages: tuple[str, ...] | None = ("ENG",)
    excluded_suppress: tuple[str, ...] = ("O", "E", "Y")
    sabs: tuple[str, ...] | None = None
    max_srl: int | None = None
    # SABs whose MRSAB SRL exceeds max_srl; resolved from the release by the ingester.
    restricted_sabs: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name, hint in (("languages", 'MRCONSO.LAT value, e.g. ["ENG"]'), ("sabs", 'source (SAB), e.g. ["HPO"]')):
            values = getattr(self, name)
            if values is not None and (not values or not all(isinstance(v, str) and v.strip() for v in values)):
                raise ValueError(f"ingest filter {name}={list(values)!r} keeps nothing: give at least one {hint}, "
                                 f"or null to keep every {name[:-1]}")
        if self.max_srl is not None and not 0 <= self.max_srl <= 9:
            raise ValueError(f"ingest filter max_srl={self.max_srl!r}: a source restriction level is 0-9 (or null)")

    def predicates(self, layout: RrfLayout) -> list[tuple[str, str]]:
        """(filter name, SQL condition a kept row satisfies), in the order applied.

        Conditions treat an empty (NULL) field as passing, except where a value
        is required to decide (a language or SAB allow-list).
        """
        columns = set(layout.columns)
        sab_column = "RSAB" if layout.name == "MRSAB" else "SAB"
        kept: list[tuple[str, str]] = []
        if self.languages is not None and "LAT" in columns and layout.name != "MRSAB":
            kept.append(("language", f"LAT IN {_sql_list(self.languages)}"))
        if self.excluded_suppress and "SUPPRESS" in columns:
            kept.append(("suppress", f"coalesce(SUPPRESS, '') NOT IN {_sql_list(self.excluded_suppress)}"))
        if self.sabs is not None and sab_column in columns:
            kept.append(("sab", f"{sab_column} IN {_sql_list(self.sabs)}"))
        if self.max_srl is not None:
            if "SRL" in columns:
                kept.append(("srl", f"coalesce(SRL, 0) <= {int(self.max_srl)}"))
            elif sab_column in columns and self.restricted_sabs:
                kept.append(("srl", f"{sab_column} NOT IN {_sql_list(self.restricted_sabs)}"))
        return kept

    def as_metadata(self) -> dict[str, str]:
        return {
            "languages": ",".join(self.languages) if self.languages is not None else "all",
            "excluded_suppress": ",".join(self.excluded_suppress) or "none",
            "sabs": ",".join(self.sabs) if self.sabs is not None else "all",
            "max_srl": "none" if self.max_srl is None else str(self.max_srl),
        }
