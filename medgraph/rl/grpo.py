"""GRPO for the Graph-R1 policy (DeepSeekMath's group relative policy optimization, multi-turn).

One step:
  1. sample `questions_per_step` training questions; roll out `group_size` (G)
     episodes of each with temperature sampling (rollout.py);
  2. reward each episode (rewards.py) and normalize within its group:
     A_i = (r_i - mean(r)) / (std(r) + 1e-6); a group whose G rewards are equal
     carries no signal and is left out of the update (`skip_flat_groups`);
  3. for every policy token t of every episode (observations masked out):
         ratio_t = pi(t) / pi_old(t)
         loss_t  = -( min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A) - beta * KL_t )
         KL_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (k3: unbiased, >= 0)
     averaged per episode and then over episodes (GRPO; `token_level_loss`
     averages over all tokens instead, as DAPO does), accumulated over
     micro-batches, gradients clipped to `max_grad_norm`, one AdamW step per
     mini-batch: `minibatches` (2 in every profile, as Graph-R1's released
     training runs mini-batches of 64 of a batch of 128) splits the rollouts
     into that many optimizer steps, the later ones off-policy, which is what
     the clipped ratio is for.

pi_old is the policy that sampled the rollouts; its log-probs are computed
once, before the first update. With one mini-batch it would be the current
policy itself (ratio 1: the clip never acts, the gradient is A * grad log pi).

bf16 autocast on CUDA, float32 on the CPU; LoRA (`lora_r` > 0) trains an
adapter only, and then the reference is the same network with the adapter
off. Checkpoints every `checkpoint_every` steps (model.py) resume exactly:
the questions of step s and the sampling seeds of its turns depend only on
(seed, s). Validation (greedy, `valid_items` questions) runs at step 0 and
every `eval_every` steps. Scale-out: scale.py.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medgraph.llm.base import ChatModel
from medgraph.llm.hf import TransformersChatModel, autocast, release_freed_memory
from medgraph.methods.graph_r1 import GraphR1Config, GraphR1Env
from medgraph.qa.item import QaItem
from medgraph.rl.model import (
    POLICY_DIR,
    checkpoint_state,
    frozen_reference,
    is_lora,
    latest_checkpoint,
    load_optimizer_state,
    load_trainable,
    lora_of,
    make_batch,
    save_checkpoint,
    token_logprobs,
    trainable_parameters,
)
from medgraph.rl.rewards import episode_reward
from medgraph.rl.rollout import Trajectory, encode_conversation, evaluate, generation_config, rollout
from medgraph.rl.scale import Distributed, VllmRollouts
from medgraph.settings import profile_config

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the objective, piece by piece


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(groups, G) rewards -> advantages normalized within each group (population std)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(d) - d - 1 with d = ref - logp: >= 0, 0 where they agree."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate min(r A, clip(r) A) per token, and where the clip is the minimum."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                    advantages: torch.Tensor, epsilon: float, beta: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token KL, clip active) for (B, K) log-probs and (B, 1) advantages."""
    objective, clipped = clipped_objective(logp, old_logp, advantages, epsilon)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    return -(objective - beta * kl), kl, clipped


def loss_weights(policy_tokens: Sequence[int], token_level: bool) -> list[float]:
    """The weight of each token of each episode, so that summing weighted token losses over
    micro-batches gives the batch loss exactly (gradient accumulation without rescaling)."""
    if token_level:
        total = max(sum(policy_tokens), 1)
        return [1.0 / total] * len(policy_tokens)
    return [1.0 / (max(n, 1) * len(policy_tokens)) for n in policy_tokens]


def split_minibatches(episodes: int, minibatches: int) -> list[list[int]]:
    """Episode indices of each optimizer step, dealt round-robin so that each mini-batch holds part of
    every group; empty mini-batches (fewer episodes than `minibatches`) are left out."""
    order = list(range(episodes))
    return [order[i::minibatches] for i in range(minibatches) if order[i::minibatches]]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class GrpoConfig:
    steps: int = 200
    questions_per_step: int = 8
    group_size: int = 8  # G
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-6
    weight_decay: float = 0.0
    epsilon: float = 0.2
    beta: float = 0.04  # KL weight; 0 skips the reference pass
    reward_variant: str = "paper"  # "paper": r_acc + 0.1 r_fmt; "authors": -1 + r_fmt + r_acc if well formed
    format_weight: float = 0.1
    minibatches: int = 2  # optimizer steps per rollout batch (1: on-policy, the ratio is 1 and never clipped)
    micro_batch_size: int = 4  # episodes per forward/backward; gradients accumulate over the rest
    max_grad_norm: float = 1.0
    token_level_loss: bool = False
    skip_flat_groups: bool = True
    lora_r: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    lora_layers: int | None = None  # adapt only the top N blocks (None: all)
    graph_r1: GraphR1Config = field(default_factory=GraphR1Config)  # the environment (max_steps, observation sizes, max_new_tokens)
    valid_items: int = 64
    datasets: tuple[str, ...] | None = None  # train and validation questions of these (None: all; see SftConfig)
    eval_every: int = 25
    eval_batch_size: int = 16
    checkpoint_every: int = 25
    seed: int = 0
    device: str = "auto"
    bf16: bool = True  # autocast on CUDA and on CPUs with native bf16
    gradient_checkpointing: bool = False
    rollout_server: str | None = None  # openai:<model>@<url> of a vLLM server (LoRA only; scale.py)
    progress: bool = False

    @classmethod
    def profile(cls, name: str, **overrides: object) -> GrpoConfig:
        return profile_config(GRPO_PROFILES, "GRPO", name, **overrides)

    def as_dict(self) -> dict[str, object]:
        flat = {k: v for k, v in asdict(self).items() if k != "graph_r1"}
        flat.update({f"env_{k}": v for k, v in asdict(self.graph_r1).items()})
        return flat


