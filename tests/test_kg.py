"""KG marts (dbt) and graph access: semantics of the tables, lookup, one-hop, CSR index."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from conftest import copy_warehouse

from medgraph.kg.csr import build_graph_index
from medgraph.kg.graph import KnowledgeGraph
from medgraph.storage import Warehouse


def rows(warehouse: Warehouse, sql: str, params=None) -> list[tuple]:
    with warehouse.connect(read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


def test_edges_read_source_relation_target_like_umls(kg_warehouse: Warehouse):
    """MRREL (CUI1=disease, RELA=may_treat, CUI2=drug) means 'drug may_treat disease'."""
    treats = rows(kg_warehouse, """
        SELECT s.preferred_name, d.preferred_name FROM kg.kg_edges e
        JOIN kg.kg_nodes s ON s.cui = e.src_cui JOIN kg.kg_nodes d ON d.cui = e.dst_cui
        WHERE e.relation = 'may_treat' AND d.preferred_name = 'Hypertension'""")
    assert ("amlodipine", "Hypertension") in treats
    isa = rows(kg_warehouse, """
        SELECT count(*) FILTER (WHERE s.preferred_name = 'Focal-onset seizure' AND d.preferred_name = 'Seizure')
        FROM kg.kg_edges e JOIN kg.kg_nodes s ON s.cui = e.src_cui JOIN kg.kg_nodes d ON d.cui = e.dst_cui
        WHERE e.relation = 'isa'""")
    assert isa == [(1,)]


def test_edges_drop_self_loops_and_synonymy_and_keep_only_known_nodes(kg_warehouse: Warehouse):
    assert rows(kg_warehouse, "SELECT count(*) FROM kg.kg_edges WHERE src_cui = dst_cui") == [(0,)]
    assert rows(kg_warehouse, "SELECT count(*) FROM kg.kg_edges WHERE rel IN ('SY', 'RL')") == [(0,)]
    dangling = rows(kg_warehouse, """SELECT count(*) FROM kg.kg_edges
        WHERE src_cui NOT IN (SELECT cui FROM kg.kg_nodes) OR dst_cui NOT IN (SELECT cui FROM kg.kg_nodes)""")
    assert dangling == [(0,)]
    mrrel, edges = rows(kg_warehouse, """SELECT (SELECT count(DISTINCT (CUI2, REL, RELA, CUI1)) FROM umls.mrrel
        WHERE CUI1 <> CUI2), (SELECT count(*) FROM kg.kg_edges)""")[0]
    assert edges == mrrel, "every distinct relation between different concepts becomes one edge"


def test_nodes_carry_preferred_name_synonyms_types_and_definition(kg_warehouse: Warehouse):
    (node,) = rows(kg_warehouse, "SELECT preferred_name, synonyms, semantic_types, definition, sources "
                                 "FROM kg.kg_nodes WHERE cui = 'C0036572'")
    name, synonyms, types, definition, sources = node
    assert name == "Seizure"
    assert "Seizures" in synonyms and name not in synonyms
    assert types == ["Sign or Symptom"]
    assert definition and "brain" in definition.lower()
    assert "HPO" in sources
    (text,) = rows(kg_warehouse, "SELECT text FROM kg.kg_node_text WHERE cui = 'C0036572'")[0]
    assert text.startswith("Seizure. Also known as:") and "Definition:" in text and "Relations:" in text


def test_lookup_matches_names_and_synonyms_after_normalization(kg_warehouse: Warehouse):
    with KnowledgeGraph(kg_warehouse) as graph:
        found = graph.lookup(["Hypertension", "  SEIZURES ", "seizure", "no such concept", ""])
    assert found[0] == ["C0020538"]
    assert found[1] == found[2] == ["C0036572"]
    assert found[3] == [] and found[4] == []


def test_one_hop_returns_exactly_the_edges_of_the_sources(kg_warehouse: Warehouse):
    with KnowledgeGraph(kg_warehouse) as graph:
        cuis = graph.lookup(["Hypertension", "Seizure"])
        sources = [c for found in cuis for c in found]
        triples = graph.one_hop(sources + ["C0000000"])  # an unknown CUI is ignored
        expected = rows(kg_warehouse, "SELECT edge_id FROM kg.kg_edges WHERE src_cui IN (SELECT unnest(?))", [sources])
        assert sorted(t.edge_id for t in triples) == sorted(e for (e,) in expected)
        assert {t.src_cui for t in triples} == set(sources)
        by_id = sorted(triples[:5], key=lambda t: t.edge_id)
        assert sorted(graph.triples([t.edge_id for t in by_id]), key=lambda t: t.edge_id) == by_id

        treated_by = graph.one_hop(cuis[0], relations=["may_be_treated_by"])
        assert treated_by and {t.relation for t in treated_by} == {"may_be_treated_by"}
        assert "amlodipine may be treated by" not in treated_by[0].text
        assert treated_by[0].text.startswith("Hypertension may be treated by ")

        capped = graph.one_hop(sources, limit_per_node=3)
        assert len(capped) == 6 and all(sum(t.src_cui == s for t in capped) == 3 for s in sources)
        assert [t.dst_cui for t in graph.neighbors(sources[0])] == [t.dst_cui for t in triples if t.src_cui == sources[0]]


def test_graph_index_is_cached_and_rebuilt_when_edges_change(kg_warehouse: Warehouse, tmp_path: Path):
    warehouse = copy_warehouse(kg_warehouse, tmp_path / "home")
    first = build_graph_index(warehouse)
    cached = list((warehouse.lake.root / "kg").glob("graph_index.*.npz"))
    assert [p.name for p in cached] == [f"graph_index.{first.version}.npz"]
    again = build_graph_index(warehouse)
    assert again.version == first.version and again.num_edges == first.num_edges
    with warehouse.connect() as con:
        con.execute("DELETE FROM kg.kg_edges WHERE relation = 'may_treat'")
        removed = first.num_edges - con.execute("SELECT count(*) FROM kg.kg_edges").fetchone()[0]
    changed = build_graph_index(warehouse)
    assert removed > 0 and changed.version != first.version
    assert changed.num_edges == first.num_edges - removed
    assert [p.name for p in (warehouse.lake.root / "kg").glob("graph_index.*.npz")] == [
        f"graph_index.{changed.version}.npz"]


@pytest.mark.slow
def test_dbt_assets_build_marts_and_report_dbt_tests_as_checks(tiny_release: Path, tmp_path: Path):
    """Lineage from the release through dbt, in-process with real resources."""
    from medgraph.settings import load_settings
    from platform_assets import kg, umls
    from resources import build_resources

    home = tmp_path / "home"
    settings = load_settings({"MEDGRAPH_HOME": str(home), "MEDGRAPH_UMLS_DIR": str(tiny_release),
                              "MEDGRAPH_PROFILE": "tiny"})
    resources = build_resources(settings)
    result = dg.materialize([*umls.umls_tables, *umls.umls_checks, kg.kg_dbt_models], resources=resources,
                            raise_on_error=False)
    assert result.success
    dbt_checks = [c for c in result.get_asset_check_evaluations() if c.asset_key.path[0] in ("kg", "staging")]
    assert len(dbt_checks) >= 20 and all(c.passed for c in dbt_checks)
    assert {"unique_kg_nodes_cui", "relationships_kg_edges_src_cui__cui__ref_kg_nodes_"} <= {
        c.check_name for c in dbt_checks}
    warehouse = resources["warehouse"].get_warehouse()
    assert warehouse.count("kg.kg_nodes") > 2000 and warehouse.count("kg.kg_edges") > 10000
