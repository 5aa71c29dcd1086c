"""Graph-R1 policy training: masks, rewards, the GRPO objective, SFT demonstrations, checkpoints,
a learning test on a tiny model, and the two assets with the real SmolLM2.

The learning test uses a 2-layer Llama (hidden size 64) with SmolLM2's tokenizer on a fixed
problem: yes/no questions whose answer is always "A", after a cold start on demonstrations that
answer A and B equally often. Only the reward can teach the preference, so a rising mean reward
is GRPO working (rollouts, masks, advantages, the update), not SFT.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import dagster as dg
import pytest
import torch
from conftest import TEST_ENCODER, copy_warehouse

from medgraph.llm.base import GenerationConfig, assistant, system, user
from medgraph.llm.hf import TransformersChatModel, cpu_has_bf16
from medgraph.llm.lora import frozen_linears_in_bf16
from medgraph.methods.graph_r1 import GraphR1Config, GraphR1Env, GraphR1State
from medgraph.methods.registry import make_config, method_of
from medgraph.qa.generate import generate_qa_items
from medgraph.qa.item import QaItem
from medgraph.qa.table import load_qa_items
from medgraph.retrieval import Retriever
from medgraph.rl import grpo
from medgraph.rl.grpo import (
    GRPO_PROFILES,
    SMALL_ENV,
    TINY_ENV,
    GrpoConfig,
    _final_metrics,
    clipped_objective,
    group_advantages,
    grpo_token_loss,
    grpo_update,
    k3_kl,
    loss_weights,
    split_minibatches,
    train_grpo,
)
from medgraph.rl.model import (
    LoraSettings,
    latest_checkpoint,
    lora_of,
    load_trainable,
    make_batch,
    save_policy,
    token_logprobs,
    trainable_parameters,
)
from medgraph.rl.policy import (
    VALIDATION_KEY_TAG,
    base_model_baseline,
    choose_policy,
    load_champion_policy,
    load_chosen_policy,
    policy_environment,
    recorded_validation,
    sft_start_baseline,
)
from medgraph.rl.rewards import episode_reward
from medgraph.rl.rollout import (
    EncodedConversation,
    Trajectory,
    encode_conversation,
    evaluate,
    generation_config,
    rollout,
    validation_key,
)
from medgraph.rl.scale import VllmRollouts
from medgraph.rl.sft import SftConfig, drawn_batches, expert_demonstrations, lr_factor, micro_batches, train_sft
from medgraph.storage import Warehouse
from medgraph.tracking import GRAPH_R1_POLICY_MODEL, GRAPH_R1_SFT_MODEL, Tracking
from platform_assets.policy import GraphR1PolicyConfig, GraphR1SftConfig, graph_r1_policy, graph_r1_sft
from resources import EncoderResource, LlmResource, MlflowResource, TrainingResource, WarehouseResource

HYPERTENSION = "C0020538"
TREAT = QaItem("test", "treat", "Which of the following may treat Hypertension?",
               {"A": "amlodipine", "B": "salbutamol", "C": "insulin", "D": "aspirin"}, "A")
MECHANISM = QaItem("test", "mechanism", "What is the mechanism of action of amlodipine?", {},
                   "Calcium Channel Antagonists", acceptable_answers=("Calcium Channel Antagonists",))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qa_warehouse(retrieval_warehouse: Warehouse, tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    warehouse = copy_warehouse(retrieval_warehouse, tmp_path_factory.mktemp("rl") / "home")
    generate_qa_items(warehouse, warehouse.path.parent / "qa", per_type=30)
    return warehouse


@pytest.fixture(scope="module")
def retriever(qa_warehouse: Warehouse, encoder) -> Iterator[Retriever]:
    with Retriever(qa_warehouse, encoder) as retriever:
        yield retriever


def finished(env: GraphR1Env, item: QaItem, replies: list[str]) -> GraphR1State:
    state = env.reset(item)
    for reply in replies:
        env.step(state, reply)
    return state


# --------------------------------------------------------------------------- token masks


def test_masks_hold_exactly_the_policy_replies_and_match_the_rollout_prompts(retriever: Retriever, smollm2):
    env = GraphR1Env(retriever, GraphR1Config(max_steps=4, traverse_limit=5))
    replies = ["<think>find it</think><search>hypertension</search>",
               f"<think>its edges</think><traverse>{HYPERTENSION}</traverse>",
               "<think>amlodipine</think><answer>A</answer>"]
    state = finished(env, TREAT, replies)
    encoded = encode_conversation(smollm2.tokenizer, state.messages, smollm2.eos_ids)
    assert len(encoded.ids) == len(encoded.mask)

    # The policy's tokens are its replies, each closed by the end-of-turn token, and nothing else.
    policy_ids = [t for t, m in zip(encoded.ids, encoded.mask, strict=True) if m]
    end = smollm2.tokenizer.decode([smollm2.eos_ids[0]])
    assert smollm2.tokenizer.decode(policy_ids) == "".join(r + end for r in replies)
    spans, start = [], None
    for i, m in enumerate([*encoded.mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(smollm2.tokenizer.decode(encoded.ids[start:i]))
            start = None
    assert spans == [r + end for r in replies]
    masked = smollm2.tokenizer.decode([t for t, m in zip(encoded.ids, encoded.mask, strict=True) if not m])
    assert "<observation>" in masked and "Hypertension" in masked and "amlodipine" in masked

    # Exact alignment: the context before each reply is token for token what generation was given.
    turn = 0
    for k, message in enumerate(state.messages):
        if message.role == "assistant":
            prompt = smollm2._encode(smollm2.render(state.messages[:k]))
            assert encoded.ids[:len(prompt)] == prompt
            assert encoded.mask[len(prompt) - 1] == 0 and encoded.mask[len(prompt)] == 1  # the reply starts here
            turn += 1
    assert turn == 3


def test_a_template_that_rewrites_history_is_refused():
    class DropsThoughts:
        """A template that shows earlier replies without their thoughts (as some reasoning models do)."""

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            shown = [m["content"] if m["role"] != "assistant" or i == last and not add_generation_prompt
                     else m["content"].split("</think>")[-1] for i, m in enumerate(messages)]
            return "|".join(shown) + ("|" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    messages = [system("s"), user("q"), assistant("<think>a</think><search>x</search>"), user("o"),
                assistant("<think>b</think><answer>A</answer>")]
    with pytest.raises(ValueError, match="prefix"):
        encode_conversation(DropsThoughts(), messages, [0])


# --------------------------------------------------------------------------- rewards


def state_of(item: QaItem, answer: str | None, well_formed: list[bool]) -> GraphR1State:
    return GraphR1State(item=item, messages=[], turns=len(well_formed), well_formed=well_formed, answer=answer,
                        done=True, truncated=answer is None)


@pytest.mark.parametrize("item, answer, well_formed, paper, authors", [
    (TREAT, "A", [True, True], 1.1, 1.0),  # right and well formed
    (TREAT, "(A)", [True], 1.1, 1.0),  # the letter is read tolerantly
    (TREAT, "B", [True, True], 0.1, 0.0),  # wrong: only the format counts
    (TREAT, "A", [True, False], 1.0, -1.0),  # right but one ill-formed reply: the authors give nothing
    (TREAT, None, [True, True, True], 0.0, -1.0),  # ran out of turns
    (MECHANISM, "calcium channel antagonists", [True], 1.1, 1.0),  # normalized exact match
    (MECHANISM, "calcium channel blockers", [True], 2 / 3 + 0.1, 2 / 3),  # F1: 2 of 3 words in common
])
def test_reward_is_accuracy_plus_format_and_the_authors_variant(item, answer, well_formed, paper, authors):
    state = state_of(item, answer, well_formed)
    assert episode_reward(state, "paper").total == pytest.approx(paper)
    assert episode_reward(state, "authors").total == pytest.approx(authors)
    assert episode_reward(state).format == float(all(well_formed) and answer is not None)
    with pytest.raises(ValueError, match="variant"):
        episode_reward(state, "other")


# --------------------------------------------------------------------------- the GRPO objective


def test_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([[1.1, 0.1, 0.1, 0.1], [0.5, 0.5, 0.5, 0.5], [0.0, 1.0, 0.2, 0.7]])
    advantages = group_advantages(rewards)
    torch.testing.assert_close(advantages.mean(dim=1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(advantages[[0, 2]].std(dim=1, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)
    assert advantages[1].eq(0).all()  # a flat group carries no signal
    assert advantages[0, 0] > 0 > advantages[0, 1]


def test_ratio_clipping_stops_the_gradient_beyond_one_plus_or_minus_epsilon():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    objective, clipped = clipped_objective(logp, old, advantages, epsilon=0.2)
    assert clipped.tolist() == [True, False, True, False]
    torch.testing.assert_close(objective.detach(), torch.tensor([1.2, 1.1, -0.8, -0.9]))
    objective.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[2] == 0  # clipped: no push further out
    assert logp.grad[1] > 0 and logp.grad[3] < 0


def test_k3_kl_is_nonnegative_and_zero_when_the_policy_is_the_reference():
    generator = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(1000, generator=generator) * 5, -torch.rand(1000, generator=generator) * 5
    assert (k3_kl(logp, ref) >= 0).all() and k3_kl(logp, logp).eq(0).all()
    # With ratio 1 and no KL, the loss is -A per token; the KL term adds beta * k3.
    advantages = torch.tensor([[2.0]])
    loss, _, _ = grpo_token_loss(logp[None, :3], logp[None, :3], ref[None, :3], advantages, 0.2, 0.1)
    torch.testing.assert_close(loss, -2.0 + 0.1 * k3_kl(logp[None, :3], ref[None, :3]))


def test_loss_weights_average_per_episode_or_per_token():
    assert sum(w * n for w, n in zip(loss_weights([2, 6], token_level=True), [2, 6], strict=True)) == pytest.approx(1)
    per_episode = loss_weights([2, 6], token_level=False)
    assert per_episode[0] * 2 == pytest.approx(0.5) and per_episode[1] * 6 == pytest.approx(0.5)


def test_the_cosine_schedule_warms_up_then_decays_to_a_tenth_and_constant_stays_put():
    cosine = SftConfig(steps=10, lr_schedule="cosine", warmup_share=0.2)
    factors = [lr_factor(step, cosine) for step in range(1, 11)]
    assert factors[:2] == [0.5, 1.0]  # warm-up reaches the full rate on its last step
    assert all(a > b for a, b in itertools.pairwise(factors[1:]))  # then only decays ...
    assert factors[-1] == pytest.approx(0.1)  # ... to a tenth at the last step
    assert {lr_factor(step, SftConfig(steps=10)) for step in range(1, 11)} == {1.0}
    with pytest.raises(ValueError, match="lr_schedule"):
        SftConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match="warmup_share"):
        SftConfig(lr_schedule="cosine", warmup_share=1.0)
    short = SftConfig(steps=5, lr_schedule="cosine", warmup_share=0.1)  # fewer steps than would warm up: none do
    assert lr_factor(1, short) == 1.0 and lr_factor(5, short) == pytest.approx(0.1)


def test_sft_batches_go_through_every_example_once_per_epoch_and_repeat_with_the_seed():
    batches = list(itertools.islice(drawn_batches(10, 4, seed=3), 5))  # 20 draws: two epochs of 10
    assert [len(batch) for batch in batches] == [4] * 5
    draws = [i for batch in batches for i in batch]
    assert sorted(draws[:10]) == sorted(draws[10:]) == list(range(10)) and draws[:10] != draws[10:]
    assert batches == list(itertools.islice(drawn_batches(10, 4, seed=3), 5))
    assert batches != list(itertools.islice(drawn_batches(10, 4, seed=4), 5))
    assert sorted(next(drawn_batches(3, 8, seed=0))) == [0, 1, 2]  # fewer examples than a batch: each once


def test_batches_of_like_lengths_still_draw_every_example_once_per_epoch_with_less_padding():
    lengths = [random.Random(i).choice([60, 120, 400, 900]) for i in range(64)]

    def padded(batches: list[list[int]]) -> int:
        return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)

    plain = list(itertools.islice(drawn_batches(64, 8, seed=3), 8))  # one epoch
    grouped = list(itertools.islice(drawn_batches(64, 8, seed=3, lengths=lengths, groups=4), 8))
    assert sorted(i for batch in grouped for i in batch) == list(range(64)) and {len(b) for b in grouped} == {8}
    assert padded(grouped) < 0.8 * padded(plain)
    assert grouped == list(itertools.islice(drawn_batches(64, 8, seed=3, lengths=lengths, groups=4), 8))
    assert list(itertools.islice(drawn_batches(64, 8, seed=3, lengths=lengths, groups=0), 8)) == plain


@pytest.mark.parametrize("profile", sorted(GRPO_PROFILES))
def test_every_profile_updates_in_at_least_two_minibatches_per_rollout_batch(profile: str):
    """Graph-R1's released training takes mini-batches of 64 from a batch of 128: with one mini-batch
    the ratio is 1 and the clip never acts. Two also when flat groups are skipped and one group is left."""
    config = GRPO_PROFILES[profile]
    episodes = config.questions_per_step * config.group_size
    for n in (episodes, config.group_size):
        minibatches = split_minibatches(n, config.minibatches)
        assert len(minibatches) >= 2 and all(minibatches)
        assert sorted(i for mini in minibatches for i in mini) == list(range(n))
    assert {i // config.group_size for i in split_minibatches(episodes, config.minibatches)[0]} == set(
        range(config.questions_per_step))  # round-robin: every group in every mini-batch


# --------------------------------------------------------------------------- cold-start demonstrations


def test_expert_demonstrations_walk_the_gold_path_and_answer_correctly(qa_warehouse: Warehouse, retriever: Retriever):
    env = GraphR1Env(retriever, GraphR1Config(max_steps=6, traverse_limit=10))
    items = load_qa_items(qa_warehouse, "train")
    assert items and all(i.extra["question_type"] for i in items)
    demos = expert_demonstrations(env, items)
    assert len(demos.states) >= len(items) // 2, demos.dropped
    # Every kind of question the generator asks gets demonstrations, 2-hop MC included.
    assert {s.item.extra["question_type"] for s in demos.states} == {i.extra["question_type"] for i in items}
    assert {"mc", "mc_2hop", "yesno", "short_1hop", "short_2hop"} <= {i.extra["question_type"] for i in items}
    for state in demos.states:
        assert all(state.well_formed) and episode_reward(state).correct
        assert state.actions[0] == "search" and state.actions[-1] == "answer" and "analyze" in state.actions
        # Every concept the expert names was in an observation before it used it.
        seen = ""
        for message in state.messages[2:]:
            if message.role == "user":
                seen += message.content
            elif "<traverse>" in message.content or "<analyze>" in message.content:
                cui = message.content.split(">")[-2].split("<")[0]
                assert cui in seen, (state.item.qid, cui)


def test_policy_training_draws_only_the_named_datasets(qa_warehouse: Warehouse):
    """`datasets` (asset config -> SftConfig / GrpoConfig -> load_qa_items) keeps the questions of those datasets only,
    train and validation alike; unset, every dataset. A seeded sample draws from the filtered questions."""
    everything = load_qa_items(qa_warehouse, "train")
    assert {"kgqa_mc", "kgqa_short", "kgqa_yesno"} <= {i.dataset for i in everything}
    mc = load_qa_items(qa_warehouse, "train", datasets=("kgqa_mc",))
    assert mc == [i for i in everything if i.dataset == "kgqa_mc"]
    sample = load_qa_items(qa_warehouse, "validation", 3, seed=1, datasets=("kgqa_mc", "kgqa_yesno"))
    assert len(sample) == 3 and {i.dataset for i in sample} <= {"kgqa_mc", "kgqa_yesno"}
    sft = GraphR1SftConfig(datasets=["kgqa_mc"]).sft_config("tiny")
    grpo = GraphR1PolicyConfig(datasets=["kgqa_mc"]).grpo_config("tiny")
    assert sft.datasets == grpo.datasets == ("kgqa_mc",) and sft.as_dict()["datasets"] == ("kgqa_mc",)
    assert GraphR1SftConfig().sft_config("tiny").datasets is None


# --------------------------------------------------------------------------- a tiny model that learns


def test_a_right_padded_batch_scores_each_row_as_it_scores_alone(tiny_llm_dir: Path):
    """token_logprobs passes no padding mask (the causal mask alone, for speed): every scored position of a
    right-padded row gets what the row gets alone, and pads change nothing, in float32 and under bf16 autocast."""
    chat = TransformersChatModel(tiny_llm_dir, device="cpu", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length, reply in ((9, 3), (23, 5), (16, 4)):
        ids = torch.randint(0, 1000, (length,), generator=generator).tolist()
        rows.append(EncodedConversation(ids, [0] * (length - reply) + [1] * reply))
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.no_grad():
            batch = make_batch(rows, chat.pad_id, "cpu")
            together = token_logprobs(chat.model, batch)
            for i, row in enumerate(rows):
                alone_batch = make_batch([row], chat.pad_id, "cpu")
                alone = token_logprobs(chat.model, alone_batch)[0]
                scored = together[i][batch.mask[i].bool()]
                assert len(scored) == int(alone_batch.mask.sum())
                torch.testing.assert_close(scored, alone[alone_batch.mask[0].bool()],
                                           atol=0.02 if bf16 else 1e-5, rtol=0)


def test_micro_batches_hold_a_token_budget_and_a_long_row_goes_alone():
    lengths = [100, 150, 300, 500, 900, 1200, 2500]  # sorted, as fit_replies sorts a batch
    assert micro_batches(lengths, 2) == [[0, 1], [2, 3], [4, 5], [6]]
    budgeted = micro_batches(lengths, 8, tokens=1024)
    assert budgeted == [[0, 1, 2], [3], [4], [5], [6]]  # 3 x 300 = 900 fits; 4 x 500 does not
    assert all(len(group) * max(lengths[i] for i in group) <= 1024 for group in budgeted if len(group) > 1)
    assert sorted(i for group in budgeted for i in group) == list(range(len(lengths)))  # every row, once


def test_lora_updates_in_one_addmm_train_as_peft_s_own_forward(tiny_llm_dir: Path):
    """`fuse_lora_updates` (what load_trainable ships) against PEFT's forward: the same logits before training,
    and the same loss at every one of 20 LoRA steps, in float32 and under bf16 autocast."""
    from medgraph.rl.sft import fit_replies

    generator = torch.Generator().manual_seed(0)
    encoded = []
    for length in (12, 20, 9, 31, 17, 25, 14, 22):
        ids = torch.randint(0, 1000, (length,), generator=generator).tolist()
        encoded.append(EncodedConversation(ids, [0] * (length - 4) + [1] * 4))
    for bf16 in (False, True):
        config = SftConfig(steps=20, batch_size=4, micro_batch_size=2, lr=1e-2, lora_r=8, lora_alpha=16,
                           device="cpu", bf16=bf16)
        fused = load_trainable(tiny_llm_dir, lora=lora_of(config), device="cpu")
        peft_own = load_trainable(tiny_llm_dir, lora=lora_of(config), device="cpu")
        for module in peft_own.model.modules():  # back to PEFT's own class
            if type(module).__name__ == "AddmmLoraLinear":
                module.__class__ = type(module).__mro__[1]
        assert type(next(m for m in fused.model.modules() if hasattr(m, "lora_A"))).__name__ == "AddmmLoraLinear"
        with torch.no_grad():
            batch = make_batch(encoded[:2], fused.pad_id, "cpu")
            torch.testing.assert_close(token_logprobs(fused.model, batch), token_logprobs(peft_own.model, batch))
        fused_history, _ = fit_replies(fused, encoded, config)
        peft_history, _ = fit_replies(peft_own, encoded, config)
        fused_loss = torch.tensor([h["train_nll"] for h in fused_history])
        peft_loss = torch.tensor([h["train_nll"] for h in peft_history])
        assert float(peft_loss[-1]) < float(peft_loss[0])  # it trains
        torch.testing.assert_close(fused_loss, peft_loss, rtol=0.02 if bf16 else 1e-4, atol=0)


@pytest.mark.skipif(not cpu_has_bf16(), reason="bf16 autocast on the CPU needs AVX512-BF16 or AMX")
def test_a_fit_with_bf16_frozen_weights_is_the_fit_with_float32_ones(tiny_llm_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """What `fit_replies` ships under bf16 autocast (frozen Linear weights stored in bf16) against the same fit
    with the float32 weights autocast casts at every use: the same loss at each of 20 LoRA steps, the same
    adapter, and the float32 base weights back afterwards (merging and evaluation read them)."""
    from medgraph.rl import sft

    generator = torch.Generator().manual_seed(0)
    encoded = [EncodedConversation(ids := torch.randint(0, 1000, (n,), generator=generator).tolist(),
                                   [0] * (len(ids) - 4) + [1] * 4) for n in (12, 20, 9, 31, 17, 25, 14, 22)]
    config = SftConfig(steps=20, batch_size=4, micro_batch_size=2, lr=1e-2, lora_r=8, lora_alpha=16, device="cpu")
    shipped = load_trainable(tiny_llm_dir, lora=lora_of(config), device="cpu")
    float32 = load_trainable(tiny_llm_dir, lora=lora_of(config), device="cpu")
    base = {name: p for name, p in shipped.model.named_parameters() if not p.requires_grad}
    def frozen_dtypes(chat: TransformersChatModel, seen: set) -> Callable:
        """A log_fn noting the dtype of the frozen query projections at each step."""
        return lambda step, record: seen.update(m.weight.dtype for name, m in chat.model.named_modules()
                                                 if name.endswith("q_proj.base_layer"))

    shipped_dtypes, reference_dtypes = set(), set()
    history, _ = sft.fit_replies(shipped, encoded, config, frozen_dtypes(shipped, shipped_dtypes))
    with monkeypatch.context() as patch:  # the same fit, still under bf16 autocast, with the float32 weights
        patch.setattr(sft, "autocasts_to_bf16", lambda *args, **kwargs: False)
        reference, _ = sft.fit_replies(float32, encoded, config, frozen_dtypes(float32, reference_dtypes))

    assert shipped_dtypes == {torch.bfloat16} and reference_dtypes == {torch.float32}
    assert [h["train_nll"] for h in history] == [h["train_nll"] for h in reference]
    assert history[-1]["train_nll"] < history[0]["train_nll"]
    for (name, trained), (_, expected) in zip(shipped.model.named_parameters(), float32.model.named_parameters(),
                                              strict=True):
        assert trained.dtype == torch.float32, name
        if name in base:
            assert trained is base[name]  # the very float32 tensors, untouched
        else:
            torch.testing.assert_close(trained, expected, rtol=0, atol=0)
    with frozen_linears_in_bf16(shipped.model) as changed:
        assert changed == 7 * shipped.model.config.num_hidden_layers  # attention and MLP projections; not the LM head


TOY_ENV = GraphR1Env(None, GraphR1Config(actions=(), max_steps=2, max_new_tokens=16))  # answers only: no retriever
TOY = [QaItem("toy", f"q{i}", f"Is {term} a medical term?", {"A": "yes", "B": "no"}, "A")
       for i, term in enumerate(["fever", "cough", "asthma", "anemia", "gout", "acne"])]


@pytest.fixture(scope="module")
def tiny_sft_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught the answer format on demonstrations that say A and B equally often."""
    demos = [finished(TOY_ENV, item, [f"<think>check</think><answer>{'AB'[i % 2]}</answer>"])
             for i, item in enumerate(TOY)]
    config = SftConfig(steps=100, batch_size=4, micro_batch_size=4, lr=3e-3, graph_r1=TOY_ENV.config, device="cpu",
                       bf16=False)  # bf16 pays off for wide matmuls, not for a 64-wide model
    result = train_sft(tiny_llm_dir, demos, config)
    assert result.metrics["train_nll_last"] < 0.2 < result.metrics["train_nll_first"]
    return save_policy(result.policy, tmp_path_factory.mktemp("tiny_sft") / "policy")


