"""A small, real byte-level language model and its corpus (the Python standard library's sources).

Used by `ckptd demo`, by tests that need a model that actually trains, and by accuracy
experiments (e.g. held-out loss after resuming from a compressed checkpoint). Pure torch: this
module imports nothing from ckptd.

Everything here is deterministic: the corpus is read in sorted path order, the model's initial
weights are a function of a seed, and the training batch of a step is a function of
(seed, step, rank, world_size) only, so a run resumed at step k sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256  # one token per byte value
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"})


def stdlib_sources(stdlib: Path | None = None) -> list[Path]:
    """The `*.py` files of the standard library, sorted by path, without third-party and test dirs.

    stdlib: the directory to scan (default: `sysconfig.get_paths()["stdlib"]`).
    """
    root = Path(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def load_corpus(max_bytes: int = 4 * 2**20, stdlib: Path | None = None) -> bytes:
    """The standard library's Python sources concatenated in sorted path order, cut at `max_bytes`.

    Deterministic for a given Python installation. Raises FileNotFoundError when the directory
    holds no Python sources (e.g. a stripped-down interpreter); point `stdlib` elsewhere then.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    parts: list[bytes] = []
    total = 0
    for path in stdlib_sources(stdlib):
        data = path.read_bytes()
        parts.append(data[: max_bytes - total])
        total += len(parts[-1])
        if total >= max_bytes:
            break
    if total == 0:
        where = stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(f"no *.py files under {where}: the corpus needs the standard library's sources")
    return b"".join(parts)


def split_corpus(data: bytes, held_out_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split bytes into (train, held_out) uint8 token tensors; the held-out part is the tail."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_held_out = max(1, int(len(tokens) * held_out_fraction))
    return tokens[:-n_held_out].clone(), tokens[-n_held_out:].clone()


@dataclass(frozen=True)
class CharLMConfig:
    """Shape of a CharLM. context: the longest sequence (tokens) the model accepts."""

    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    context: int = 64
    tie_embeddings: bool = True  # the output projection shares the token embedding's weight


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    """A causal transformer over byte tokens: (batch, time) int64 ids -> (batch, time, 256) logits.

    The initial weights are a function of `seed` alone (the global RNG is neither used nor changed).
    """

    def __init__(self, config: CharLMConfig = CharLMConfig(), seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        # Residual projections are scaled down with depth (GPT-2's scheme) so the stack starts stable.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        norms = {id(p) for m in self.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        for name, param in self.named_parameters():  # a tied weight appears once
            if id(param) in norms and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = residual_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                param.normal_(0.0, std, generator=generator)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {self.config.context}")
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per token) of `model` on inputs x and targets y."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def batch_at(
    tokens: torch.Tensor, batch_size: int, context: int, seed: int, step: int, rank: int = 0, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for `step`: two int64 tensors of shape (batch_size, context).

    The global batch of a step (batch_size * world_size windows drawn with a generator seeded by
    (seed, step)) is split by rank, so a step's batch is a pure function of
    (seed, step, rank, world_size) and does not depend on what ran before.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if len(tokens) < context + 2:
        raise ValueError(f"{len(tokens)} tokens are too few for a context of {context}")
    generator = torch.Generator().manual_seed(_step_seed(seed, step))
    starts = torch.randint(0, len(tokens) - context - 1, (batch_size * world_size,), generator=generator)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]
    windows = tokens[starts[:, None] + torch.arange(context + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def batches(
    train_tokens: torch.Tensor,
    batch_size: int,
    context: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    start_step: int = 0,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (step, inputs, targets) for step = start_step, start_step + 1, ... (see batch_at)."""
    step = start_step
    while True:
        yield (step, *batch_at(train_tokens, batch_size, context, seed, step, rank, world_size))
        step += 1


@torch.no_grad()
def evaluate(model: nn.Module, held_out: torch.Tensor, context: int, n_batches: int = 4, batch_size: int = 16) -> float:
    """Mean loss (nats per token) on fixed windows spread evenly over `held_out`.

    The same windows every call, so values are comparable across runs and restarts. The model's
    train/eval mode is restored afterwards.
    """
    if len(held_out) < context + 2:
        raise ValueError(f"{len(held_out)} held-out tokens are too few for a context of {context}")
    n = n_batches * batch_size
    starts = torch.linspace(0, len(held_out) - context - 1, n).long()
    windows = held_out[starts[:, None] + torch.arange(context + 1)].long()
    was_training = model.training
    model.eval()
    try:
        losses = [lm_loss(model, w[:, :-1], w[:, 1:]).item() for w in windows.split(batch_size)]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
