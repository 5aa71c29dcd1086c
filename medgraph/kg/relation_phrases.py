"""English for the relations of the knowledge graph: how a question asks about an edge.

Relation names are data (UMLS RELA labels, or the label of a bare REL such as CHD/PAR).
`RELATION_PHRASES` words the relations we know (those of the sample release and a few common
RELAs of a real release); any other relation gets a generic phrasing built from its name
(`relation_phrases`). `UNINFORMATIVE_RELATIONS` are those that say too little to ask about.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RelationPhrases:
    """English for an edge `subject -relation-> object`; `{subject}`/`{object}` are concept names.

    `via` names the objects as a noun phrase so that a second hop can be asked
    about them ("a drug that may treat X"); `clause` is a predicate about the
    subject, so that two constraints can be joined ("may be treated with X").
    """

    mc: str  # asks for the object: "Which of the following may treat {subject}?"
    short: str  # asks for the object, open-ended; never starts with {subject}
    yesno: str  # asks whether the edge holds
    via: str
    clause: str
    described: str = ""  # `short` for a subject that is a description, not a name ("the gene {subject}")

    def short_about(self, subject: str, described: bool = False) -> str:
        return self.form("described" if described else "short").format(subject=subject)

    def form(self, name: str) -> str:
        """One phrase by field name; "described" falls back to `short`."""
        return (self.described or self.short) if name == "described" else getattr(self, name)


def _phrases(mc: str, short: str, yesno: str, via: str, clause: str, described: str = "") -> RelationPhrases:
    return RelationPhrases(mc, short, yesno, via, clause, described)


RELATION_PHRASES: dict[str, RelationPhrases] = {
    # Hierarchy: `isa` is a RELA; child_of/parent_of are the labels of a bare CHD/PAR.
    "isa": _phrases("{subject} is a kind of which of the following?", "What is {subject} a kind of?",
                    "Is {subject} a kind of {object}?", "a broader category of {subject}", "is a kind of {object}",
                    described="What broader category does {subject} belong to?"),
    "inverse_isa": _phrases("Which of the following is a kind of {subject}?", "What is a specific kind of {subject}?",
                            "Is {object} a kind of {subject}?", "a specific kind of {subject}",
                            "has {object} as a specific kind"),
    "has_manifestation": _phrases(
        "Which of the following is a manifestation of {subject}?", "What is a manifestation of {subject}?",
        "Is {object} a manifestation of {subject}?", "a manifestation of {subject}",
        "has {object} as a manifestation"),
    "manifestation_of": _phrases(
        "{subject} is a manifestation of which of the following?",
        "What condition has {subject} as a manifestation?", "Is {subject} a manifestation of {object}?",
        "a condition with {subject} as a manifestation", "is a manifestation of {object}"),
    "gene_associated_with_disease": _phrases(
        "Which of the following is associated with the gene {subject}?",
        "Which disease is associated with the gene {subject}?", "Is the gene {subject} associated with {object}?",
        "a disease associated with the gene {subject}", "is a gene associated with {object}",
        described="Which disease is associated with {subject}?"),
    "disease_has_associated_gene": _phrases(
        "Which of the following genes is associated with {subject}?", "Which gene is associated with {subject}?",
        "Is the gene {object} associated with {subject}?", "a gene associated with {subject}",
        "is associated with the gene {object}"),
    "gene_associated_with_phenotype": _phrases(
        "Which of the following is associated with the gene {subject}?",
        "Which phenotype is associated with the gene {subject}?", "Is the gene {subject} associated with {object}?",
        "a phenotype associated with the gene {subject}", "is a gene associated with {object}",
        described="Which phenotype is associated with {subject}?"),
    "phenotype_has_associated_gene": _phrases(
        "Which of the following genes is associated with {subject}?", "Which gene is associated with {subject}?",
        "Is the gene {object} associated with {subject}?", "a gene associated with {subject}",
        "is associated with the gene {object}"),
    "may_treat": _phrases(
        "Which of the following may be treated with {subject}?", "What condition may {subject} treat?",
        "May {subject} be used to treat {object}?", "a condition that {subject} may treat", "may treat {object}"),
    "may_be_treated_by": _phrases(
        "Which of the following may treat {subject}?", "Which drug may treat {subject}?",
        "May {object} be used to treat {subject}?", "a drug that may treat {subject}",
        "may be treated with {object}"),
    "may_prevent": _phrases(
        "Which of the following may be prevented with {subject}?", "What condition may {subject} prevent?",
        "May {subject} be used to prevent {object}?", "a condition that {subject} may prevent",
        "may prevent {object}"),
    "may_be_prevented_by": _phrases(
        "Which of the following may prevent {subject}?", "Which drug may prevent {subject}?",
        "May {object} be used to prevent {subject}?", "a drug that may prevent {subject}",
        "may be prevented with {object}"),
    "has_mechanism_of_action": _phrases(
        "Which of the following is the mechanism of action of {subject}?",
        "What is the mechanism of action of {subject}?", "Is {object} a mechanism of action of {subject}?",
        "the mechanism of action of {subject}", "has the mechanism of action {object}"),
    "mechanism_of_action_of": _phrases(
        "Which of the following has the mechanism of action {subject}?",
        "Which drug has the mechanism of action {subject}?", "Does {object} have the mechanism of action {subject}?",
        "a drug with the mechanism of action {subject}", "is the mechanism of action of {object}"),
    "contraindicated_with_disease": _phrases(
        "In which of the following is {subject} contraindicated?", "In which condition is {subject} contraindicated?",
        "Is {subject} contraindicated in {object}?", "a condition in which {subject} is contraindicated",
        "is contraindicated in {object}"),
    "has_contraindicated_drug": _phrases(
        "Which of the following is contraindicated in {subject}?", "Which drug is contraindicated in {subject}?",
        "Is {object} contraindicated in {subject}?", "a drug contraindicated in {subject}",
        "is a condition in which {object} is contraindicated"),
    # Common RELAs of a real release.
    "has_finding_site": _phrases(
        "Which of the following is the finding site of {subject}?", "What is the finding site of {subject}?",
        "Is {object} the finding site of {subject}?", "the finding site of {subject}",
        "has the finding site {object}"),
    "finding_site_of": _phrases(
        "Which of the following has {subject} as its finding site?",
        "What condition has {subject} as its finding site?", "Is {subject} the finding site of {object}?",
        "a condition with {subject} as its finding site", "is the finding site of {object}"),
    "has_causative_agent": _phrases(
        "Which of the following is a causative agent of {subject}?", "What is a causative agent of {subject}?",
        "Is {object} a causative agent of {subject}?", "a causative agent of {subject}",
        "has the causative agent {object}"),
    "causative_agent_of": _phrases(
        "Which of the following is caused by {subject}?", "What is caused by {subject}?",
        "Is {subject} a causative agent of {object}?", "a condition caused by {subject}",
        "is a causative agent of {object}"),
}
for _child, _parent in (("child_of", "isa"), ("parent_of", "inverse_isa")):
    RELATION_PHRASES[_child] = RELATION_PHRASES[_parent]

# Relations that say too little to ask about (labels of the coarse RELs without a RELA).
UNINFORMATIVE_RELATIONS = frozenset({
    "related_to", "sibling_of", "possibly_synonymous_with", "related_unspecified", "not_related", "deleted",
    "allowed_qualifier_of", "can_be_qualified_by", "synonym_of", "similar_to",
})


def relation_phrases(relation: str) -> RelationPhrases:
    """The phrasing of a known relation, else a generic one built from its name."""
    known = RELATION_PHRASES.get(relation)
    if known is not None:
        return known
    words = relation.replace("_", " ").strip().replace("{", "{{").replace("}", "}}")
    return _phrases(
        f'Which of the following completes the statement "{{subject}} {words} ___"?',
        f'What completes the statement "{{subject}} {words} ___"?',
        f"Is it true that {{subject}} {words} {{object}}?",
        f"what {{subject}} {words}",
        f"{words} {{object}}",
    )