def mean_reward(policy: TransformersChatModel) -> dict[str, float]:
    return rollout(policy, TOY_ENV, TOY, 8, generation_config(16, temperature=1.0, seed=123)).stats


TINY_GRPO = GrpoConfig(steps=6, questions_per_step=2, group_size=8, micro_batch_size=16, lr=1e-3, beta=0.02,
                       graph_r1=TOY_ENV.config, device="cpu", bf16=False, valid_items=0)


def test_a_few_grpo_steps_raise_the_mean_reward(tiny_sft_dir: Path):
    before = mean_reward(TransformersChatModel(tiny_sft_dir, device="cpu"))
    result = train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], TINY_GRPO)
    after = mean_reward(result.policy)
    print(f"tiny GRPO: mean reward {before['reward']:.3f} -> {after['reward']:.3f} "
          f"(accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, 48 samples, seed 123)")
    assert before["format_rate"] > 0.5  # the cold start taught the format; the answer is a coin flip
    assert after["reward"] > before["reward"] + 0.15
    assert result.history[0]["policy_tokens"] > 0 and any(h["kl"] > 0 for h in result.history)


def test_the_second_minibatch_is_off_policy_and_its_clipped_tokens_pass_no_gradient(tiny_sft_dir: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    """One `grpo_update` with the default mini-batches and a large step: the first mini-batch is scored at
    ratio 1, the second against the policy before the first update; there the ratio leaves [1 - eps, 1 + eps],
    the clipped term is the minimum and the gradient through those tokens is zero (beta 0: no KL gradient)."""
    policy = load_trainable(tiny_sft_dir, device="cpu")
    replies = ["<think>check</think><answer>A</answer>"] * 2 + ["<think>check</think><answer>B</answer>"] * 2
    trajectories = [Trajectory(state, group, episode_reward(state), 0)
                    for group, item in enumerate(TOY[:2]) for state in [finished(TOY_ENV, item, [r]) for r in replies]]
    advantages = group_advantages(torch.tensor([[t.reward.total for t in trajectories]]).view(2, 4)).flatten()
    for trajectory, advantage in zip(trajectories, advantages.tolist(), strict=True):
        trajectory.advantage = advantage
    config = GrpoConfig(micro_batch_size=16, lr=1e-2, beta=0.0, graph_r1=TOY_ENV.config, device="cpu", bf16=False)
    calls: list[dict[str, torch.Tensor]] = []

    def recording(logp, old_logp, ref_logp, advantages, epsilon, beta):
        loss, kl, clipped = grpo_token_loss(logp, old_logp, ref_logp, advantages, epsilon, beta)
        call = {"ratio": torch.exp(logp.detach() - old_logp), "clipped": clipped}
        logp.register_hook(lambda grad: call.__setitem__("grad", grad.clone()))  # d loss / d logp, per token
        calls.append(call)
        return loss, kl, clipped

    monkeypatch.setattr(grpo, "grpo_token_loss", recording)
    optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=config.lr)
    update = grpo_update(policy, policy.model, None, trajectories, optimizer, config)
    assert len(calls) == 2  # one micro-batch per mini-batch, one optimizer step each
    first, second = calls
    torch.testing.assert_close(first["ratio"], torch.ones_like(first["ratio"]))  # the sampling policy itself
    assert not first["clipped"].any()
    clipped = second["clipped"]
    assert clipped.any() and update["clip_fraction"] > 0
    ratio = second["ratio"][clipped]
    assert ((ratio > 1 + config.epsilon) | (ratio < 1 - config.epsilon)).all()
    assert second["grad"][clipped].eq(0).all()  # the clipped term is constant in logp
    assert second["grad"][~clipped].abs().sum() > 0  # the unclipped policy tokens still learn


