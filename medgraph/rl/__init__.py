"""Training the Graph-R1 policy: cold-start SFT on expert demonstrations, then GRPO in the KG environment.

    rewards.py   r = r_acc + 0.1 r_fmt (EM on the option letter, F1 on short answers), or the authors' variant
    rollout.py   G episodes per question in lockstep (one batched generation per turn), token masks
    grpo.py      group-normalized advantages, clipped ratio, k3 KL to a frozen reference, the trainer
    sft.py       the gold-path expert and masked SFT
    model.py     the trainable policy (optionally LoRA), resumable atomic checkpoints, token scoring
    policy.py    the policies as MLflow models, their champion gates; `choose_policy` for evaluation
    scale.py     torch distributed data parallel, vLLM rollout server
    train.py     GRPO from the command line (torchrun, vLLM), outside Dagster

Why not TRL's GRPOTrainer (TRL 1.16 was examined): its multi-turn support is
`environment_factory`, whose tool calls are parsed from the chat template's
tool-calling schema (`parse_response` with JSON tool specs), not from our
`<search>/<traverse>/<analyze>/<answer>` tags, and SmolLM2's template has no
tool schema at all. The other route, the experimental `rollout_func` with an
`env_mask`, would work, but we would write the whole multi-turn rollout and
masking ourselves anyway, and in exchange inherit the HF Trainer loop, its
`datasets` dependency, its checkpoint layout and its logging, beside an
experimental API that "may change or be removed at any time". What remains
of GRPO after the rollout is ~150 lines (grpo.py), which we can read,
test piece by piece, checkpoint our way and log to MLflow our way. The
scale-out TRL would give us (vLLM generation, DDP) is in scale.py.
"""

from medgraph.rl.grpo import GrpoConfig, GrpoResult, group_advantages, grpo_token_loss, k3_kl, train_grpo
from medgraph.rl.policy import (
    PolicyChoice,
    choose_policy,
    load_champion_policy,
    load_chosen_policy,
    load_policy,
    log_policy,
)
from medgraph.rl.rewards import Reward, episode_reward
from medgraph.rl.rollout import EncodedConversation, Trajectory, encode_conversation, evaluate, rollout
from medgraph.rl.sft import SftConfig, expert_demonstrations, train_sft

__all__ = [
    "EncodedConversation",
    "GrpoConfig",
    "GrpoResult",
    "PolicyChoice",
    "Reward",
    "SftConfig",
    "Trajectory",
    "choose_policy",
    "encode_conversation",
    "episode_reward",
    "evaluate",
    "expert_demonstrations",
    "group_advantages",
    "grpo_token_loss",
    "k3_kl",
    "load_champion_policy",
    "load_chosen_policy",
    "load_policy",
    "log_policy",
    "rollout",
    "train_grpo",
    "train_sft",
]
