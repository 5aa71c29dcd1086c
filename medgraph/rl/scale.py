"""The scale path of GRPO training: data parallel over GPUs, and rollouts on a vLLM server.

Data parallel (torch distributed). Launch the same training under `torchrun`
(or `accelerate launch`, which sets the same variables):

    torchrun --nproc-per-node 8 -m medgraph.rl.train --model-dir <sft checkpoint> --out <dir> --profile full

Each rank loads its own copy of the policy on `cuda:<LOCAL_RANK>`, takes every
world-th question of the step (`questions_per_step` must divide by the world
size), rolls out and scores its own groups (a group never spans ranks, so
advantages need no communication), and the policy's backward passes run
through DistributedDataParallel, which averages gradients over ranks. Metrics
are averaged over ranks; only rank 0 evaluates, checkpoints and logs.

vLLM rollouts. Generation dominates GRPO's time; a vLLM server generates
several times faster than `transformers.generate`. Start one on the starting
checkpoint with runtime LoRA loading, for example

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve /path/to/sft-checkpoint \
        --enable-lora --max-lora-rank 64 --max-loras 2 --port 8000

and set `rollout_server: openai:<served model name>@http://host:8000/v1` (LoRA
training only). After every optimizer step the trainer writes the adapter to
a directory the server can read (`sync_dir`, a shared filesystem), loads it
as a new LoRA (`POST /v1/load_lora_adapter`), unloads the previous one, and
rolls out with the new adapter's name. Full fine-tuning with a vLLM server
needs an in-place weight broadcast (NCCL), which this module does not do: use
LoRA, or in-process generation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import requests
import torch
from torch import nn

from medgraph.llm.base import ChatModel, Completion, Conversation, GenerationConfig
from medgraph.llm.hf import TransformersChatModel
from medgraph.llm.openai_http import OpenAIChatModel
from medgraph.settings import redact_uri

T = TypeVar("T")


@dataclass(frozen=True)
class Distributed:
    """This process's place in a data-parallel run (rank 0 of 1 when not launched distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        """Join the process group that torchrun / accelerate describe in the environment, if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), local_rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, requested: str) -> str:
        """`auto` under torchrun with GPUs is this rank's GPU."""
        if self.world > 1 and requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def shard(self, items: Sequence[T]) -> list[T]:
        if len(items) % self.world:
            raise ValueError(f"{len(items)} questions per step do not divide over {self.world} ranks")
        return list(items[self.rank::self.world])

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the policy's loss runs through: DDP (gradient averaging) when distributed."""
        if self.world <= 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.local_rank] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over ranks."""
        if self.world <= 1 or not values:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        device = f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return {k: float(v) / self.world for k, v in zip(keys, tensor.tolist(), strict=True)}


class VllmRollouts(ChatModel):
    """Rollouts on an OpenAI-compatible vLLM server that serves the policy as a runtime-loaded LoRA."""

    def __init__(self, spec: str, sync_dir: Path, concurrency: int = 64):
        from medgraph.llm import parse_llm_spec

        parsed = parse_llm_spec(spec)
        if parsed.kind != "openai":
            raise ValueError(f"rollout_server must be openai:<model>@<base_url>, got {redact_uri(spec)!r}")
        self.base_url, self.name, self.concurrency = parsed.base_url, parsed.target, concurrency
        self.server = OpenAIChatModel(parsed.target, parsed.base_url, concurrency=concurrency)
        self.sync_dir = sync_dir
        self.adapter: str | None = None

    def sync(self, policy: TransformersChatModel, step: int) -> str:
        """Publish the policy's current adapter to the server; later rollouts use it."""
        if not hasattr(policy.model, "peft_config"):
            raise ValueError("vLLM rollouts sync LoRA adapters only: train with lora_r > 0")
        name = f"policy-step-{step:06d}"
        path = (self.sync_dir / name).resolve()
        policy.model.save_pretrained(path)
        self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        previous, self.adapter = self.adapter, name
        self.server.close()
        self.server = OpenAIChatModel(name, self.base_url, concurrency=self.concurrency)
        if previous is not None:
            self._post("unload_lora_adapter", {"lora_name": previous})
        return name

    def _post(self, endpoint: str, payload: dict[str, str]) -> None:
        response = requests.post(f"{self.base_url}/{endpoint}", json=payload, timeout=120)
        if response.status_code >= 400:
            raise RuntimeError(f"POST {redact_uri(self.base_url)}/{endpoint} failed with HTTP {response.status_code}: "
                               f"{response.text[:300]} (is the server started with --enable-lora and "
                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?)")

    def generate(self, conversations: Sequence[Conversation], config: GenerationConfig | None = None,
                 graph_tokens: Sequence[object] | None = None) -> list[Completion]:
        return self.server.generate(conversations, config, graph_tokens)

    def close(self) -> None:
        self.server.close()
