"""The policy being trained: a trainable copy of a checkpoint (optionally LoRA), its reference, its checkpoints.

The trained model is a `TransformersChatModel` whose `.model` has trainable
parameters, so rollouts, evaluation and the method itself use it through the
same chat interface as any other model. Weights stay float32 (master weights);
on a GPU the forward passes run under bf16 autocast.

With LoRA (peft) only the adapter trains, and the frozen reference of the KL
term is the same network with the adapter switched off, so it costs no second
copy. Without LoRA the reference is a separate frozen copy of the starting
checkpoint.

A checkpoint is a directory `step-000120/` holding `policy/` (the adapter, or
the full weights, with the tokenizer), `optimizer.pt` and `state.json`. It is
written under a temporary name and renamed into place, then `latest` (a file
naming it) is replaced atomically: an interrupted save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from medgraph.files import directory_written_atomically, write_atomically
from medgraph.llm.hf import TransformersChatModel, forked_rng
from medgraph.llm.lora import fuse_lora_updates
from medgraph.rl.rollout import EncodedConversation

POLICY_DIR = "policy"
LATEST = "latest"


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: int = 32
    # Adapt only the top `layers` transformer blocks (None: all). Backpropagation then stops at the
    # lowest adapted block: on a CPU, the top third trains about twice as fast as all of them.
    layers: int | None = None
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # Seeds the fresh adapter's initialisation (lora_A is drawn at random): the same adapter whatever ran
    # before in the process, so an asset materialized alone trains what it trains inside `make demo`.
    seed: int = 0


class LoraFields(Protocol):
    """What a training config (SftConfig, GrpoConfig) says of its LoRA."""

    lora_r: int
    lora_alpha: int
    lora_layers: int | None
    seed: int


def lora_of(config: LoraFields) -> LoraSettings | None:
    """The LoRA a training config asks for, seeded by its `seed`; None for full fine-tuning (`lora_r` 0)."""
    if not config.lora_r:
        return None
    return LoraSettings(config.lora_r, config.lora_alpha, config.lora_layers, seed=config.seed)


def load_trainable(model_dir: str | Path, *, lora: LoraSettings | None = None, adapter_dir: Path | None = None,
                   device: str = "auto", max_batch_size: int = 64, name: str | None = None) -> TransformersChatModel:
    """A float32 copy of the checkpoint with trainable parameters: all of them, or a LoRA adapter
    (fresh, or loaded from `adapter_dir` to resume)."""
    chat = TransformersChatModel(model_dir, name=name, device=device, dtype="float32", max_batch_size=max_batch_size)
    if lora is None:
        chat.model.requires_grad_(True)
        return chat
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        chat.model = PeftModel.from_pretrained(chat.model, str(adapter_dir), is_trainable=True)
    else:
        # No LoRA dropout: the policy that samples and the policy that is scored must be the same
        # function, or the importance ratio is noise even before the first update.
        depth = chat.model.config.num_hidden_layers
        layers = list(range(depth - min(lora.layers, depth), depth)) if lora.layers else None
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                            target_modules=list(lora.target_modules), layers_to_transform=layers,
                            task_type="CAUSAL_LM")
        with forked_rng(chat.device):  # leaves the caller's random state as it was
            torch.manual_seed(lora.seed)
            chat.model = get_peft_model(chat.model, config)
    fuse_lora_updates(chat.model)
    return chat


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def frozen_reference(model_dir: str | Path, policy: TransformersChatModel) -> nn.Module | None:
    """The KL reference: None with LoRA (the adapter switched off is the reference), else a frozen copy."""
    if is_lora(policy.model):
        return None
    reference = TransformersChatModel(model_dir, device=policy.device, dtype="float32", max_batch_size=1).model
    return reference.requires_grad_(False).eval()


def save_policy(chat: TransformersChatModel, out_dir: Path) -> Path:
    """A plain Hugging Face checkpoint (a LoRA adapter merged in) with the tokenizer and chat template.

    Merging replaces `chat.model` by the merged network: call it when training is over.
    """
    if is_lora(chat.model):
        chat.model = chat.model.merge_and_unload()
    with directory_written_atomically(out_dir) as staging:
        chat.model.save_pretrained(staging, safe_serialization=True)
        chat.tokenizer.save_pretrained(staging)
    return out_dir


# --------------------------------------------------------------------------- resumable checkpoints


def save_checkpoint(root: Path, step: int, chat: TransformersChatModel, optimizer: torch.optim.Optimizer,
                    state: dict[str, object], keep: int = 1) -> Path:
    """Write `root/step-<step>/` atomically, point `root/latest` at it, keep the newest `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    with directory_written_atomically(final) as staging:
        chat.model.save_pretrained(staging / POLICY_DIR, safe_serialization=True)  # adapter only under LoRA
        chat.tokenizer.save_pretrained(staging / POLICY_DIR)
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        (staging / "state.json").write_text(json.dumps({"step": step, **state}, default=str))
    write_atomically(root / LATEST, name)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path | None) -> Path | None:
    """The directory `root/latest` names, if it is complete."""
    if root is None or not (root / LATEST).is_file():
        return None
    path = root / (root / LATEST).read_text().strip()
    return path if (path / "state.json").is_file() and (path / "optimizer.pt").is_file() else None


def checkpoint_state(path: Path) -> dict[str, object]:
    return json.loads((path / "state.json").read_text())


def load_optimizer_state(path: Path, optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))


# --------------------------------------------------------------------------- scoring tokens


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded conversations and the positions whose next token is the policy's.

    `keep` holds every position p (in any row) whose logit predicts a policy token p + 1;
    only those positions go through the LM head, which for a 49k-word vocabulary is most
    of the memory of a forward pass. No attention mask: padding is on the right, so a real
    token's causal window never holds a pad, and the causal mask alone is exact for every
    position that is scored.
    """

    ids: torch.Tensor  # (B, T)
    keep: torch.Tensor  # (K,) positions
    targets: torch.Tensor  # (B, K) the token each kept position predicts
    mask: torch.Tensor  # (B, K) float: 1 where that token is the row's policy token


def make_batch(conversations: list[EncodedConversation], pad_id: int, device: str | torch.device) -> TokenBatch:
    width = max(len(c.ids) for c in conversations)
    ids = torch.full((len(conversations), width), pad_id, dtype=torch.long)
    policy = torch.zeros(len(conversations), width, dtype=torch.bool)
    for row, conversation in enumerate(conversations):
        n = len(conversation.ids)
        ids[row, :n] = torch.tensor(conversation.ids)
        policy[row, :n] = torch.tensor(conversation.mask, dtype=torch.bool)
    predicts = policy[:, 1:]  # the logit at position p predicts token p + 1
    keep = predicts.any(0).nonzero().squeeze(1)
    return TokenBatch(ids.to(device), keep.to(device), ids[:, keep + 1].to(device),
                      predicts[:, keep].float().to(device))


def token_logprobs(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """(B, K) log-probabilities of the kept target tokens under `model` (float32).

    Without a padding mask attention takes its causal fast path (grouped keys/values not repeated, no
    masked flash-attention backward): with micro-batches of 2 the reader adapter's step takes 0.73x the
    masked one's, at the same loss (benchmarks/clock_bounds.py). Pad positions compute values nobody reads."""
    logits = model(input_ids=batch.ids, logits_to_keep=batch.keep, use_cache=False).logits.float()
    return logits.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
