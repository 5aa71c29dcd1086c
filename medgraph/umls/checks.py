"""Data-quality checks on the ingested UMLS tables (run as Dagster asset checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from medgraph.storage import Warehouse
from medgraph.umls.schema import AUI_PATTERN, CUI_PATTERN, SCHEMA, TUI_PATTERN, RrfLayout

# Identifier columns and the pattern each must match (empty fields allowed:
# e.g. MRREL.AUI1 is empty for concept-level relations).
IDENTIFIER_COLUMNS: dict[str, dict[str, str]] = {
    "MRCONSO": {"CUI": CUI_PATTERN.pattern, "AUI": AUI_PATTERN.pattern},
    "MRREL": {"CUI1": CUI_PATTERN.pattern, "CUI2": CUI_PATTERN.pattern,
              "AUI1": AUI_PATTERN.pattern, "AUI2": AUI_PATTERN.pattern},
    "MRSTY": {"CUI": CUI_PATTERN.pattern, "TUI": TUI_PATTERN.pattern},
    "MRDEF": {"CUI": CUI_PATTERN.pattern, "AUI": AUI_PATTERN.pattern},
    "MRSAB": {"VCUI": CUI_PATTERN.pattern, "RCUI": CUI_PATTERN.pattern},
}


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, object] = field(default_factory=dict)


def _table(layout: RrfLayout) -> str:
    return f"{SCHEMA}.{layout.table}"


def check_columns(warehouse: Warehouse, layout: RrfLayout) -> CheckOutcome:
    """The table has exactly the layout's columns, in order."""
    with warehouse.connect(read_only=True) as con:
        return columns_outcome(con, layout, _table(layout))


def columns_outcome(con: duckdb.DuckDBPyConnection, layout: RrfLayout, relation: str) -> CheckOutcome:
    """`check_columns` on any relation (a table, or `read_parquet(...)` of a staged file)."""
    columns = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()]
    expected = list(layout.columns)
    return CheckOutcome(
        columns == expected,
        f"{len(columns)} columns, expected {len(expected)}",
        {"columns": len(columns), "expected_columns": len(expected),
         "missing": ", ".join(sorted(set(expected) - set(columns))) or "none",
         "unexpected": ", ".join(sorted(set(columns) - set(expected))) or "none"},
    )


def check_identifier_formats(warehouse: Warehouse, layout: RrfLayout) -> CheckOutcome:
    """Every non-empty identifier matches its UMLS format (C0000000, A00000000, T000)."""
    with warehouse.connect(read_only=True) as con:
        return identifiers_outcome(con, layout, _table(layout))


def identifiers_outcome(con: duckdb.DuckDBPyConnection, layout: RrfLayout, relation: str) -> CheckOutcome:
    """`check_identifier_formats` on any relation."""
    patterns = IDENTIFIER_COLUMNS.get(layout.name, {})
    if not patterns:
        return CheckOutcome(True, "no identifier columns")
    counts = ", ".join(
        f"count(*) FILTER (WHERE {col} IS NOT NULL AND NOT regexp_full_match({col}, '{pattern}'))"
        for col, pattern in patterns.items()
    )
    bad = con.execute(f"SELECT {counts} FROM {relation}").fetchone()
    examples = {}
    for (col, pattern), n in zip(patterns.items(), bad):
        if n:
            examples[f"example_bad_{col}"] = con.execute(
                f"SELECT {col} FROM {relation} WHERE {col} IS NOT NULL "
                f"AND NOT regexp_full_match({col}, '{pattern}') LIMIT 1"
            ).fetchone()[0]
    metadata: dict[str, object] = {f"bad_{col}": n for col, n in zip(patterns, bad)}
    metadata.update(examples)
    total = sum(bad)
    return CheckOutcome(total == 0, f"{total} malformed identifiers", metadata)


def check_not_empty(warehouse: Warehouse, layout: RrfLayout) -> CheckOutcome:
    rows = warehouse.count(_table(layout))
    return CheckOutcome(rows > 0, f"{rows} rows", {"rows": rows})


def staged_outcomes(con: duckdb.DuckDBPyConnection, layout: RrfLayout, relation: str) -> dict[str, CheckOutcome]:
    """The blocking checks (columns_match_layout, identifiers_well_formed, not_empty) on staged rows, so that
    ingestion can refuse to publish what the asset checks would fail afterwards."""
    rows = con.execute(f"SELECT count(*) FROM {relation}").fetchone()[0]
    return {"columns_match_layout": columns_outcome(con, layout, relation),
            "identifiers_well_formed": identifiers_outcome(con, layout, relation),
            "not_empty": CheckOutcome(rows > 0, f"{rows} rows", {"rows": rows})}


def check_relation_orphans(warehouse: Warehouse) -> CheckOutcome:
    """Every CUI in MRREL has a name in MRCONSO; orphans are counted (filters create some)."""
    with warehouse.connect(read_only=True) as con:
        orphans, rows = con.execute(
            """
            WITH rel_cuis AS (SELECT CUI1 AS cui FROM umls.mrrel UNION SELECT CUI2 FROM umls.mrrel)
            SELECT count(*) FILTER (WHERE c.CUI IS NULL), count(*)
            FROM rel_cuis r LEFT JOIN (SELECT DISTINCT CUI FROM umls.mrconso) c ON r.cui = c.CUI
            """
        ).fetchone()
    return CheckOutcome(orphans == 0, f"{orphans} of {rows} MRREL concepts have no MRCONSO atom",
                        {"orphan_cuis": orphans, "mrrel_cuis": rows})
