"""RRF ingestion: exact filtering, malformed input, atomic replacement, file forms."""

from __future__ import annotations

import gzip
import re
import shutil
from pathlib import Path

import pytest
from conftest import replace_line

from medgraph.storage import Warehouse
from medgraph.umls.filters import IngestFilters
from medgraph.umls.ingest import RrfFormatError, ingest_rrf_file
from medgraph.umls.release import MissingRrfFileError, release_fingerprint
from medgraph.umls.schema import INGESTED, MRCONSO, MRDEF, MRREL, MRSAB, MRSTY


def read_rrf(path: Path, layout) -> list[dict[str, str]]:
    """A deliberately naive reference reader: split each line on `|`."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("|")
        assert len(fields) == len(layout.columns) + 1 and fields[-1] == ""
        rows.append(dict(zip(layout.columns, fields[:-1])))
    return rows


def sab_srl(release: Path) -> dict[str, int]:
    return {row["RSAB"]: int(row["SRL"]) for row in read_rrf(release / "MRSAB.RRF", MRSAB)}


def test_tables_hold_exactly_the_rows_that_pass_the_filters(release_copy: Path, warehouse: Warehouse):
    filters = IngestFilters(languages=("ENG",), excluded_suppress=("O", "E", "Y"), max_srl=3)
    srl = sab_srl(release_copy)
    expected = {
        MRCONSO: [r for r in read_rrf(release_copy / "MRCONSO.RRF", MRCONSO)
                  if r["LAT"] == "ENG" and r["SUPPRESS"] not in "OEY" and int(r["SRL"]) <= 3],
        MRREL: [r for r in read_rrf(release_copy / "MRREL.RRF", MRREL)
                if r["SUPPRESS"] not in ("O", "E", "Y") and srl[r["SAB"]] <= 3],
        MRSTY: read_rrf(release_copy / "MRSTY.RRF", MRSTY),
    }
    for layout, rows in expected.items():
        stats = ingest_rrf_file(release_copy, layout, warehouse, filters)
        assert stats.rows_out == len(rows) > 0
        with warehouse.connect(read_only=True) as con:
            key = "AUI" if layout is MRCONSO else ("RUI" if layout is MRREL else "ATUI")
            got = sorted(r[0] for r in con.execute(f"SELECT {key} FROM umls.{layout.table}").fetchall())
        assert got == sorted(r[key] for r in rows)


def test_metadata_counts_rows_kept_after_each_filter(release_copy: Path, warehouse: Warehouse):
    rows = read_rrf(release_copy / "MRCONSO.RRF", MRCONSO)
    stats = ingest_rrf_file(release_copy, MRCONSO, warehouse, IngestFilters(sabs=("MSH", "HPO")))
    english = [r for r in rows if r["LAT"] == "ENG"]
    unsuppressed = [r for r in english if r["SUPPRESS"] not in "OEY"]
    assert stats.rows_in == len(rows)
    assert stats.kept_after == {
        "language": len(english),
        "suppress": len(unsuppressed),
        "sab": len([r for r in unsuppressed if r["SAB"] in ("MSH", "HPO")]),
    }
    metadata = stats.as_metadata()
    assert metadata["rows_kept_after_sab"] == stats.rows_out
    assert metadata["bytes_in"] == (release_copy / "MRCONSO.RRF").stat().st_size


def test_row_with_missing_field_names_file_line_and_counts_and_keeps_old_table(
    release_copy: Path, warehouse: Warehouse
):
    ingest_rrf_file(release_copy, MRREL, warehouse)
    before = warehouse.count("umls.mrrel")
    parquet_before = (warehouse.lake.table_path("umls", "mrrel")).read_bytes()
    path = release_copy / "MRREL.RRF"
    line7 = path.read_text().splitlines()[6]
    replace_line(path, 7, line7.rsplit("|", 2)[0] + "|")  # drop one field
    with pytest.raises(RrfFormatError, match=r"MRREL\.RRF:7: expected 16 fields, found 15"):
        ingest_rrf_file(release_copy, MRREL, warehouse)
    assert warehouse.count("umls.mrrel") == before
    assert warehouse.lake.table_path("umls", "mrrel").read_bytes() == parquet_before
    assert not list(warehouse.lake.root.glob("umls/.*.tmp.parquet")), "staging files must be cleaned up"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda line: line + "extra|", r"MRSTY\.RRF:3: expected 6 fields, found 7"),
        (lambda line: line + "extra|more|", r"MRSTY\.RRF:3: expected 6 fields, found 8"),
        (lambda line: line[:-1], r"MRSTY\.RRF:3: expected 6 fields, found 6 \(the row does not end with '\|'\)"),
        (lambda line: line + "extra", r"MRSTY\.RRF:3: expected 6 fields, found 7 \(the row does not end with '\|'\)"),
    ],
    ids=["one-extra-field", "two-extra-fields", "no-trailing-bar", "extra-unterminated"],
)
def test_malformed_rows_are_reported_with_their_line(release_copy: Path, warehouse: Warehouse, mutate, message):
    path = release_copy / "MRSTY.RRF"
    replace_line(path, 3, mutate(path.read_text().splitlines()[2]))
    with pytest.raises(RrfFormatError, match=message):
        ingest_rrf_file(release_copy, MRSTY, warehouse)
    assert not warehouse.exists("umls", "mrsty")


def test_non_integer_in_typed_column_is_rejected(release_copy: Path, warehouse: Warehouse):
    path = release_copy / "MRCONSO.RRF"
    fields = path.read_text().splitlines()[4].split("|")
    fields[MRCONSO.columns.index("SRL")] = "high"
    replace_line(path, 5, "|".join(fields))
    with pytest.raises(RrfFormatError, match=r"MRCONSO\.RRF:5: column SRL"):
        ingest_rrf_file(release_copy, MRCONSO, warehouse)


def test_quarantine_keeps_good_rows_and_lists_bad_ones(release_copy: Path, warehouse: Warehouse):
    path = release_copy / "MRDEF.RRF"
    total = len(path.read_text().splitlines())
    replace_line(path, 2, "C0000001|broken|")
    replace_line(path, 9, path.read_text().splitlines()[8] + "surplus|")
    stats = ingest_rrf_file(release_copy, MRDEF, warehouse, IngestFilters(excluded_suppress=()), quarantine=True)
    assert stats.rejected == 2
    assert stats.rows_in == total
    assert warehouse.count("umls.mrdef") == total - 2
    with warehouse.connect(read_only=True) as con:
        rejects = con.execute("SELECT line, error FROM umls.mrdef_rejects ORDER BY line").fetchall()
    assert rejects == [(2, "expected 8 fields, found 2"), (9, "expected 8 fields, found 9")]


def test_missing_required_file_is_named(release_copy: Path, warehouse: Warehouse):
    (release_copy / "MRSTY.RRF").unlink()
    with pytest.raises(MissingRrfFileError, match=r"MRSTY\.RRF is missing"):
        ingest_rrf_file(release_copy, MRSTY, warehouse)


def test_gzip_and_split_parts_read_like_the_plain_file(release_copy: Path, tmp_path: Path, warehouse: Warehouse):
    plain = ingest_rrf_file(release_copy, MRREL, warehouse).rows_out
    lines = (release_copy / "MRREL.RRF").read_bytes().splitlines(keepends=True)

    gz_release = Path(shutil.copytree(release_copy, tmp_path / "gz"))
    (gz_release / "MRREL.RRF").unlink()
    with gzip.open(gz_release / "MRREL.RRF.gz", "wb") as handle:
        handle.writelines(lines)
    assert ingest_rrf_file(gz_release, MRREL, warehouse).rows_out == plain

    split_release = Path(shutil.copytree(release_copy, tmp_path / "split"))
    (split_release / "MRREL.RRF").unlink()
    third = len(lines) // 3
    for suffix, chunk in zip(("aa", "ab", "ac"), (lines[:third], lines[third:2 * third], lines[2 * third:])):
        (split_release / f"MRREL.RRF.{suffix}").write_bytes(b"".join(chunk))
    assert ingest_rrf_file(split_release, MRREL, warehouse).rows_out == plain


def test_bad_row_in_a_split_part_names_that_part(release_copy: Path, warehouse: Warehouse):
    lines = (release_copy / "MRSTY.RRF").read_text().splitlines(keepends=True)
    (release_copy / "MRSTY.RRF").unlink()
    (release_copy / "MRSTY.RRF.aa").write_text("".join(lines[:100]))
    lines[104] = "C0000104|T047|\n"
    (release_copy / "MRSTY.RRF.ab").write_text("".join(lines[100:]))
    with pytest.raises(RrfFormatError, match=r"MRSTY\.RRF\.ab:5: expected 6 fields, found 2"):
        ingest_rrf_file(release_copy, MRSTY, warehouse)


def test_srl_filter_uses_mrsab_levels_for_files_without_srl(release_copy: Path, warehouse: Warehouse):
    srl = sab_srl(release_copy)
    restricted = {sab for sab, level in srl.items() if level > 0}
    ingest_rrf_file(release_copy, MRREL, warehouse, IngestFilters(max_srl=0, excluded_suppress=()))
    with warehouse.connect(read_only=True) as con:
        sabs = {r[0] for r in con.execute("SELECT DISTINCT SAB FROM umls.mrrel").fetchall()}
    assert sabs and not sabs & restricted


def test_real_nlm_rows_parse_with_their_values(umls_fixtures: Path, warehouse: Warehouse):
    no_filters = IngestFilters(languages=None, excluded_suppress=())
    # An excerpt: its MRFILES.RRF is the full release's, so the counts are not compared.
    assert ingest_rrf_file(umls_fixtures, MRCONSO, warehouse, no_filters, check_mrfiles=False).rows_out == 3
    assert ingest_rrf_file(umls_fixtures, MRSTY, warehouse, no_filters, check_mrfiles=False).rows_out == 3
    assert ingest_rrf_file(umls_fixtures, MRDEF, warehouse, no_filters, check_mrfiles=False).rows_out == 1
    with warehouse.connect(read_only=True) as con:
        assert con.execute("SELECT STR, SRL, CVF FROM umls.mrconso WHERE AUI = 'A26634265'").fetchone() == (
            "(131)I-Macroaggregated Albumin", 0, 256)
        assert con.execute("SELECT DEF FROM umls.mrdef").fetchone()[0].startswith("Synthetic phospholipid")
        assert con.execute("SELECT count(*) FROM umls.mrsty WHERE CUI = 'C0000039'").fetchone()[0] == 2


def test_fingerprint_ignores_copies_and_sees_content_changes(release_copy: Path, tmp_path: Path):
    before = release_fingerprint(release_copy)
    copy = Path(shutil.copytree(release_copy, tmp_path / "copy"))
    assert release_fingerprint(copy) == before
    path = copy / "MRDEF.RRF"
    text = path.read_text()
    assert " tissue" in text
    path.write_text(text.replace(" tissue", " Tissue", 1))  # same size, new content
    assert release_fingerprint(copy) != before


def test_synthetic_names_are_distinct_words_of_umls_length(synthetic_release: Path):
    """Questions, prompts and entity linking at scale need names that read like a release's (issue 27): words,
    ~30 characters, each concept's preferred name its own."""
    atoms = read_rrf(synthetic_release / "MRCONSO.RRF", MRCONSO)
    names = [atom["STR"] for atom in atoms]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z-]+ [a-z]+ [a-z]+ [A-Za-z0-9 ]+", name) for name in names)
    lengths = sorted(map(len, names))
    assert 25 <= lengths[len(lengths) // 2] <= 45
    preferred = {atom["CUI"] for atom in atoms if atom["TS"] == "P"}
    assert len(preferred) == len({atom["CUI"] for atom in atoms})  # every concept has a preferred name
    definitions = [row["DEF"] for row in read_rrf(synthetic_release / "MRDEF.RRF", MRDEF)]
    assert definitions and all(text.startswith("A ") and text.endswith(".") for text in definitions)


def test_every_ingested_layout_materializes_from_the_synthetic_release(release_copy: Path, warehouse: Warehouse):
    for layout in INGESTED:
        assert ingest_rrf_file(release_copy, layout, warehouse).rows_out > 0
        assert warehouse.exists("umls", layout.table)


def test_staging_publishes_nothing_and_records_the_rrf_fingerprint(release_copy: Path, warehouse: Warehouse):
    """`stage_rrf_file` leaves the view and the lake's tables alone; the staged Parquet says which RRF content it
    came from (what a one-table publish compares against the release), and `ingest_rrf_file` = stage + publish
    removes the table's files of an earlier release publish."""
    import duckdb

    from medgraph.umls.ingest import RRF_FINGERPRINT_KEY, publish_table, stage_rrf_file
    from medgraph.umls.publish import publish_release

    first = ingest_rrf_file(release_copy, MRSTY, warehouse)
    before = warehouse.count("umls.mrsty")
    (release_copy / "MRSTY.RRF").write_text("".join((release_copy / "MRSTY.RRF").read_text().splitlines(True)[1:]))
    staged = stage_rrf_file(release_copy, MRSTY, warehouse)
    assert staged.stats.rows_in == first.rows_in - 1
    assert warehouse.count("umls.mrsty") == before  # staged, not published
    with duckdb.connect() as con:
        recorded = con.execute(f"SELECT decode(value) FROM parquet_kv_metadata('{staged.staging}') "
                               f"WHERE decode(key) = '{RRF_FINGERPRINT_KEY}'").fetchone()[0]
    assert recorded == staged.rrf_fingerprint == release_fingerprint(release_copy, (MRSTY,))
    assert all(outcome.passed for outcome in staged.checks.values())

    versioned = publish_release(warehouse, [staged])[0].parquet_path
    assert Path(versioned).name.startswith("mrsty.") and Path(versioned).name != "mrsty.parquet"
    assert warehouse.count("umls.mrsty") == staged.stats.rows_out
    assert not (warehouse.lake.root / "umls" / "mrsty.parquet").exists()  # superseded, deleted after the commit
    publish_table(warehouse, stage_rrf_file(release_copy, MRSTY, warehouse))
    assert sorted(p.name for p in (warehouse.lake.root / "umls").iterdir()) == ["mrsty.parquet"]
