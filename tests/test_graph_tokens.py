"""HIIM graph tokens: W_proj training against the frozen SmolLM2, registry pairing, generation with tokens."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import torch
from conftest import copy_warehouse

from medgraph.gnn.graph_tokens import (
    PROJECTOR_MODEL_NAME,
    GraphTokenizer,
    HiimProjector,
    NodeFeatures,
    ProjectorConfig,
    answer_nll,
    load_champion_graph_tokenizer,
    load_examples,
    token_embedding_norm,
)
from medgraph.gnn.train import GatConfig, train_gat
from medgraph.kg.qa import generate_qa_items
from medgraph.llm.base import GenerationConfig, user
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.storage import Warehouse
from platform_assets.models import GAT_MODEL_NAME, gat_model, hiim_projector
from resources import LlmResource, MlflowResource, WarehouseResource

CONFIG = ProjectorConfig.profile("tiny", steps=2, batch_size=2, valid_items=4, eval_every=2)


@pytest.fixture(scope="module")
def qa_warehouse(gat_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(gat_warehouse, tmp_path_factory.mktemp("hiim") / "home")
    generate_qa_items(warehouse, warehouse.path.parent / "qa", per_type=40)
    return warehouse


@pytest.fixture(scope="module")
def tokenizer(qa_warehouse: Warehouse, smollm2) -> GraphTokenizer:
    torch.set_num_threads(2)
    gat = train_gat(qa_warehouse, GatConfig.profile("tiny", epochs=1, steps_per_epoch=5)).model
    projector = HiimProjector(gat.triple.out_features, smollm2.hidden_size, token_embedding_norm(smollm2))
    return GraphTokenizer(gat, projector, NodeFeatures(qa_warehouse.lake, gat.feature_table))


def test_evidence_holds_the_gold_path_and_answers_name_the_option(qa_warehouse: Warehouse):
    examples = load_examples(qa_warehouse, "train", CONFIG)
    assert examples and all(0 < len(e.triples) <= CONFIG.max_triples for e in examples)
    with qa_warehouse.connect(read_only=True) as con:
        gold = dict(con.execute("SELECT qid, gold_path FROM qa.qa_items WHERE split = 'train'").fetchall())
    for example in examples[:20]:
        assert set(gold[example.qid]) <= {t.edge_id for t in example.triples}
        if example.options:
            letter, text = example.answer.split(": ", 1)
            assert example.options[letter] == text


def test_graph_tokens_live_in_the_llm_embedding_space_and_carry_gradient(qa_warehouse: Warehouse, smollm2,
                                                                         tokenizer: GraphTokenizer):
    examples = load_examples(qa_warehouse, "train", CONFIG)[:2]
    tokens = [tokenizer.encode(e.triples) for e in examples]
    assert tokens[0].shape == (len(examples[0].triples), smollm2.hidden_size)
    torch.testing.assert_close(tokens[0].norm(dim=-1), torch.full((len(examples[0].triples),),
                                                                  token_embedding_norm(smollm2)))
    loss = answer_nll(smollm2, examples, tokens).mean()
    loss.backward()
    grad = tokenizer.projector.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0  # the answer likelihood depends on the graph tokens
    assert all(p.grad is None for p in smollm2.model.parameters() if not p.requires_grad)

    no_graph = answer_nll(smollm2, examples, None).detach()
    assert no_graph.shape == (2,) and torch.isfinite(no_graph).all()


def test_hiim_projector_asset_registers_a_pair_that_loads_for_its_llm_only(qa_warehouse: Warehouse, smollm2,
                                                                           tmp_path: Path, mlflow_db: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    home = qa_warehouse.path.parent
    llm = LlmResource(spec="smollm2-135m-instruct", home=str(tmp_path))
    llm._llm = smollm2  # the session's loaded model: the resource would load the same one
    resources = {"warehouse": WarehouseResource(home=str(home)), "llm": llm,
                 "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                                   artifact_root=str(tmp_path / "artifacts"))}
    instance = dg.DagsterInstance.ephemeral()
    with pytest.raises(dg.Failure, match="materialize models/gat_model first"):
        dg.materialize([hiim_projector], resources=resources, instance=instance)
    run_config = dg.RunConfig(ops={
        "models__gat_model": {"config": {"profile": "tiny", "epochs": 1, "steps_per_epoch": 5}},
        "models__hiim_projector": {"config": {"profile": "tiny", "steps": CONFIG.steps, "batch_size": 2,
                                              "valid_items": 4}}})
    result = dg.materialize([gat_model, hiim_projector], resources=resources, instance=instance,
                            run_config=run_config)
    assert result.success
    (materialization,) = result.asset_materializations_for_node("models__hiim_projector")
    metadata = materialization.metadata
    assert metadata["promoted"].value is True and metadata["gat_model_uri"].value == f"models:/{GAT_MODEL_NAME}/1"
    assert metadata["valid_answer_nll_text_only"].value > 0 and metadata["llm"].value == "smollm2-135m-instruct"

    tracking_uri = f"sqlite:///{mlflow_db}"
    loaded = load_champion_graph_tokenizer(smollm2, qa_warehouse, tracking_uri)
    assert loaded is not None and loaded.projector.gat_model_uri.endswith("/1")
    triples = load_examples(qa_warehouse, "validation", CONFIG)[0].triples
    graph = loaded.encode(triples)
    reply = smollm2.generate([[user("Which drug may treat hypertension?")]], GenerationConfig(max_new_tokens=4),
                             graph_tokens=[graph])[0]
    assert reply.completion_tokens > 0 and reply.prompt_tokens > len(triples)
    assert load_champion_graph_tokenizer(ScriptedChatModel(["x"]), qa_warehouse, tracking_uri) is None