def test_a_fresh_lora_engine_validates_exactly_as_the_merged_checkpoint(tiny_sft_dir: Path):
    """Why GRPO may take its SFT start's validation: the SFT asset validates the merged checkpoint, and GRPO's
    step-0 engine (that checkpoint plus a zero-initialized LoRA adapter) gives the same greedy episodes."""
    merged = TransformersChatModel(tiny_sft_dir, device="cpu", dtype="float32")
    engine = load_trainable(tiny_sft_dir, lora=LoraSettings(8, 16, 0), device="cpu")
    recorded, fresh = evaluate(merged, TOY_ENV, TOY), evaluate(engine, TOY_ENV, TOY)
    timing = ("seconds", "tokens_per_second")
    assert {k: v for k, v in recorded.items() if k not in timing} == {k: v for k, v in fresh.items() if k not in timing}


def test_training_resumes_from_its_checkpoint_exactly(tiny_sft_dir: Path, tmp_path: Path):
    config = replace(TINY_GRPO, steps=2, checkpoint_every=1)
    straight = train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], config)
    train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], replace(config, steps=1), checkpoint_dir=tmp_path)  # "interrupted" after step 1
    (tmp_path / ".step-000002.abandoned.tmp").mkdir()  # a save that died half-way is ignored
    assert latest_checkpoint(tmp_path).name == "step-000001"
    resumed = train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], config, checkpoint_dir=tmp_path)
    assert [h["step"] for h in resumed.history] == [1, 2]
    assert resumed.history[1]["reward"] == straight.history[1]["reward"]
    for a, b in zip(straight.policy.model.parameters(), resumed.policy.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert latest_checkpoint(tmp_path).name == "step-000002" and not (tmp_path / "step-000001").exists()
    assert {p.name for p in (tmp_path / "step-000002").iterdir()} == {"policy", "optimizer.pt", "state.json"}


def test_a_fresh_lora_adapter_is_the_same_whatever_ran_before_in_the_process(tiny_sft_dir: Path):
    """`make demo` trains every model in one process: an adapter drawn from the process's random state would
    differ from the one the same asset trains when materialized alone."""
    first = load_trainable(tiny_sft_dir, lora=LoraSettings(r=2, alpha=4), device="cpu")
    torch.rand(1000)  # what an earlier asset drew
    state = torch.random.get_rng_state()
    second = load_trainable(tiny_sft_dir, lora=LoraSettings(r=2, alpha=4), device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    lora_a = [(a, b) for (name, a), b in zip(first.model.named_parameters(), second.model.parameters(), strict=True)
              if "lora_A" in name]
    assert lora_a and all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in lora_a)
    reseeded = load_trainable(tiny_sft_dir, lora=LoraSettings(r=2, alpha=4, seed=1), device="cpu")
    assert not torch.equal(next(p for n, p in reseeded.model.named_parameters() if "lora_A" in n), lora_a[0][0])


@pytest.mark.filterwarnings("error:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("lora_r", [0, 2], ids=["full", "lora"])
def test_activation_checkpointing_trains_the_same_policy(tiny_sft_dir: Path, lora_r: int):
    """The `full` profile checkpoints activations (GPU memory); it must recompute, not change, the update."""
    config = replace(TINY_GRPO, steps=1, lora_r=lora_r, lora_alpha=2 * lora_r, lora_layers=1)
    plain = train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], config)
    checkpointed = train_grpo(tiny_sft_dir, TOY_ENV, TOY, [], replace(config, gradient_checkpointing=True))
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.policy.model.modules())
    assert checkpointed.history[0]["reward"] == plain.history[0]["reward"]  # same rollouts
    changed = 0
    for (name, a), b in zip(plain.policy.model.named_parameters(), checkpointed.policy.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
        changed += a.requires_grad
    assert changed > 0


# --------------------------------------------------------------------------- vLLM rollouts


def test_vllm_rollouts_publish_each_adapter_and_unload_the_previous(tiny_llm_dir: Path, tmp_path: Path):
    posts: list[tuple[str, dict]] = []

    class Server(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((self.path, body))
            reply = {"choices": [{"message": {"content": f"<think>x</think><answer>{body.get('model')}"},
                                  "finish_reason": "stop"}]} if self.path.endswith("completions") else {}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from medgraph.rl.model import LoraSettings, load_trainable

        policy = load_trainable(tiny_llm_dir, lora=LoraSettings(r=2, alpha=4), device="cpu")
        engine = VllmRollouts(f"openai:base@http://127.0.0.1:{server.server_port}/v1", tmp_path)
        engine.sync(policy, 1)
        engine.sync(policy, 2)
        reply = engine.generate([[user("q")]], GenerationConfig(max_new_tokens=8, stop=("</answer>",)))[0]
    finally:
        server.shutdown()
    assert [(p, b.get("lora_name")) for p, b in posts[:3]] == [
        ("/v1/load_lora_adapter", "policy-step-000001"), ("/v1/load_lora_adapter", "policy-step-000002"),
        ("/v1/unload_lora_adapter", "policy-step-000001")]
    assert (tmp_path / "policy-step-000002" / "adapter_config.json").is_file()
    assert reply.text.endswith("policy-step-000002")  # rollouts ask for the newest adapter


# --------------------------------------------------------------------------- champion gates and policy choice


def register_policy(tracking: Tracking, name: str, **metrics: float) -> str:
    """A registered version of `name` whose run holds `metrics` (the weights do not matter to the gate)."""
    import mlflow

    with tracking.start_run(name):
        mlflow.log_metrics(metrics)
        uri = tracking.log_torch_model(torch.nn.Linear(2, 1))
    return tracking.register(uri, name)


def grpo_metrics(start: tuple[float, float], end: tuple[float, float]) -> dict[str, float]:
    """`train_grpo`'s final metrics for a run validated at step 0 (the SFT start) and at its end."""
    curves = {"reward": 0.2, "format_rate": 1.0, "kl": 0.01, "step_seconds": 1.0, "rollout_tokens_per_s": 10.0,
              "update_seconds": 0.5}
    return _final_metrics([{"step": 0, "valid_reward": start[0], "valid_accuracy": start[1]},
                           {"step": 1, **curves, "valid_reward": end[0], "valid_accuracy": end[1]}])


def test_grpo_gate_refuses_a_first_policy_worse_than_its_sft_start_and_accepts_a_better_one(mlflow_db: Path,
                                                                                          tmp_path: Path):
    tracking = Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))
    # The demo's first policy: validation reward 0.157 below its SFT start's 0.175, accuracy 0.
    demo = grpo_metrics(start=(0.175, 0.125), end=(0.157, 0.0))
    version = register_policy(tracking, GRAPH_R1_POLICY_MODEL.name, **{k: v for k, v in demo.items() if "start" not in k})
    decision = tracking.promote_if_better(GRAPH_R1_POLICY_MODEL.name, version, GRAPH_R1_POLICY_MODEL.gate,
                                          baseline=sft_start_baseline(demo, "models:/m-sft"))
    assert not decision.promoted and tracking.champion_version(GRAPH_R1_POLICY_MODEL.name) is None
    assert decision.baseline_name == "SFT start models:/m-sft" and decision.baseline_value == 0.175
    assert decision.compared == {"valid_reward": (pytest.approx(0.157), 0.175), "valid_accuracy": (0.0, 0.125)}

    better = grpo_metrics(start=(0.175, 0.125), end=(0.3, 0.125))
    version = register_policy(tracking, GRAPH_R1_POLICY_MODEL.name, **{k: v for k, v in better.items() if "start" not in k})
    decision = tracking.promote_if_better(GRAPH_R1_POLICY_MODEL.name, version, GRAPH_R1_POLICY_MODEL.gate,
                                          baseline=sft_start_baseline(better, "models:/m-sft"))
    assert decision.promoted and tracking.champion_version(GRAPH_R1_POLICY_MODEL.name) == version