# Small observations on the CPU profiles: every observation token is read by every forward pass.
SMALL_ENV = GraphR1Config(max_steps=5, search_k=4, traverse_limit=6, analyze_max_nodes=1, analyze_chars=120,
                          search_chunks=2, snippet_chars=80, traverse_chunks=2, analyze_chunk_chars=300,
                          max_new_tokens=48)
TINY_ENV = replace(SMALL_ENV, max_steps=4, search_k=3, traverse_limit=4, analyze_chars=80)  # 1-hop demos only
GRPO_PROFILES = {
    "tiny": GrpoConfig(steps=1, questions_per_step=1, group_size=2, micro_batch_size=1, lr=1e-4, beta=0.02,
                       lora_r=8, lora_alpha=16, lora_layers=4, graph_r1=TINY_ENV, valid_items=1, eval_every=1,
                       checkpoint_every=1, skip_flat_groups=False),
    # `make demo` on a laptop CPU: the whole loop (rollouts, update, validation, registration) in minutes.
    "demo": GrpoConfig(steps=2, questions_per_step=2, group_size=4, micro_batch_size=1, lr=1e-4, beta=0.02,
                       lora_r=16, lora_alpha=32, lora_layers=10, graph_r1=SMALL_ENV, valid_items=8, eval_every=2,
                       checkpoint_every=1, progress=True),
    "full": GrpoConfig(steps=500, questions_per_step=16, group_size=8, micro_batch_size=8, lr=1e-6, beta=0.04,
                       valid_items=200, eval_every=50, checkpoint_every=50, gradient_checkpointing=True,
                       progress=True),
}


# --------------------------------------------------------------------------- training


@dataclass
class GrpoResult:
    policy: TransformersChatModel
    metrics: dict[str, float]  # valid_* at the end and at step 0, train means, timings
    history: list[dict[str, float]] = field(default_factory=list)


