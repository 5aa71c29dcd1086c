"""Rollouts of the Graph-R1 policy: G episodes per question, stepped in lockstep, and their token masks.

Generation goes through the `ChatModel` interface, so the rollout engine can
be the in-process model being trained or an OpenAI-compatible server (vLLM)
holding a synced copy of it. Each turn is ONE batched `generate` call over
every episode still running (all G samples of all questions of the step);
the environment then answers all of them with one retriever call per action
type (`GraphR1Env.step_batch`).

Training needs token ids and a mask of the tokens the policy wrote.
`encode_conversation` tokenizes the final conversation segment by segment at
the chat template's message boundaries: the text before each assistant reply
(system prompt, question, observations, the template's role headers) is one
segment with mask 0; the reply and the template's end-of-turn token are the
next, mask 1; the template's glue after the end-of-turn token (a newline) is
mask 0. A template that renders history differently from a live prompt (one
that drops earlier thoughts, say) is refused rather than trained on wrongly.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from medgraph.llm.base import ChatModel, GenerationConfig, Message
from medgraph.methods.graph_r1 import STOP, GraphR1Config, GraphR1Env, GraphR1State, restore_stop
from medgraph.qa.item import QaItem
from medgraph.rl.rewards import Reward, episode_reward


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids of a whole conversation and which of them the policy wrote (1) or was given (0)."""

    ids: list[int]
    mask: list[int]

    @property
    def policy_tokens(self) -> int:
        return sum(self.mask)


def render(tokenizer: object, messages: Sequence[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template([m.as_dict() for m in messages], tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _encode(tokenizer: object, text: str) -> list[int]:
    # The chat template writes any BOS token itself, as TransformersChatModel does.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_conversation(tokenizer: object, messages: Sequence[Message], end_ids: Sequence[int]) -> EncodedConversation:
    """Ids and policy mask of a conversation, cut at the chat template's message boundaries.

    `end_ids`: the end-of-turn tokens (`TransformersChatModel.eos_ids`). A reply's tokens
    up to and including its first end-of-turn token are the policy's.
    """
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # rendered text already encoded
    for k, message in enumerate(messages):
        if message.role != "assistant":
            continue
        prompt = render(tokenizer, messages[:k], generation_prompt=True)
        through = render(tokenizer, messages[: k + 1], generation_prompt=False)
        if not prompt.startswith(done) or not through.startswith(prompt):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation; "
                             "token masks cannot be cut at message boundaries")
        context = _encode(tokenizer, prompt[len(done):])
        reply = _encode(tokenizer, through[len(prompt):])
        end = next((i + 1 for i, t in enumerate(reply) if t in end_ids), len(reply))
        ids += context + reply
        mask += [0] * len(context) + [1] * end + [0] * (len(reply) - end)
        done = through
    rest = _encode(tokenizer, render(tokenizer, messages, generation_prompt=False)[len(done):])
    return EncodedConversation(ids + rest, mask + [0] * len(rest))


@dataclass
class Trajectory:
    """One finished episode of one question, and what it earned."""

    state: GraphR1State
    group: int  # index of its question in the rollout batch; its G samples share it
    reward: Reward
    completion_tokens: int
    advantage: float = 0.0

    @property
    def item(self) -> QaItem:
        return self.state.item


@dataclass
class Rollouts:
    trajectories: list[Trajectory]
    seconds: float
    completion_tokens: int
    generate_calls: int
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)


def rollout(policy: ChatModel, env: GraphR1Env, items: Sequence[QaItem], group_size: int,
            generation: GenerationConfig, reward: Callable[[GraphR1State], Reward] | None = None) -> Rollouts:
    """`group_size` episodes per item, all advanced together: one batched generation per turn.

    With sampling, turn t of a call uses seed `generation.seed + t`, so a rollout is
    reproducible from its seed.
    """
    reward = reward or episode_reward
    states = [env.reset(item) for item in items for _ in range(group_size)]
    tokens = [0] * len(states)
    started, turn = time.perf_counter(), 0
    while active := [i for i, s in enumerate(states) if not s.done]:
        seed = None if generation.seed is None else generation.seed + turn
        completions = policy.generate([list(states[i].messages) for i in active], generation.but(seed=seed))
        env.step_batch([(states[i], restore_stop(c)) for i, c in zip(active, completions, strict=True)])
        for i, completion in zip(active, completions, strict=True):
            tokens[i] += completion.completion_tokens
        turn += 1
    seconds = time.perf_counter() - started
    trajectories = [Trajectory(s, i // group_size, reward(s), tokens[i]) for i, s in enumerate(states)]
    return Rollouts(trajectories, seconds, sum(tokens), turn, summarize(trajectories))


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Mean reward, accuracy (exact match), r_acc, format rate, turns and answer rate."""
    n = max(len(trajectories), 1)
    return {
        "reward": sum(t.reward.total for t in trajectories) / n,
        "accuracy": sum(t.reward.correct for t in trajectories) / n,
        "answer_score": sum(t.reward.accuracy for t in trajectories) / n,
        "format_rate": sum(t.reward.format for t in trajectories) / n,
        "answered": sum(t.state.answer is not None for t in trajectories) / n,
        "turns": sum(t.state.turns for t in trajectories) / n,
    }


def generation_config(max_new_tokens: int, temperature: float, top_p: float = 1.0,
                      seed: int | None = 0) -> GenerationConfig:
    """Decoding for Graph-R1 turns: stop at the closing tag of an action."""
    return GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=STOP,
                            seed=seed)


def validation_key(items: Sequence[QaItem], env_config: GraphR1Config, batch_size: int = 16,
                   reward_variant: str = "paper", format_weight: float = 0.1) -> str:
    """Everything an `evaluate` of one policy depends on besides the policy: the questions, the environment
    (and its decoding budget), the batching and the reward (defaults: `evaluate`'s and `episode_reward`'s).
    Two validations of the same policy with the same key are the same measurement, so GRPO takes its SFT
    start's step-0 validation from the SFT run instead of repeating it."""
    spec = {"qids": [item.qid for item in items], "env": asdict(env_config), "batch_size": batch_size,
            "reward": [reward_variant, format_weight]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def greedy_episodes(policy: ChatModel, env: GraphR1Env, items: Sequence[QaItem], batch_size: int = 16,
                    reward: Callable[[GraphR1State], Reward] | None = None) -> Rollouts:
    """One greedy episode per item, `batch_size` items at a time: the trajectories in item order."""
    generation = generation_config(env.config.max_new_tokens, temperature=0.0)
    trajectories: list[Trajectory] = []
    tokens, seconds, calls = 0, 0.0, 0
    for start in range(0, len(items), batch_size):
        batch = rollout(policy, env, items[start:start + batch_size], 1, generation, reward)
        trajectories += batch.trajectories
        tokens, seconds, calls = tokens + batch.completion_tokens, seconds + batch.seconds, calls + batch.generate_calls
    return Rollouts(trajectories, seconds, tokens, calls, summarize(trajectories))


def evaluate(policy: ChatModel, env: GraphR1Env, items: Sequence[QaItem], batch_size: int = 16,
             reward: Callable[[GraphR1State], Reward] | None = None) -> dict[str, float]:
    """Greedy episodes over `items` (one per question): mean reward, accuracy, format rate, ...
    keys prefixed with nothing; the caller names the split."""
    episodes = greedy_episodes(policy, env, items, batch_size, reward)
    return {**episodes.stats, "questions": float(len(items)), "seconds": episodes.seconds,
            "tokens_per_second": episodes.tokens_per_second}