def test_sft_gate_refuses_a_first_policy_worse_than_the_base_model_and_accepts_a_better_one(mlflow_db: Path,
                                                                                          tmp_path: Path):
    tracking = Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))
    base = base_model_baseline({"reward": 0.1, "accuracy": 0.25, "format_rate": 0.5}, "smollm2-135m-instruct")
    assert base.values == {"valid_reward": 0.1, "valid_accuracy": 0.25}  # `evaluate` keys, as the SFT asset logs them
    worse = register_policy(tracking, GRAPH_R1_SFT_MODEL.name, valid_reward=0.09, valid_accuracy=0.5)
    decision = tracking.promote_if_better(GRAPH_R1_SFT_MODEL.name, worse, GRAPH_R1_SFT_MODEL.gate, baseline=base)
    assert not decision.promoted and decision.as_metadata()["baseline_name"] == "base model smollm2-135m-instruct"
    assert tracking.champion_version(GRAPH_R1_SFT_MODEL.name) is None
    better = register_policy(tracking, GRAPH_R1_SFT_MODEL.name, valid_reward=0.2, valid_accuracy=0.25)
    assert tracking.promote_if_better(GRAPH_R1_SFT_MODEL.name, better, GRAPH_R1_SFT_MODEL.gate, baseline=base).promoted
    assert tracking.champion_version(GRAPH_R1_SFT_MODEL.name) == better