def training_curves_figure(history: Sequence[Mapping[str, float]]):  # -> matplotlib Figure
    """Train reward and format rate, KL to the reference, and validation accuracy/reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if h["step"] > 0]
    validated = [h for h in history if "valid_accuracy" in h]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    axes[0].plot([h["step"] for h in steps], [h["reward"] for h in steps], "o-", label="train reward")
    axes[0].plot([h["step"] for h in steps], [h["format_rate"] for h in steps], "s-", label="format rate")
    axes[1].plot([h["step"] for h in steps], [h["kl"] for h in steps], "o-", color="tab:red")
    axes[2].plot([h["step"] for h in validated], [h["valid_accuracy"] for h in validated], "o-", label="accuracy")
    axes[2].plot([h["step"] for h in validated], [h["valid_reward"] for h in validated], "s-", label="reward")
    for axis, title in zip(axes, ("rollouts", "KL to reference (k3)", "validation"), strict=True):
        axis.set_title(title)
        axis.set_xlabel("step")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    return fig


def grpo_update(policy: TransformersChatModel, loss_model: torch.nn.Module, reference: torch.nn.Module | None,
                trajectories: Sequence[Trajectory], optimizer: torch.optim.Optimizer,
                config: GrpoConfig) -> dict[str, float]:
    """The clipped, KL-regularized policy-gradient update on finished, scored trajectories."""
    if not trajectories:
        return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "policy_tokens": 0.0}
    model, device = policy.model, policy.device
    encoded = [encode_conversation(policy.tokenizer, t.state.messages, policy.eos_ids) for t in trajectories]
    plan = [[mini[i:i + config.micro_batch_size] for i in range(0, len(mini), config.micro_batch_size)]
            for mini in split_minibatches(len(encoded), config.minibatches)]
    batches = {tuple(micro): make_batch([encoded[i] for i in micro], policy.pad_id, device)
               for micro_batches in plan for micro in micro_batches}

    def reference_logprobs(batch) -> torch.Tensor | None:
        if config.beta == 0:
            return None
        with torch.no_grad(), autocast(device, config.bf16):
            if reference is not None:
                return token_logprobs(reference, batch)
            with model.disable_adapter():
                return token_logprobs(model, batch)

    model.train()  # no dropout in these models; train mode only turns gradient checkpointing on
    old: dict[tuple[int, ...], torch.Tensor] = {}
    if len(plan) > 1:  # later mini-batches are scored against the policy that sampled them
        with torch.no_grad(), autocast(device, config.bf16):
            old = {key: token_logprobs(model, batch) for key, batch in batches.items()}
    params = trainable_parameters(model)
    totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "tokens": 0.0, "grad_norm": 0.0}
    for micro_batches in plan:
        weights = loss_weights([encoded[i].policy_tokens for micro in micro_batches for i in micro],
                               config.token_level_loss)
        optimizer.zero_grad(set_to_none=True)
        offset = 0
        for k, micro in enumerate(micro_batches):
            batch = batches[tuple(micro)]
            ref = reference_logprobs(batch)
            sync = nullcontext() if k == len(micro_batches) - 1 or not hasattr(loss_model, "no_sync") \
                else loss_model.no_sync()
            with sync:
                with autocast(device, config.bf16):
                    logp = token_logprobs(loss_model, batch)
                old_logp = old.get(tuple(micro), logp.detach())
                advantages = torch.tensor([[trajectories[i].advantage] for i in micro], device=logp.device)
                token_loss, kl, clipped = grpo_token_loss(logp, old_logp, ref, advantages, config.epsilon, config.beta)
                w = torch.tensor(weights[offset:offset + len(micro)], device=logp.device)[:, None] * batch.mask
                loss = (token_loss * w).sum()
                loss.backward()
            offset += len(micro)
            totals["loss"] += float(loss.detach())
            totals["kl"] += float((kl.detach() * batch.mask).sum())
            totals["clipped"] += float((clipped.float() * batch.mask).sum())
            totals["tokens"] += float(batch.mask.sum())
        totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        optimizer.step()
    model.eval()
    tokens = max(totals["tokens"], 1.0)
    return {"loss": totals["loss"] / len(plan), "kl": totals["kl"] / tokens, "clip_fraction": totals["clipped"] / tokens,
            "grad_norm": totals["grad_norm"] / len(plan), "policy_tokens": totals["tokens"]}


def train_grpo(model_dir: str | Path, env: GraphR1Env, train: Sequence[QaItem], valid: Sequence[QaItem],
               config: GrpoConfig, *, checkpoint_dir: Path | None = None, resume: bool = True,
               log_fn: Callable[[int, dict[str, float]], None] | None = None, name: str | None = None,
               start_validation: Mapping[str, float] | None = None) -> GrpoResult:
    """GRPO from the checkpoint in `model_dir` (the cold-start SFT policy); returns the trained policy
    (LoRA not yet merged: `model.save_policy` merges) and its validation metrics before and after.

    `start_validation`: the starting policy's `valid_*` metrics as already measured on the same
    validation (same `rollout.validation_key`), used as step 0 instead of validating again."""
    if not train:
        raise ValueError("GRPO needs training questions: materialize qa/qa_items")
    dist = Distributed.from_env()
    device = dist.device(config.device)
    checkpoint = latest_checkpoint(checkpoint_dir) if resume else None
    policy = _starting_policy(model_dir, checkpoint, config, device, name)
    device = policy.device  # resolved ("auto" -> cuda or cpu)
    reference = frozen_reference(model_dir, policy) if config.beta > 0 else None
    optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=config.lr, weight_decay=config.weight_decay)
    start, history = 0, []
    if checkpoint is not None:
        load_optimizer_state(checkpoint, optimizer)
        state = checkpoint_state(checkpoint)
        start, history = int(state["step"]), list(state["history"])
        log.info("GRPO: resuming from %s (step %d)", checkpoint, start)
    loss_model = dist.wrap(policy.model)
    engine = policy
    if config.rollout_server:
        engine = VllmRollouts(config.rollout_server, (checkpoint_dir or Path(".")) / "rollout_adapters")
        engine.sync(policy, start)
    reward = partial(episode_reward, variant=config.reward_variant, format_weight=config.format_weight)
    valid = list(valid)[: config.valid_items]
    log_fn = log_fn or (lambda step, metrics: None)

    def validate() -> dict[str, float]:
        with autocast(device, config.bf16, generation=True):
            metrics = evaluate(engine, env, valid, config.eval_batch_size, reward)
        return {f"valid_{k}": v for k, v in metrics.items()}

    if start == 0 and valid and dist.is_main:
        if start_validation is not None:
            log.info("GRPO step 0: the starting policy's recorded validation (same questions, environment, "
                     "batching and reward), not measured again")
        history.append({"step": 0, **(dict(start_validation) if start_validation is not None else validate())})
        log_fn(0, history[-1])
    for step in tqdm(range(start + 1, config.steps + 1), desc="grpo", disable=not (config.progress and dist.is_main),
                     initial=start, total=config.steps):
        record = _grpo_step(step, policy, loss_model, reference, engine, env, train, optimizer, reward, config, dist)
        release_freed_memory()  # rollouts and updates of every length: glibc would keep their freed blocks
        if dist.is_main and valid and (step % config.eval_every == 0 or step == config.steps):
            record.update(validate())
        history.append({"step": step, **record})
        if dist.is_main:
            log_fn(step, record)
            log.info("GRPO step %d: reward %.3f, format %.2f, kl %.4f, %.1fs", step, record["reward"],
                     record["format_rate"], record["kl"], record["step_seconds"])
            if checkpoint_dir is not None and (step % config.checkpoint_every == 0 or step == config.steps):
                save_checkpoint(checkpoint_dir, step, policy, optimizer, {"history": history})
    return GrpoResult(policy, _final_metrics(history), history)


def _starting_policy(model_dir: str | Path, checkpoint: Path | None, config: GrpoConfig, device: str,
                     name: str | None) -> TransformersChatModel:
    """The policy to train: a checkpoint's full weights, or the model with a fresh or resumed LoRA adapter."""
    lora = lora_of(config)
    if checkpoint is not None and lora is None:
        policy = load_trainable(checkpoint / POLICY_DIR, device=device, max_batch_size=256, name=name)
    else:
        adapter = checkpoint / POLICY_DIR if checkpoint is not None else None
        policy = load_trainable(model_dir, lora=lora, adapter_dir=adapter, device=device, max_batch_size=256, name=name)
    if config.gradient_checkpointing:
        policy.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if is_lora(policy.model):
            policy.model.enable_input_require_grads()
    return policy


