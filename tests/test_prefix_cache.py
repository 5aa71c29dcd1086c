"""Prefix caching in the transformers backend: a turn prefills only what is new in its prompt.

The real SmolLM2 runs twice, with the cache and without, on the same conversations: greedy replies
must be token-identical (and so must the answers of every method on the tiny release), while the
prompt tokens the model computed drop on every turn after the first. float32, where recomputing
from scratch is well defined: in bfloat16 the order of the sums (prefill vs decode shapes) rounds
differently and near-ties can flip whether or not a cache is used.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_methods import E2E_CONFIGS

from medgraph.eval.evaluate import summarize
from medgraph.llm import GenerationConfig, assistant, system, user
from medgraph.llm.hf import SHARED_PREFIX_MIN, PrefixCache, TransformersChatModel, _Row
from medgraph.methods import METHODS, KnowledgeTools, make_config, run_method, trace_rows
from medgraph.qa.item import QaItem
from medgraph.retrieval import Retriever
from medgraph.storage import Warehouse

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = GenerationConfig(max_new_tokens=12)
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?",
               {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}, "A")
FABRY_SEIZURE = QaItem("test", "fabry", "Is Seizure a manifestation of Fabry disease?",
                       {"A": "yes", "B": "no"}, "A")
MECHANISM = QaItem("test", "mechanism", "What is the mechanism of action of amlodipine?", {},
                   "Calcium Channel Antagonists")
# Few steps and tokens (the end-to-end configs of test_methods), Graph-R1 with one more turn: several turns
# each, enough to exercise the cache, cheap enough to run twice.
CONFIGS = {**E2E_CONFIGS, "graph-r1": {**E2E_CONFIGS["graph-r1"], "max_steps": 3}}


@pytest.fixture(scope="module")
def cached(smollm2: TransformersChatModel) -> TransformersChatModel:
    return TransformersChatModel(smollm2.model_dir, name="cached", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def uncached(smollm2: TransformersChatModel) -> TransformersChatModel:
    return TransformersChatModel(smollm2.model_dir, name="uncached", device="cpu", dtype="float32",
                                 prefix_cache=False)


@pytest.fixture(scope="module")
def tools(retrieval_warehouse: Warehouse, encoder) -> Iterator[KnowledgeTools]:
    with Retriever(retrieval_warehouse, encoder) as retriever:
        yield KnowledgeTools(retriever)


def _replies(completions) -> list[tuple[str, int, int, str]]:
    return [(c.text, c.prompt_tokens, c.completion_tokens, c.finish_reason) for c in completions]


def test_the_cache_is_on_by_default_and_can_be_turned_off(cached, uncached):
    assert isinstance(cached.prefix_cache, PrefixCache) and uncached.prefix_cache is None


def test_multi_turn_replies_are_identical_and_later_turns_compute_only_the_new_tokens(cached, uncached):
    cached.clear_prefix_cache()
    # Three conversations that end after 1, 2 and 3 turns: the batch shrinks between calls, and within a
    # call rows end at different decode steps (EOS, the stop string, the budget).
    conversations = {
        "france": [system("You are terse."), user("What is the capital of France?")],
        "kidney": [system("You are terse."), user("Name an organ that filters blood.")],
        "hello": [user("Say hello.")],
    }
    turns = {"france": 1, "kidney": 2, "hello": 3}
    config = GREEDY.but(stop=("\n\n",))
    for turn in range(3):
        names = [n for n in conversations if turns[n] > turn]
        asked = [conversations[n] for n in names]
        with_cache, without = cached.generate(asked, config), uncached.generate(asked, config)
        assert _replies(with_cache) == _replies(without)
        for name, completion, plain in zip(names, with_cache, without, strict=True):
            assert plain.prompt_tokens_computed == plain.prompt_tokens
            if turn == 0:  # only the shared system prompt of an earlier row can be reused
                assert completion.prompt_tokens_computed <= completion.prompt_tokens
            else:  # the whole earlier conversation is cached: the reply's end, the new message, the header
                assert completion.prompt_tokens_computed < completion.prompt_tokens / 2
            conversations[name] = [*conversations[name], assistant(completion.text), user(f"And then? ({turn})")]
    assert cached.prefix_cache.nbytes <= cached.prefix_cache.max_bytes


def test_the_same_prompt_twice_computes_only_its_last_token(cached, uncached):
    conversation = [user("List three colours.")]
    first = cached.generate([conversation], GREEDY)[0]
    second = cached.generate([conversation], GREEDY)[0]
    assert second.prompt_tokens_computed == 1 and second.text == first.text
    assert _replies([second]) == _replies(uncached.generate([conversation], GREEDY))


def test_a_start_shared_by_the_rows_of_one_call_is_computed_once(cached, uncached):
    cached.clear_prefix_cache()
    preamble = system("You are a careful medical assistant. Think briefly, then give the letter of the best "
                      "option only. Never invent options that were not given. " * 2)
    asked = [[preamble, user(question)] for question in
             ("Which organ filters blood?", "Name a drug that may treat hypertension.", "What does insulin regulate?")]
    with_cache = cached.generate(asked, GREEDY)
    assert _replies(with_cache) == _replies(uncached.generate(asked, GREEDY))
    keys = [cached.prefix_cache.key(cached._row(conversation, None)) for conversation in asked]
    shared = min(PrefixCache._common_prefix(keys[0], key) for key in keys[1:])
    assert shared >= SHARED_PREFIX_MIN
    # The preamble once, then each row its own question: what the model ran, and nothing left uncounted.
    sent = sum(c.prompt_tokens for c in with_cache)
    assert sum(c.prompt_tokens_computed for c in with_cache) == sent - 2 * shared
    # GRPO's G copies of one prompt: all but the last token once, then that token per copy.
    cached.clear_prefix_cache()
    copies = cached.generate([asked[0]] * 4, GREEDY)
    assert len({c.text for c in copies}) == 1 and copies[0].text == with_cache[0].text
    assert sum(c.prompt_tokens_computed for c in copies) == copies[0].prompt_tokens - 1 + 4


def test_graph_token_rows_reuse_only_a_prefix_with_the_same_graph_tokens(cached, uncached):
    cached.clear_prefix_cache()
    generator = torch.Generator().manual_seed(0)
    graph, other = (torch.randn(6, cached.hidden_size, generator=generator) * 0.05 for _ in range(2))
    conversation = [system("Answer briefly."), user("Which drug may treat hypertension?")]
    first = cached.generate([conversation], GREEDY, graph_tokens=[graph])[0]
    assert _replies([first]) == _replies(uncached.generate([conversation], GREEDY, graph_tokens=[graph]))
    # The same graph tokens again: everything but the last token is cached, graph tokens included.
    again = cached.generate([conversation], GREEDY, graph_tokens=[graph])[0]
    assert again.prompt_tokens_computed == 1 and again.text == first.text
    # Other graph tokens in the same place: the cache is used only up to them.
    changed = cached.generate([conversation], GREEDY, graph_tokens=[other])[0]
    after_graph = len(cached._row(conversation, other).after)
    assert changed.prompt_tokens_computed == 6 + after_graph
    assert _replies([changed]) == _replies(uncached.generate([conversation], GREEDY, graph_tokens=[other]))
    # A next turn: the graph tokens move to the new last user message; the first turn's text before them is reused.
    longer = [*conversation, assistant(first.text), user("Why?")]
    rows = [longer, conversation]
    batched = cached.generate(rows, GREEDY, graph_tokens=[graph, None])
    assert _replies(batched) == _replies(uncached.generate(rows, GREEDY, graph_tokens=[graph, None]))
    assert batched[0].prompt_tokens_computed < batched[0].prompt_tokens


def test_changed_weights_empty_the_cache(smollm2: TransformersChatModel):
    model = TransformersChatModel(smollm2.model_dir, device="cpu", dtype="float32")
    conversation = [user("Say hello.")]
    model.generate([conversation], GREEDY)
    assert model.generate([conversation], GREEDY)[0].prompt_tokens_computed == 1
    with torch.no_grad():  # an optimizer step updates weights in place
        model.model.get_output_embeddings().weight.mul_(1.0)
    again = model.generate([conversation], GREEDY)[0]
    assert again.prompt_tokens_computed == again.prompt_tokens


def test_the_cache_keeps_to_its_memory_bound_and_drops_superseded_entries():
    def layers(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(1, 2, length, 4), torch.zeros(1, 2, length, 4))]  # 64 bytes per token

    cache = PrefixCache(max_bytes=64 * 25)
    first = cache.key(_Row(list(range(10))))
    cache.add(first, layers(10))
    assert cache.longest_prefix(torch.tensor([*range(8), 99]), 100) == (0, 8)
    cache.add(torch.tensor([*range(10), 10, 11]), layers(12))  # continues the first: that one is redundant
    assert len(cache.entries) == 1 and cache.nbytes == 64 * 12
    cache.add(torch.tensor([50, 51, 52, 53, 54, 55, 56, 57, 58, 59]), layers(10))
    cache.add(torch.tensor([60, 61, 62, 63, 64, 65, 66, 67, 68, 69]), layers(10))  # over the bound: oldest goes
    assert cache.nbytes <= cache.max_bytes and cache.evicted == 1
    assert cache.longest_prefix(torch.tensor([0, 1, 2]), 3) == (None, 0)
    assert cache.longest_prefix(torch.tensor([60, 61, 7]), 3)[1] == 2


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_gives_the_same_answers_with_the_cache_and_computes_fewer_prompt_tokens(
        method: str, tools: KnowledgeTools, cached, uncached):
    config = make_config(method, CONFIGS.get(method, {"max_new_tokens": 16}))
    """Also the end-to-end test of every method on a real model (SmolLM2, few steps and tokens): each runs,
    answers in the items' order, records its steps and tokens, and parses or says it could not."""
    # The agents on a multiple-choice and a short-answer item; the cheap methods on a yes/no item too.
    items = [TREAT, MECHANISM] if method in ("a2rag", "graph-r1", "sema-rag", "irag") else [TREAT, FABRY_SEIZURE, MECHANISM]
    cached.clear_prefix_cache()
    with_cache = run_method(method, items, tools, cached, config, batch_size=len(items))
    without = run_method(method, items, tools, uncached, config, batch_size=len(items))
    assert [r.qid for r in with_cache] == [item.qid for item in items]
    for result in with_cache:
        assert result.steps and result.method == method
        assert result.completion_tokens > 0 and result.latency_s > 0
        assert result.parse_failed == (result.prediction is None)
        assert any(step.output for step in result.steps)
    assert len(trace_rows(with_cache)) == sum(len(r.steps) for r in with_cache)
    for a, b in zip(with_cache, without, strict=True):
        assert [(s.action, s.output, s.prompt_tokens, s.completion_tokens) for s in a.steps] == [
            (s.action, s.output, s.prompt_tokens, s.completion_tokens) for s in b.steps]
        assert (a.prediction, a.correct) == (b.prediction, b.correct)
        assert b.prompt_tokens_computed == b.prompt_tokens
        assert a.prompt_tokens_computed <= a.prompt_tokens
    computed, sent = sum(r.prompt_tokens_computed for r in with_cache), sum(r.prompt_tokens for r in with_cache)
    if method in ("a2rag", "graph-r1", "sema-rag"):  # turns extend conversations or share long system prompts
        assert computed < sent * 0.8
    (summary,) = summarize(with_cache)
    assert summary.prompt_tokens_computed == pytest.approx(computed / len(items))


def test_each_method_run_starts_with_an_empty_cache_so_its_computed_tokens_are_its_own(
        tools: KnowledgeTools, cached):
    """An ablation evaluated after its full method sends largely the same prompts; reusing them would credit
    the ablation with the full method's prefill (its computed tokens and latency)."""
    items = [TREAT, FABRY_SEIZURE]
    config = make_config("rag", CONFIGS.get("rag", {"max_new_tokens": 16}))
    first = run_method("rag", items, tools, cached, config, batch_size=len(items))
    second = run_method("rag", items, tools, cached, config, batch_size=len(items))
    # Reused, the second run's identical prompts would cost one token each.
    assert [r.prompt_tokens_computed for r in second] == [r.prompt_tokens_computed for r in first]
    assert all(r.prompt_tokens_computed > 1 for r in second)