def test_grpo_takes_its_sft_starts_validation_only_when_it_is_the_same_measurement(mlflow_db: Path, tmp_path: Path):
    import mlflow

    tracking = Tracking(f"sqlite:///{mlflow_db}", str(tmp_path / "artifacts"))
    for profile in ("demo", "full"):  # the shipped profiles validate SFT and GRPO alike, so step 0 is reused
        sft, grpo = SftConfig.profile(profile), GrpoConfig.profile(profile)
        assert (sft.valid_items, sft.seed, sft.graph_r1) == (grpo.valid_items, grpo.seed, grpo.graph_r1)
        assert validation_key([], sft.graph_r1) == validation_key(
            [], grpo.graph_r1, grpo.eval_batch_size, grpo.reward_variant, grpo.format_weight)
    items = [QaItem("kgqa_short", "q1", "?", {}, "a"), QaItem("kgqa_short", "q2", "?", {}, "b")]
    key = validation_key(items, SMALL_ENV)
    assert key != validation_key(items[:1], SMALL_ENV) and key != validation_key(items, TINY_ENV)
    assert key != validation_key(items, SMALL_ENV, reward_variant="authors")
    with tracking.start_run(GRAPH_R1_SFT_MODEL.name):
        mlflow.set_tag(VALIDATION_KEY_TAG, key)
        mlflow.log_metrics({"valid_reward": 0.25, "valid_accuracy": 0.125, "valid_base_reward": 0.0,
                            "train_nll_last": 1.5})
        uri = tracking.log_torch_model(torch.nn.Linear(2, 1))
    version = tracking.register(uri, GRAPH_R1_SFT_MODEL.name)
    start = f"models:/{GRAPH_R1_SFT_MODEL.name}/{version}"
    assert recorded_validation(tracking, start, key) == {"valid_reward": 0.25, "valid_accuracy": 0.125}
    assert recorded_validation(tracking, start, validation_key(items[:1], SMALL_ENV)) is None  # other questions
    assert recorded_validation(tracking, uri, key) is None  # not a registered version: measured again


