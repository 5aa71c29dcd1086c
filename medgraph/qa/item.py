"""The question every evaluation, method and training loop speaks, whatever its source: `QaItem`.

MIRAGE's own files (`medgraph.qa.mirage`), the KG questions of `medgraph.qa.generate` (with their gold paths,
pairs and facts in `extra`), PubMedQA or JSONL (`medgraph.qa.benchmarks`) all become QaItems. The accessors
below read the fields a KG-derived item carries in `extra` and return None for items without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class QaItem:
    """One benchmark question from a MIRAGE-format file (ours or MIRAGE's own)."""

    dataset: str
    qid: str
    question: str
    options: dict[str, str]  # {} for a short-answer question
    answer: str  # an option letter, or the answer text for a short-answer question
    acceptable_answers: tuple[str, ...] = ()
    pmids: tuple[str, ...] = ()
    extra: dict[str, object] = field(default_factory=dict)  # any other field of the entry

    @property
    def is_multiple_choice(self) -> bool:
        return bool(self.options)

    @property
    def answer_text(self) -> str:
        return self.options.get(self.answer, self.answer)

    @property
    def gold_answers(self) -> tuple[str, ...]:
        """The strings a free-text answer is scored against."""
        return self.acceptable_answers or (self.answer_text,)


# What a method may read of a question beyond its text, options and benchmark: the concepts the question and
# its options name (what entity linking of the question would give). Everything else in `extra` (gold paths
# and facts, hop counts, question types, answer concepts, gold documents) is derived from the answer, and the
# answer itself, its acceptable forms and the source PMIDs are for scoring only.
ASKED_FIELDS = ("seed_cuis", "option_cuis")


def as_asked(item: QaItem) -> QaItem:
    """The item as a user would ask it: no answer, no acceptable answers, no PMIDs, and of `extra` only
    `ASKED_FIELDS`. Methods answer this; scoring reads the item itself."""
    return QaItem(dataset=item.dataset, qid=item.qid, question=item.question, options=dict(item.options), answer="",
                  extra={key: item.extra[key] for key in ASKED_FIELDS if key in item.extra})


def gold_edge_ids(item: QaItem) -> tuple[str, ...] | None:
    """Edge ids of the item's gold path when known (KG-derived items carry `gold_path`)."""
    value = item.extra.get("gold_path") or item.extra.get("gold_edge_ids")
    return tuple(str(v) for v in value) if value else None


def gold_pairs(item: QaItem) -> tuple[frozenset[str], ...] | None:
    """The unordered concept pairs of the item's gold path (KG-derived items carry `gold_pairs`); None when
    the item carries none (MIRAGE, PubMedQA, or a "no" question, whose fact is absent by design)."""
    value = item.extra.get("gold_pairs")
    pairs = tuple(frozenset(str(c) for c in pair) for pair in value or () if len(pair) == 2)
    return pairs or None


def gold_facts(item: QaItem) -> tuple[frozenset[str], ...] | None:
    """Each gold edge of the item as the keys "src|relation|dst" that state it (the edge and its inverse
    listing; KG-derived items carry `gold_facts`); None when the item has none."""
    value = item.extra.get("gold_facts")
    facts = tuple(frozenset(str(key) for key in keys) for keys in value or () if keys)
    return facts or None


def answer_cuis(item: QaItem) -> tuple[str, ...] | None:
    """The concepts of the correct answer (KG-derived items), or None when unknown or empty."""
    value = item.extra.get("answer_cuis")
    return tuple(str(c) for c in value) if value else None


def gold_doc_ids(item: QaItem) -> tuple[str, ...] | None:
    """The corpus documents that hold the item's evidence (PubMedQA: its own abstract, `pubmed:<PMID>`),
    or None when the item names none."""
    value = item.extra.get("gold_doc_ids")
    return tuple(str(d) for d in value) if value else None
