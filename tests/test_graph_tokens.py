"""HIIM graph tokens: W_proj training against the frozen SmolLM2 on what A2RAG retrieves and asks, the
projector's champion gate against A2RAG's text-only answer, registry pairing, generation with tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest
import torch
from conftest import TEST_ENCODER, copy_warehouse, share_converted_llm

import platform_assets.models as model_assets
from medgraph.eval.gsrm import params_path
from medgraph.files import write_json_atomically
from medgraph.gnn.graph_tokens import (
    GraphTokenizer,
    HiimProjector,
    NodeFeatures,
    load_champion_graph_tokenizer,
)
from medgraph.gnn.train import GatConfig, train_gat
from medgraph.llm.base import GenerationConfig, user
from medgraph.llm.scripted import ScriptedChatModel
from medgraph.methods.a2rag import A2Rag, A2RagConfig, answer_conversation
from medgraph.methods.tools import KnowledgeTools
from medgraph.qa.generate import generate_qa_items
from medgraph.qa.table import load_qa_items
from medgraph.retrieval import Retriever
from medgraph.rl.hiim import (
    ProjectorConfig,
    ProjectorExample,
    ProjectorResult,
    accumulate_batch_gradient,
    answer_nll,
    layer_inputs_only,
    load_examples,
    token_embedding_norm,
)
from medgraph.storage import Warehouse
from medgraph.tracking import GAT_MODEL, HIIM_PROJECTOR_MODEL
from platform_assets.models import gat_model, hiim_projector
from resources import EncoderResource, LlmResource, MlflowResource, TrainingResource, WarehouseResource

CONFIG = ProjectorConfig.profile("tiny", steps=2, batch_size=2, valid_items=4, eval_every=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qa_warehouse(retrieval_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path_factory.mktemp("hiim") / "home")
    generate_qa_items(warehouse, warehouse.path.parent / "qa", per_type=40)
    return warehouse


@pytest.fixture(scope="module")
def tools(qa_warehouse: Warehouse, encoder) -> Iterator[KnowledgeTools]:
    with Retriever(qa_warehouse, encoder) as retriever:
        yield KnowledgeTools(retriever)


@pytest.fixture(scope="module")
def tokenizer(qa_warehouse: Warehouse, smollm2) -> GraphTokenizer:
    gat = train_gat(qa_warehouse, GatConfig.profile("tiny", epochs=1, steps_per_epoch=5)).model
    projector = HiimProjector(gat.triple.out_features, smollm2.hidden_size, token_embedding_norm(smollm2))
    return GraphTokenizer(gat, projector, NodeFeatures(qa_warehouse.lake, gat.feature_table))


@pytest.fixture(scope="module")
def two_examples(qa_warehouse: Warehouse, tools: KnowledgeTools) -> list[ProjectorExample]:
    """Two training examples as A2RAG retrieves them (retrieval is most of loading: shared by the module), their
    prompts cut to three facts and no passage: the tests that take them check the mechanics (shapes, gradients,
    logits kept, recomputation), which do not depend on the prompt's length, and SmolLM2's forward and backward
    cost grows with it (the whole prompts took ~2 minutes of these tests on one CPU thread)."""
    examples = load_examples(qa_warehouse, "train", CONFIG, tools, limit=4)[:2]
    return [replace(example, context=example.context[:3], passages=()) for example in examples]


def test_examples_hold_what_a2rag_retrieves_and_its_answer_prompt(qa_warehouse: Warehouse, tools: KnowledgeTools):
    examples = load_examples(qa_warehouse, "train", CONFIG, tools, limit=6)
    assert examples
    a2rag, defaults = A2Rag(tools, ScriptedChatModel(["x"])), A2RagConfig()
    # T_KG inside A2RAG (default tau / K / N) over the same batch of questions: the bfloat16 encoder's vector of
    # a question depends on the questions it is padded with, and GSRM's ranking on that vector.
    items = load_qa_items(qa_warehouse, "train", 6, CONFIG.seed)
    retrieved = dict(zip((item.qid for item in items), a2rag.knowledge_graph(items), strict=True))
    for example in examples:
        assert example.triples == tuple(t for t, _ in retrieved[example.item.qid].triples)
        assert 0 < len(example.triples) <= defaults.top_n
        assert example.context == example.triples[: defaults.context_triples]
        # The prompt A2RAG answers with: facts and T_Text's passages (searched with the question, text_k of them).
        (passages,) = tools.passages([example.item.question], k=defaults.text_k)
        assert example.passages == tuple(passages) and example.passages
        assert example.conversation(False) == answer_conversation(example.item, example.context, passages)
        assert "Text passages:" in example.conversation(False)[1].content
        with_tokens = example.conversation(True)
        assert "graph tokens" in with_tokens[0].content and with_tokens[1:] == example.conversation(False)[1:]
        assert example.answer == (f"<answer>{example.item.answer}</answer>" if example.item.options
                                  else f"<answer>{(example.item.acceptable_answers or (example.item.answer,))[0]}</answer>")


def test_gold_path_evidence_is_an_explicit_option(qa_warehouse: Warehouse):
    with pytest.raises(ValueError, match="pass KnowledgeTools"):
        load_examples(qa_warehouse, "train", CONFIG)
    examples = load_examples(qa_warehouse, "train", replace(CONFIG, graph_triples="gold_path"), limit=20)
    assert examples and all(0 < len(e.triples) <= CONFIG.max_triples for e in examples)
    for example in examples:
        assert set(example.item.extra["gold_path"]) <= {t.edge_id for t in example.triples}


def test_graph_tokens_live_in_the_llm_embedding_space_and_carry_gradient(
        two_examples: list[ProjectorExample], smollm2, tokenizer: GraphTokenizer):
    examples = two_examples
    tokens = [tokenizer.encode(e.triples) for e in examples]
    assert tokens[0].shape == (len(examples[0].triples), smollm2.hidden_size)
    torch.testing.assert_close(tokens[0].norm(dim=-1), torch.full((len(examples[0].triples),),
                                                                  token_embedding_norm(smollm2)))
    loss = answer_nll(smollm2, examples, tokens).mean()
    loss.backward()
    grad = tokenizer.projector.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0  # the answer likelihood depends on the graph tokens
    assert all(p.grad is None for p in smollm2.model.parameters() if not p.requires_grad)

    text_only = answer_nll(smollm2, examples, None).detach()
    assert text_only.shape == (2,) and torch.isfinite(text_only).all()


def test_the_answer_nll_reads_the_logits_of_the_answer_positions(
        two_examples: list[ProjectorExample], smollm2, tokenizer: GraphTokenizer):
    """answer_nll asks the model for the last positions' logits only; its values are the ones computed from every
    position's logits (the whole prompt's, then sliced), with and without graph tokens."""
    examples = two_examples
    tokens = [tokenizer.encode(e.triples).detach() for e in examples]
    forward = smollm2.model.forward
    seen: list[int] = []

    def every_position(*args, **kwargs):  # the reference: every position's logits computed, then the last k taken
        seen.append(keep := kwargs.pop("logits_to_keep"))
        out = forward(*args, **kwargs)
        out.logits = out.logits[:, -keep:]
        return out

    with torch.no_grad():
        kept = [answer_nll(smollm2, examples, tokens), answer_nll(smollm2, examples, None)]
        smollm2.model.forward = every_position
        try:
            full = [answer_nll(smollm2, examples, tokens), answer_nll(smollm2, examples, None)]
        finally:
            del smollm2.model.forward
    assert seen and all(0 < k < 40 for k in seen)  # a few answer positions, not the prompt
    for few, every in zip(kept, full):
        torch.testing.assert_close(few, every, rtol=1e-4, atol=1e-4)


def test_recomputing_the_frozen_llms_activations_gives_the_same_loss_and_gradient(
        two_examples: list[ProjectorExample], smollm2, tokenizer: GraphTokenizer):
    """W_proj trains with the LLM's layers checkpointed (layer_inputs_only): the same answer NLL and the same
    gradient on W_proj as with every activation kept, and the model is left as it was (eval mode, no checkpointing).
    One example: what is compared is the recomputation, which a batch would only repeat."""
    examples = two_examples[:1]
    vectors = [tokenizer.triple_vectors(e.triples) for e in examples]
    weight = tokenizer.projector.proj.weight

    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = None
        loss = answer_nll(smollm2, examples, [tokenizer.projector(v) for v in vectors]).mean()
        loss.backward()
        return loss.detach(), weight.grad.clone()

    attention = smollm2.model.model.layers[0].self_attn
    calls: list[int] = []
    hook = attention.register_forward_hook(lambda *_: calls.append(1))
    try:
        kept, once = loss_and_grad(), len(calls)
        with layer_inputs_only(smollm2.model):
            recomputed = loss_and_grad()
    finally:
        hook.remove()
    assert (once, len(calls) - once) == (1, 2)  # checkpointed: the layer ran again in the backward pass
    torch.testing.assert_close(recomputed[0], kept[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(recomputed[1], kept[1], rtol=1e-4, atol=1e-7)
    assert not smollm2.model.training and not any(m.training for m in smollm2.model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in smollm2.model.modules())


def test_one_question_per_pass_gives_the_batchs_gradient(two_examples: list[ProjectorExample], smollm2,
                                                          tokenizer: GraphTokenizer):
    """The projector's step with micro-batches of one question (no padding, activations kept) adds the same
    gradient to W_proj as the whole batch in one padded, recomputed pass, and reports the same mean NLL."""
    vectors = {e.qid: tokenizer.triple_vectors(e.triples) for e in two_examples}
    weight = tokenizer.projector.proj.weight

    def step(config: ProjectorConfig) -> tuple[float, torch.Tensor]:
        weight.grad = None
        loss = accumulate_batch_gradient(smollm2, tokenizer.projector, vectors, two_examples, config)
        return loss, weight.grad.clone()

    whole = step(ProjectorConfig(micro_batch_size=2, recompute_layers=True, bf16=False))
    alone = step(ProjectorConfig(micro_batch_size=1, bf16=False))
    assert alone[0] == pytest.approx(whole[0], rel=1e-5)
    # Summed in another order: float32 rounding, measured against the gradient's own scale.
    torch.testing.assert_close(alone[1], whole[1], rtol=1e-4, atol=1e-4 * float(whole[1].abs().max()))
    assert float(alone[1].abs().sum()) > 0


def test_projector_must_beat_a2rags_text_only_answer_then_the_champion(qa_warehouse: Warehouse, smollm2,
                                                                        tmp_path: Path, mlflow_db: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        request: pytest.FixtureRequest):
    home = qa_warehouse.path.parent
    # GSRM as models/gsrm_params would tune it, kept small: one expansion, 15 triples per question (the
    # asset's retrieval over the training and validation questions is most of this test's time).
    tuned = params_path(home)
    write_json_atomically(tuned, {"tau": 0.5, "iterations": 1, "top_n": 15})
    request.addfinalizer(lambda: tuned.unlink(missing_ok=True))  # the warehouse is shared by the module
    share_converted_llm(tmp_path, smollm2)  # the assets load the LLM from this home: no second conversion
    llm = LlmResource(spec="smollm2-135m-instruct", home=str(tmp_path))
    encoder_resource = EncoderResource(**TEST_ENCODER)
    resources = {"warehouse": WarehouseResource(home=str(home)), "llm": llm, "encoder": encoder_resource,
                 "mlflow_tracking": MlflowResource(tracking_uri=f"sqlite:///{mlflow_db}",
                                                   artifact_root=str(tmp_path / "artifacts")),
                 "training": TrainingResource(profile="tiny")}
    instance = dg.DagsterInstance.ephemeral()
    with pytest.raises(dg.Failure, match="materialize models/gat_model first"):
        dg.materialize([hiim_projector], resources=resources, instance=instance)
    projector_config = {"profile": "tiny", "steps": CONFIG.steps, "batch_size": 2, "train_items": 8, "valid_items": 4}
    gat_config = {"profile": "tiny", "epochs": 1, "steps_per_epoch": 5}
    dg.materialize([gat_model], resources=resources, instance=instance,
                   run_config=dg.RunConfig(ops={"models__gat_model": {"config": gat_config}}))
    run_config = dg.RunConfig(ops={"models__hiim_projector": {"config": projector_config}})
    real_training = model_assets.train_projector

    def projector_run(gain: float | None) -> dict[str, dg.MetadataValue]:
        """Materialize the projector; with `gain`, training is replaced by a projector whose validation NLL
        is the text-only NLL minus `gain` (the text-only NLL itself is measured for real)."""
        def scripted(llm, gat, features, train, valid, config, log_fn=None) -> ProjectorResult:
            text_only = float(answer_nll(llm, valid[:2], None).mean())
            projector = HiimProjector(gat.triple.out_features, llm.hidden_size, 1.0)
            projector.llm_name = llm.name
            return ProjectorResult(projector, {"valid_answer_nll": text_only - gain,
                                               "valid_answer_nll_text_only": text_only,
                                               "valid_nll_gain_spread": 0.2}, [], {"valid": 2})

        with monkeypatch.context() as patch:
            if gain is not None:
                patch.setattr(model_assets, "train_projector", scripted)
            result = dg.materialize([hiim_projector], resources=resources, instance=instance, run_config=run_config)
        (materialization,) = result.asset_materializations_for_node("models__hiim_projector")
        return materialization.metadata

    tracking = resources["mlflow_tracking"].tracking()
    worse = projector_run(gain=-0.5)  # graph tokens that make the answer less likely than text alone
    assert worse["promoted"].value is False and worse["previous_champion_version"].value == "none"
    assert worse["baseline_name"].value.startswith("A2RAG text-only answer")
    # The gate: text-only less the spread of the gain (half its bootstrap CI over validation questions).
    assert worse["baseline_value"].value == pytest.approx(worse["valid_answer_nll_text_only"].value - 0.2)
    assert tracking.champion_version(HIIM_PROJECTOR_MODEL.name) is None
    within_spread = projector_run(gain=0.1)  # better than text-only, but by less than the gain's own spread
    assert within_spread["promoted"].value is False and tracking.champion_version(HIIM_PROJECTOR_MODEL.name) is None
    better = projector_run(gain=0.5)
    assert better["promoted"].value is True and tracking.champion_version(HIIM_PROJECTOR_MODEL.name) == "3"
    assert better["gate_reference"].value.startswith("baseline A2RAG text-only")

    trained = projector_run(gain=None)  # real training: judged against the champion now
    assert model_assets.train_projector is real_training
    metadata = trained["valid_answer_nll"].value, trained["valid_answer_nll_text_only"].value
    assert all(value > 0 for value in metadata) and trained["graph_triples"].value == "gsrm"
    assert trained["gat_model_uri"].value == f"models:/{GAT_MODEL.name}/1" and trained["llm"].value == smollm2.name
    assert trained["gate_reference"].value == "champion v3"
    assert trained["valid_nll_gain_spread"].value >= 0 and "valid_nll_gain_ci_low" in trained
    assert trained["promoted"].value is (trained["candidate_value"].value < trained["previous_champion_value"].value)

    loaded = load_champion_graph_tokenizer(smollm2, qa_warehouse, tracking)
    assert loaded is not None and loaded.projector.gat_model_uri.endswith("/1")
    triples = load_examples(qa_warehouse, "validation", replace(CONFIG, graph_triples="gold_path"))[0].triples
    graph = loaded.encode(triples)
    reply = smollm2.generate([[user("Which drug may treat hypertension?")]], GenerationConfig(max_new_tokens=4),
                             graph_tokens=[graph])[0]
    assert reply.completion_tokens > 0 and reply.prompt_tokens > len(triples)
    assert load_champion_graph_tokenizer(ScriptedChatModel(["x"]), qa_warehouse, tracking) is None