def test_evaluation_picks_the_grpo_champion_else_the_sft_champion_else_the_base_llm(mlflow_db: Path,
                                                                                   tmp_path: Path):
    uri = f"sqlite:///{mlflow_db}"
    tracking = Tracking(uri, str(tmp_path / "artifacts"))
    methods = ("graph-r1", "graph-r1-no-analyze", "graph-r1-no-sft", "graph-r1-sft-only")
    assert all(method_of(m) == "graph-r1" and make_config(m).actions for m in methods)

    def sources() -> dict[str, str | None]:
        return {m: choose_policy(m, tracking).source for m in methods}

    absent = Tracking(f"sqlite:///{tmp_path / 'absent.db'}", str(tmp_path / "artifacts"))
    assert choose_policy("graph-r1", absent).source == "base"
    assert not (tmp_path / "absent.db").exists()  # asking does not create a registry
    assert sources() == {"graph-r1": "base", "graph-r1-no-analyze": "base", "graph-r1-no-sft": "base",
                         "graph-r1-sft-only": None}
    skipped = choose_policy("graph-r1-sft-only", tracking)
    assert skipped.description.startswith(f"skipped: no {GRAPH_R1_SFT_MODEL.name}@champion") and skipped.model_uri is None
    assert load_chosen_policy(choose_policy("graph-r1-no-sft", tracking), tracking) is None  # the base LLM plays
    from medgraph.eval.families import load_policies

    chosen, environment = load_policies(["cot", "graph-r1", "graph-r1-sft-only"], tracking)  # as eval assets
    assert {m: (c.source, model) for m, (c, model) in chosen.items()} == {"graph-r1": ("base", None),
                                                                         "graph-r1-sft-only": (None, None)}
    assert environment == {}  # no trained policy: the method's own environment

    sft = register_policy(tracking, GRAPH_R1_SFT_MODEL.name, valid_reward=0.2)
    tracking.client.set_registered_model_alias(GRAPH_R1_SFT_MODEL.name, "champion", sft)
    assert sources() == {"graph-r1": "sft", "graph-r1-no-analyze": "sft", "graph-r1-no-sft": "base",
                         "graph-r1-sft-only": "sft"}
    assert choose_policy("graph-r1", tracking).model_uri == f"models:/{GRAPH_R1_SFT_MODEL.name}/{sft}"

    grpo = register_policy(tracking, GRAPH_R1_POLICY_MODEL.name, valid_reward=0.3)
    tracking.client.set_registered_model_alias(GRAPH_R1_POLICY_MODEL.name, "champion", grpo)
    assert sources() == {"graph-r1": "grpo", "graph-r1-no-analyze": "grpo", "graph-r1-no-sft": "base",
                         "graph-r1-sft-only": "sft"}
    assert choose_policy("graph-r1", tracking).description == f"{GRAPH_R1_POLICY_MODEL.name} v{grpo} (GRPO champion)"


