"""Graph-R1 episode rewards (docs/ARCHITECTURE.md "The three methods": r = r_acc + lambda * r_fmt).

r_acc is what the answer is worth: exact match of the option letter for a
multiple-choice question, token F1 against the acceptable answers for a short
one. r_fmt is 1 when every reply of the episode was well formed (`<think>`
then exactly one action tag) and the episode ended with an answer, else 0.

Two variants:
    "paper"    r = r_acc + 0.1 * r_fmt                      in [0, 1.1]
    "authors"  r = -1 + r_fmt + (r_acc if r_fmt else 0)     in [-1, 1]  (the released code: an
               ill-formed episode earns nothing for a lucky answer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from medgraph.methods.common import parse_answer, score_answer
from medgraph.methods.graph_r1 import GraphR1State

RewardVariant = Literal["paper", "authors"]
REWARD_VARIANTS: tuple[str, ...] = ("paper", "authors")


@dataclass(frozen=True)
class Reward:
    total: float
    accuracy: float  # r_acc: EM (option letter) or F1 (short answer)
    format: float  # r_fmt in {0, 1}
    correct: bool  # exact match, for accuracy reporting


def answer_score(state: GraphR1State) -> tuple[bool, float]:
    """(exact match, r_acc) of the episode's answer; (False, 0) without one."""
    item = state.item
    if state.answer is None:
        return False, 0.0
    prediction = parse_answer(f"<answer>{state.answer}</answer>", item)
    correct, f1 = score_answer(item, prediction)
    return correct, float(correct) if item.options else f1


def format_score(state: GraphR1State) -> float:
    """r_fmt: every reply well formed and the episode ended with an answer."""
    return float(bool(state.well_formed) and all(state.well_formed) and state.answer is not None)


def episode_reward(state: GraphR1State, variant: RewardVariant = "paper", format_weight: float = 0.1) -> Reward:
    """The reward of one finished episode."""
    if variant not in REWARD_VARIANTS:
        raise ValueError(f"reward variant must be one of {', '.join(REWARD_VARIANTS)}, got {variant!r}")
    correct, accuracy = answer_score(state)
    fmt = format_score(state)
    if variant == "paper":
        total = accuracy + format_weight * fmt
    else:
        total = -1.0 + fmt + (accuracy if fmt else 0.0)
    return Reward(total=total, accuracy=accuracy, format=fmt, correct=correct)
