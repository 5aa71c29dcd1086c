"""Graph-R1 over the chunk-entity hypergraph: search, traverse and analyze reach text chunks.

The tiny KG with a hand-built text side: four chunks written here, their
concept mentions and chunk links inserted by hand (not by the matcher), so
each expectation follows from the rows below. The KG's own edges stay.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import copy_warehouse

from medgraph.eval.evaluate import method_statistics
from medgraph.llm.base import Conversation
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods import KnowledgeTools, make_config, run_method
from medgraph.methods.graph_r1 import GraphR1Config, GraphR1Env
from medgraph.qa.item import QaItem
from medgraph.retrieval import Retriever
from medgraph.rl.sft import expert_demonstrations
from medgraph.storage import Warehouse

AMLODIPINE, HYPERTENSION, SEIZURE, FABRY = "C9001289", "C0020538", "C0036572", "C9001444"
OPTIONS = {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}

TRIAL = ("c_trial", "Amlodipine trial",
         ("Amlodipine lowered blood pressure in adults with hypertension over twelve weeks; "
          "ankle swelling was the commonest adverse effect."))
GUIDE = ("c_guide", "Hypertension guideline",
         "Hypertension is diagnosed after repeated office readings and treated with lifestyle change first.")
# Names hypertension at once and amlodipine only after 2,000 characters: a capped read misses the pair.
LONG = ("c_long", "Hypertension review", "Hypertension is common. " + "Blood pressure rises with age. " * 70
        + "Amlodipine is one option among several.")
FABRY_CASE = ("c_fabry", "Fabry case report", "A man with Fabry disease presented with a first seizure.")
CHUNKS = (TRIAL, GUIDE, LONG, FABRY_CASE)
MENTIONS = ((TRIAL, AMLODIPINE, "Amlodipine"), (TRIAL, HYPERTENSION, "hypertension"),
            (GUIDE, HYPERTENSION, "Hypertension"), (LONG, HYPERTENSION, "Hypertension"),
            (LONG, AMLODIPINE, "Amlodipine"), (FABRY_CASE, FABRY, "Fabry disease"), (FABRY_CASE, SEIZURE, "seizure"))
LINKS = (("c_long", "c_trial", [AMLODIPINE, HYPERTENSION], 2.0), ("c_guide", "c_trial", [HYPERTENSION], 1.0),
         ("c_guide", "c_long", [HYPERTENSION], 1.0))

TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?", OPTIONS, "A",
               extra={"gold_pairs": [sorted([AMLODIPINE, HYPERTENSION])], "answer_cuis": [AMLODIPINE],
                      "gold_facts": [[f"{HYPERTENSION}|may_be_treated_by|{AMLODIPINE}",
                                      f"{AMLODIPINE}|may_treat|{HYPERTENSION}"]],
                      "seed_cuis": [HYPERTENSION]})

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hypergraph(retrieval_warehouse: Warehouse, encoder, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    """The tiny KG with the hand-written corpus, its BM25 index and chunk embeddings, mentions and links."""
    from medgraph.embed.tables import embed_source
    from medgraph.text.bm25 import build_bm25_index

    warehouse = copy_warehouse(retrieval_warehouse, tmp_path_factory.mktemp("hypergraph") / "home")
    with warehouse.connect() as con:
        con.execute("DELETE FROM text.corpus_chunks")
        for chunk_id, title, text in CHUNKS:
            con.execute("INSERT INTO text.corpus_chunks (chunk_id, doc_id, source, title, text) "
                        "VALUES (?, ?, 'test', ?, ?)", [chunk_id, chunk_id, title, text])
        con.execute("CREATE SCHEMA IF NOT EXISTS kg")
        con.execute("CREATE OR REPLACE TABLE kg.kg_chunk_mentions (chunk_id VARCHAR, cui VARCHAR, mention VARCHAR, "
                    "match_type VARCHAR, score DOUBLE, start_char BIGINT, end_char BIGINT)")
        for (chunk_id, _, text), cui, surface in MENTIONS:
            start = text.index(surface)
            con.execute("INSERT INTO kg.kg_chunk_mentions VALUES (?, ?, ?, 'exact', 1.0, ?, ?)",
                        [chunk_id, cui, surface, start, start + len(surface)])
        con.execute("CREATE OR REPLACE TABLE kg.kg_chunk_links (chunk_a VARCHAR, chunk_b VARCHAR, "
                    "shared_concepts VARCHAR[], weight DOUBLE)")
        for row in LINKS:
            con.execute("INSERT INTO kg.kg_chunk_links VALUES (?, ?, ?, ?)", list(row))
    build_bm25_index(warehouse)
    embed_source(warehouse, "chunk_embeddings", encoder)
    return warehouse


@pytest.fixture(scope="module")
def retriever(hypergraph: Warehouse, encoder) -> Iterator[Retriever]:
    with Retriever(hypergraph, encoder) as retriever:
        yield retriever


@pytest.fixture(scope="module")
def env(retriever: Retriever) -> GraphR1Env:
    return GraphR1Env(retriever, GraphR1Config(max_steps=6, snippet_chars=160, analyze_chunk_chars=200))


def test_search_lists_chunks_by_short_reference_with_capped_snippets(env: GraphR1Env):
    state = env.reset(TREAT)
    assert "T1" in state.messages[0].content  # the system prompt explains chunk references
    step = env.step(state, "<think>find text</think><search>amlodipine ankle swelling trial</search>")
    assert "Texts:" in step.observation and f"{HYPERTENSION}" not in step.observation.split("Texts:")[1]
    assert state.chunk_refs["T1"] == "c_trial" and "T1 Amlodipine trial: Amlodipine lowered" in step.observation
    assert "c_trial" in step.retrieved_ids
    # The snippet is cut to snippet_chars at a word, and evidence records exactly that many characters.
    long_line = next(line for line in step.observation.splitlines() if line.startswith(state.chunk_aliases["c_long"]))
    assert long_line.endswith(" ...") and len(long_line) < env.config.snippet_chars + 40
    assert step.shown.chunks["c_trial"] is None and 0 < step.shown.chunks["c_long"] <= env.config.snippet_chars


def test_traverse_goes_concept_to_chunk_to_concept(env: GraphR1Env):
    state = env.reset(TREAT)
    step = env.step(state, f"<think>edges</think><traverse>{HYPERTENSION}</traverse>")
    edges, texts = step.observation.split("Texts mentioning it:")
    assert f"-may_be_treated_by-> amlodipine ({AMLODIPINE})" in edges
    # The chunk that also names a KG neighbour (amlodipine) comes before those naming hypertension alone.
    # (Both name it; c_long names hypertension earlier.)
    assert [line.split()[0] for line in texts.strip().splitlines()] == ["T1", "T2", "T3"]
    assert state.chunk_refs == {"T1": "c_long", "T2": "c_trial", "T3": "c_guide"}
    assert step.retrieved_ids[-3:] == tuple(state.chunk_refs[t] for t in ("T1", "T2", "T3"))
    trial = state.chunk_aliases["c_trial"]
    step = env.step(state, f"<think>read its concepts</think><traverse>{trial}</traverse>")
    mentions, related = step.observation.split("Related texts:")
    assert mentions.splitlines()[1:] == [f"amlodipine ({AMLODIPINE})", f"Hypertension ({HYPERTENSION})"]
    # The strongest link first, with the concepts the two chunks share.
    assert related.strip().splitlines()[0] == f"{state.chunk_aliases['c_long']} Hypertension review " \
                                              "(shares amlodipine, Hypertension)"
    assert set(step.shown.concepts) == {AMLODIPINE, HYPERTENSION} and AMLODIPINE in state.nodes
    # From a concept found through the chunk, back into the KG.
    step = env.step(state, f"<think>the drug</think><traverse>{AMLODIPINE}</traverse>")
    assert f"amlodipine ({AMLODIPINE}) -" in step.observation and state.chunk_aliases["c_trial"] == trial
    assert state.visited == [HYPERTENSION, AMLODIPINE]  # concepts walked from, not chunks


def test_analyze_returns_chunk_text_capped_and_concept_texts(env: GraphR1Env):
    state = env.reset(TREAT)
    env.step(state, f"<think>edges</think><traverse>{HYPERTENSION}</traverse>")
    trial, long = state.chunk_aliases["c_trial"], state.chunk_aliases["c_long"]
    step = env.step(state, f"<think>read</think><analyze>{long}, {trial}, {AMLODIPINE}</analyze>")
    assert step.retrieved_ids == ("c_long", "c_trial", AMLODIPINE)
    long_line, trial_line, concept_line = step.observation.splitlines()
    assert long_line.startswith(f"{long} (Hypertension review): Hypertension is common.") and long_line.endswith(" ...")
    assert "Amlodipine is one option" not in long_line and len(long_line) <= env.config.analyze_chunk_chars + 40
    assert trial_line == f"{trial} (Amlodipine trial): {TRIAL[2]}" and concept_line.startswith(f"{AMLODIPINE}: ")
    assert step.shown.chunks == {"c_long": pytest.approx(200, abs=12), "c_trial": None}
    # A raw chunk id is accepted too (and gets the episode's next reference).
    step = env.step(state, "<think>again</think><analyze>c_fabry</analyze>")
    assert step.retrieved_ids == ("c_fabry",) and step.observation.startswith("T4 (Fabry case report): A man")


def test_batched_steps_equal_one_by_one(retriever: Retriever):
    env = GraphR1Env(retriever, GraphR1Config(max_steps=6, analyze_chunk_chars=200))
    scripts = [
        ["<think>a</think><search>hypertension treatment</search>", "<think>b</think><traverse>T1</traverse>",
         "<think>c</think><analyze>T2, T1</analyze>"],
        [f"<think>a</think><traverse>{HYPERTENSION}</traverse>", "<think>b</think><traverse>T2</traverse>",
         "<think>c</think><analyze>T4</analyze>"],
        ["<think>a</think><search>Fabry disease seizure</search>", "<think>b</think><analyze>T1, Fabry disease</analyze>",
         f"<think>c</think><traverse>{FABRY}</traverse>"],
    ]
    alone = []
    for script in scripts:
        state = env.reset(TREAT)
        for reply in script:
            env.step(state, reply)
        alone.append(state)
    together = [env.reset(TREAT) for _ in scripts]
    for turn in range(3):
        env.step_batch([(state, script[turn]) for state, script in zip(together, scripts, strict=True)])
    for one, batched in zip(alone, together, strict=True):
        assert [m.content for m in one.messages] == [m.content for m in batched.messages]
        assert one.chunk_refs == batched.chunk_refs and one.nodes == batched.nodes
    assert all("T1" in state.chunk_refs for state in together)


def test_evidence_recall_counts_an_analyzed_chunk_only_within_what_was_shown(retriever: Retriever):
    tools = KnowledgeTools(retriever)

    def script(*turns: str):
        def reply(conversation: Conversation) -> str:
            return turns[sum(1 for m in conversation if m.role == "assistant")]
        return reply

    config = make_config("graph-r1", {"analyze_chunk_chars": 200, "traverse_limit": 0})
    # traverse_limit 0: no edges shown, so only the chunk can cover the gold pair.
    read = script("<think>find</think><search>amlodipine ankle swelling trial</search>",
                  "<think>read</think><analyze>T1</analyze>", "<think>done</think><answer>A</answer>")
    (trial,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(read), config)
    assert trial.steps[1].retrieved_ids == ["c_trial"] and trial.evidence.chunks["c_trial"] is None
    assert (trial.gold_fact_seen, trial.answer_seen) == (1.0, 1.0)
    cut = script(f"<think>find</think><traverse>{HYPERTENSION}</traverse>",
                 "<think>read</think><analyze>c_long</analyze>", "<think>done</think><answer>A</answer>")
    (long,) = run_method("graph-r1", [TREAT], tools, ScriptedChatModel(cut), config)
    assert "c_long" in long.evidence.chunks and not long.evidence.triples
    assert long.gold_fact_seen == 0.0  # amlodipine comes after the 200 characters shown
    # The report's "visited the named concept" rate: trial only searched and read a chunk; long walked from
    # hypertension, the concept the question names.
    assert (trial.stats["visited_named_concept"], long.stats["visited_named_concept"]) == (False, True)
    assert method_statistics([trial, long])["visited_named_concept_rate"] == 0.5
    assert method_statistics([trial, long])["refused_answer_rate"] == 0.0  # both answered "A"


def test_expert_demonstration_reads_the_chunk_that_holds_the_gold_evidence(retriever: Retriever):
    edge = next(t for t in retriever.one_hop([HYPERTENSION])
                if t.dst_cui == AMLODIPINE and t.relation == "may_be_treated_by")
    item = QaItem("test", "treat", TREAT.question, OPTIONS, "A", extra={
        "gold_path": [edge.edge_id], "seed_cuis": [HYPERTENSION], "answer_cuis": [AMLODIPINE],
        "question_type": "mc"})
    reads_text = expert_demonstrations(GraphR1Env(retriever, GraphR1Config(max_steps=6, analyze_chunk_chars=200)),
                                       [item])
    (state,) = reads_text.states
    assert state.actions == ["search", "traverse", "analyze", "answer"]
    analyze = state.messages[state.prompt_turns + 4]
    alias = analyze.content.split("<analyze>")[1].split("</analyze>")[0]
    assert state.chunk_refs[alias] == "c_trial"  # c_long names amlodipine only after what an analyze shows
    assert TRIAL[2] in state.messages[state.prompt_turns + 5].content
    # Where no chunk shows both concepts within the cap, the expert reads the answer concept as before.
    reads_concept = expert_demonstrations(GraphR1Env(retriever, GraphR1Config(max_steps=6, analyze_chunk_chars=40)),
                                          [item])
    (state,) = reads_concept.states
    assert f"<analyze>{AMLODIPINE}</analyze>" in state.messages[state.prompt_turns + 4].content