# --------------------------------------------------------------------------- the assets


@pytest.mark.slow
def test_policy_assets_train_register_and_load_the_champion(qa_warehouse: Warehouse, tiny_llm_dir: Path,
                                                            tmp_path: Path, mlflow_db: Path):
    """SFT then GRPO as assets, gated, registered and loaded back. The base model is the tiny random Llama:
    what is tested is the assets' plumbing (how much SmolLM2 learns is graph_r1_sft.py's and
    grpo_learning.py's question), in 6 s instead of SmolLM2's 76."""
    home = qa_warehouse.path.parent
    tracking_uri = f"sqlite:///{mlflow_db}"
    resources = {"warehouse": WarehouseResource(home=str(home)), "encoder": EncoderResource(**TEST_ENCODER),
                 "llm": LlmResource(spec=str(tiny_llm_dir), home=str(tmp_path), device="cpu"),
                 "mlflow_tracking": MlflowResource(tracking_uri=tracking_uri, artifact_root=str(tmp_path / "art")),
                 "training": TrainingResource(profile="tiny")}
    assert load_champion_policy(resources["mlflow_tracking"].tracking()) is None
    instance = dg.DagsterInstance.ephemeral()
    with pytest.raises(dg.Failure, match="materialize models/graph_r1_sft first"):
        dg.materialize([graph_r1_policy], resources=resources, instance=instance)
    run_config = dg.RunConfig(ops={"models__graph_r1_sft": {"config": {"profile": "tiny", "evaluate_base": False}},
                                   "models__graph_r1_policy": {"config": {"profile": "tiny"}}})
    result = dg.materialize([graph_r1_sft, graph_r1_policy], resources=resources, instance=instance,
                            run_config=run_config)
    (sft,) = result.asset_materializations_for_node("models__graph_r1_sft")
    assert sft.metadata["demonstrations"].value > 0 and sft.metadata["validation_questions"].value == 1
    assert {"valid_reward", "valid_accuracy", "valid_format_rate", "train_nll_last"} <= set(sft.metadata)
    # Registered and gated against the base model, evaluated although evaluate_base is off: no SFT champion yet.
    assert sft.metadata["registered_model"].value == GRAPH_R1_SFT_MODEL.name and sft.metadata["model_version"].value == "1"
    assert sft.metadata["baseline_name"].value.startswith("base model")
    assert sft.metadata["baseline_value"].value == sft.metadata["valid_base_reward"].value
    assert sft.metadata["promoted"].value is (
        sft.metadata["valid_reward"].value > sft.metadata["valid_base_reward"].value
        and sft.metadata["valid_accuracy"].value >= sft.metadata["valid_base_accuracy"].value)
    (policy,) = result.asset_materializations_for_node("models__graph_r1_policy")
    metadata = policy.metadata
    assert metadata["model_version"].value == "1" and metadata["baseline_name"].value.startswith("SFT start")
    assert metadata["baseline_value"].value == metadata["valid_reward_start"].value
    assert metadata["promoted"].value is (metadata["valid_reward"].value > metadata["valid_reward_start"].value
                                          and metadata["valid_accuracy"].value >= metadata["valid_accuracy_start"].value)
    assert metadata["sft_model_uri"].value == sft.metadata["model_uri"].value
    # Evaluation runs a policy in the environment it was trained in (the tiny profile's), actions aside.
    assert policy_environment(sft.metadata["model_uri"].value, resources["mlflow_tracking"].tracking()) == {
        k: v for k, v in dataclasses.asdict(TINY_ENV).items() if k != "actions"}
    if sft.metadata["promoted"].value:  # GRPO starts from the SFT champion, whose validation step 0 takes over
        assert metadata["valid_reward_start"].value == sft.metadata["valid_reward"].value
    champion_version = "1" if metadata["promoted"].value else "None"
    assert policy.tags["dagster/data_version"] == f"{GRAPH_R1_POLICY_MODEL.name}@champion=v{champion_version}"

    tracking = resources["mlflow_tracking"].tracking()
    run = tracking.client.get_run(metadata["mlflow_run_id"].value)
    curves = {"reward", "format_rate", "kl", "clip_fraction", "valid_accuracy", "valid_reward"}
    assert curves <= set(run.data.metrics)
    for per_step in ("kl", "clip_fraction"):  # one value per GRPO step (the tiny profile takes one)
        assert [m.step for m in tracking.client.get_metric_history(run.info.run_id, per_step)] == [1]
    assert len(tracking.client.get_metric_history(run.info.run_id, "valid_accuracy")) == 2  # step 0 and the end
    assert run.data.tags["dagster/asset_key"] == "models/graph_r1_policy"
    assert {a.path for a in tracking.client.list_artifacts(run.info.run_id)} >= {"training.json",
                                                                                  "training_curves.png"}
    assert not any((home / "checkpoints" / "graph_r1_policy").glob("*/checkpoints/step-*"))  # cleaned up

    choice = choose_policy("graph-r1", tracking)
    expected = "grpo" if metadata["promoted"].value else "sft" if sft.metadata["promoted"].value else "base"
    assert choice.source == expected
    if choice.source == "grpo":
        champion = load_champion_policy(tracking)
        assert isinstance(champion, TransformersChatModel) and champion.name == "graph-r1-policy"
    if choice.model_uri is not None:
        chosen = load_chosen_policy(choice, tracking)
        reply = chosen.complete([user("Which drug may treat hypertension?")], GenerationConfig(max_new_tokens=4))
        assert reply.completion_tokens > 0