def _grpo_step(step: int, policy: TransformersChatModel, loss_model: torch.nn.Module,
               reference: torch.nn.Module | None, engine: ChatModel, env: GraphR1Env, train: Sequence[QaItem],
               optimizer: torch.optim.Optimizer, reward: Callable, config: GrpoConfig, dist: Distributed
               ) -> dict[str, float]:
    """One GRPO step: G episodes for each of the step's questions (this rank's share), group-normalized
    advantages, one update; the step's statistics, averaged over ranks."""
    started = time.perf_counter()
    questions = random.Random(f"{config.seed}:{step}").sample(list(train), min(config.questions_per_step, len(train)))
    generation = generation_config(env.config.max_new_tokens, config.temperature, config.top_p,
                                   seed=config.seed * 1_000_003 + step * 1_000 + dist.rank * 100)
    with autocast(policy.device, config.bf16, generation=True):
        batch = rollout(engine, env, dist.shard(questions), config.group_size, generation, reward)
    rewards = torch.tensor([t.reward.total for t in batch.trajectories]).view(-1, config.group_size)
    for trajectory, advantage in zip(batch.trajectories, group_advantages(rewards).flatten().tolist(), strict=True):
        trajectory.advantage = advantage
    flat = (rewards.max(dim=1).values == rewards.min(dim=1).values).tolist()
    # Under DDP every rank must run the same backward passes, so flat groups stay in (at zero advantage).
    skip = config.skip_flat_groups and dist.world == 1
    used = [t for t in batch.trajectories if not (skip and flat[t.group])]
    updated = time.perf_counter()
    update = grpo_update(policy, loss_model, reference, used, optimizer, config)
    if isinstance(engine, VllmRollouts):
        engine.sync(policy, step)
    return dist.mean({
        **batch.stats, **update, "reward_std": float(rewards.std(dim=1, unbiased=False).mean()),
        "flat_groups": float(sum(flat)) / len(flat), "rollout_tokens_per_s": batch.tokens_per_second,
        "rollout_seconds": batch.seconds, "update_seconds": time.perf_counter() - updated,
        "step_seconds": time.perf_counter() - started,
    })


def _final_metrics(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Validation at the start and the end, and means of the training curves."""
    validated = [h for h in history if "valid_reward" in h]
    metrics: dict[str, float] = {}
    if validated:
        metrics.update({k: v for k, v in validated[-1].items() if k.startswith("valid_")})
        metrics.update({f"{k}_start": v for k, v in validated[0].items() if k.startswith("valid_")})
    steps = [h for h in history if h["step"] > 0]
    for key in ("reward", "format_rate", "kl", "step_seconds", "rollout_tokens_per_s", "update_seconds"):
        if steps:
            metrics[f"train_{key}_mean"] = sum(h[key] for h in steps) / len(steps)
    metrics["steps"] = float(len(steps))
    return metrics
