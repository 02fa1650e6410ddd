"""The `torch` engine: a small real decoder transformer (dense, or MoE when the model has experts) trained
with DDP over gloo on CPU, on deterministic synthetic tokens. Standard library + torch only (shipped).

The tokens come from data.py: a synthetic Markov-chain stream (each token has a few likely successors, so the
loss has somewhere to fall to: from ln(vocab) towards the chain's entropy), or an indexed dataset prepared by
`stepdeploy data prepare`. Micro-batch m of iteration i on data-parallel rank d is a function of (i, m, d) alone,
so a resumed run sees the same data it would have seen.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import data
import moe_stats
import torch
import torch.distributed as dist
import torch.nn.functional as F
from metrics import RankFiles, log
from schedule import lr_at
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_ckpt import Saver


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def norm(m: dict[str, Any]) -> nn.Module:
    return RMSNorm(m["hidden_size"]) if m["normalization"] == "RMSNorm" else nn.LayerNorm(m["hidden_size"])


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of [b, heads, s, d]."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, m: dict[str, Any]) -> None:
        super().__init__()
        self.heads, self.groups, self.dim = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
        width = (self.heads + 2 * self.groups) * self.dim
        self.qkv = nn.Linear(m["hidden_size"], width, bias=m["add_bias_linear"] or m["add_qkv_bias"])
        self.proj = nn.Linear(self.heads * self.dim, m["hidden_size"], bias=m["add_bias_linear"])
        self.rope = m["position_embedding_type"] == "rope"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.dim, self.groups * self.dim, self.groups * self.dim], -1)
        q = q.view(b, s, self.heads, self.dim).transpose(1, 2)
        k = k.view(b, s, self.groups, self.dim).transpose(1, 2)
        v = v.view(b, s, self.groups, self.dim).transpose(1, 2)
        if self.rope:
            q, k = rope(q), rope(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.dim))


class Mlp(nn.Module):
    def __init__(self, hidden: int, ffn: int, gated: bool, bias: bool) -> None:
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(hidden, 2 * ffn if gated else ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h))


class Moe(nn.Module):
    """Top-k routed experts (+ an optional shared expert); every expert runs on the tokens routed to it."""

    def __init__(self, m: dict[str, Any]) -> None:
        super().__init__()
        moe, hidden = m["moe"], m["hidden_size"]
        self.topk, self.score = moe["topk"], moe["score_function"]
        self.router = nn.Linear(hidden, moe["num_experts"], bias=False)
        # Load balancing as the catalog says (megatron-core's schemes): an auxiliary loss (aux_loss_coeff > 0), and
        # with expert_bias a bias added to the scores for the choice only, nudged after every step to the mean load.
        self.balancing = moe.get("load_balancing", "aux_loss")
        self.aux_coeff, self.bias_rate = moe.get("aux_loss_coeff", 1e-2), moe.get("bias_update_rate", 1e-3)
        self.register_buffer("expert_bias", torch.zeros(moe["num_experts"]) if moe.get("router_expert_bias") or
                             self.balancing == "expert_bias" else None)
        # not a buffer: DDP would overwrite every rank's counts with rank 0's at each forward
        self.tokens_per_expert = torch.zeros(moe["num_experts"])
        self.aux: torch.Tensor | None = None  # this forward's auxiliary loss, added to the step's loss
        self.experts = nn.ModuleList(Mlp(hidden, moe["ffn_hidden_size"], m["gated_linear_unit"], False)
                                     for _ in range(moe["num_experts"]))
        shared = moe["shared_expert_ffn_hidden_size"]
        self.shared = Mlp(hidden, shared, m["gated_linear_unit"], False) if shared else None
        self.stats: moe_stats.RouterStats | None = None  # set by train(): tokens per expert, per step
        self.slot = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        probs = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        scores = probs if self.expert_bias is None else probs + self.expert_bias
        chosen = scores.topk(self.topk, dim=-1).indices
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=probs.shape[-1])
        if self.stats is not None:
            self.stats.add(self.slot, counts, flat.shape[0])
        self.aux = None
        if torch.is_grad_enabled():
            self.tokens_per_expert += counts
            if self.aux_coeff > 0:  # with expert_bias too, as the megatron engine
                # megatron-core's switch load-balancing loss: E x coeff / (T^2 k) x sum_i(probs_i x tokens_i)
                tokens = flat.shape[0]
                self.aux = (probs.sum(0) * counts).sum() * (probs.shape[-1] * self.aux_coeff
                                                            / (tokens * tokens * self.topk))
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            # An expert that gets no token still runs (on zero rows): its gradient is then zero, not
            # missing, so DDP needs no unused-parameter search.
            token, slot = (chosen == index).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)

    @torch.no_grad()
    def update_bias(self) -> None:
        """After the step: every rank's counts summed, the bias nudged by rate x sign(mean - load), counts
        cleared (the aux-loss scheme keeps no bias: counts cleared only)."""
        if self.expert_bias is not None and self.balancing == "expert_bias":
            load = self.tokens_per_expert.clone()
            if dist.is_initialized():
                dist.all_reduce(load)
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


class Block(nn.Module):
    def __init__(self, m: dict[str, Any], index: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = norm(m), Attention(m), norm(m)
        moe = m["moe"]
        if moe and index >= moe["first_dense_layers"]:
            self.ffn: nn.Module = Moe(m)
        else:
            self.ffn = Mlp(m["hidden_size"], m["ffn_hidden_size"], m["gated_linear_unit"], m["add_bias_linear"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, m: dict[str, Any]) -> None:
        super().__init__()
        self.embed = nn.Embedding(m["vocab_size"], m["hidden_size"])
        self.pos = (nn.Embedding(m["max_position_embeddings"], m["hidden_size"])
                    if m["position_embedding_type"] == "learned_absolute" else None)
        self.blocks = nn.ModuleList(Block(m, i) for i in range(m["num_layers"]))
        self.final = norm(m)
        self.out = nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
        if not m["untie_embeddings_and_output_weights"]:
            self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.out(self.final(x))


def train(cfg: dict[str, Any], out_dir: Path, files: RankFiles) -> int:
    rank, world, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    m, train_cfg = cfg["model"], cfg["training"]
    seq, mbs, gbs = train_cfg["seq_length"], train_cfg["micro_batch_size"], train_cfg["global_batch_size"]
    micro_batches = gbs // (mbs * world)
    torch.manual_seed(train_cfg["seed"])
    model = Decoder(m)
    stats = watch_routers(model, m)
    moes = [block.ffn for block in model.blocks if isinstance(block.ffn, Moe)]
    if not cfg.get("parallel", {}).get("router_bias_update", True):  # --layout router_bias_update=off: a control
        for ffn in moes:
            ffn.bias_rate = 0.0
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=train_cfg["lr"], weight_decay=0.01)
    files.phase("model")
    saver = Saver(out_dir / "checkpoints", files, train_cfg.get("keep_checkpoints", 2), writes=local_rank == 0)
    loading = time.time()
    start = saver.resume(model, optimizer)
    files.phase("resumed", iteration=start, load_s=round(time.time() - loading, 3))
    source = data.source_for(cfg, rank, micro_batches, "cpu", megatron=False)
    params = sum(p.numel() for p in model.parameters())
    log(rank, f"torch engine: {params:,} parameters, world {world}, {micro_batches} micro-batch(es) of {mbs}x{seq}, "
              f"iterations {start + 1}..{train_cfg['iterations']}")
    with saver.discarding():  # a stop or a failure: this start's uncommitted staging directory goes
        for iteration in range(start + 1, train_cfg["iterations"] + 1):
            began = time.perf_counter()
            lr = lr_at(iteration, cfg["training"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros(())
            for micro in range(micro_batches):
                tokens = source.micro_batch(iteration, micro)
                logits = ddp(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                aux = sum((ffn.aux for ffn in moes if ffn.aux is not None), torch.zeros(()))
                ((loss + aux) / micro_batches).backward()  # the LM loss is what is reported, as megatron does
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step = time.perf_counter() - began
            for ffn in moes:
                ffn.update_bias()
            extra = stats.reduce() if stats is not None else {}
            report(cfg, files, iteration, loss_sum / micro_batches, grad_norm, lr, step, world, extra)
            if iteration == start + 1:
                files.phase("first_step", iteration=iteration, step_s=round(step, 4))
            saver.poll()
            if should_save(iteration, train_cfg):
                saver.save(model, optimizer, iteration)
        saver.finish(train_cfg["iterations"])
    return 0


def watch_routers(model: Decoder, m: dict[str, Any]) -> moe_stats.RouterStats | None:
    """Count every MoE layer's routed tokens per expert (None for a dense model)."""
    if not m["moe"]:
        return None
    stats = moe_stats.RouterStats(m["num_layers"], m["moe"]["num_experts"], m["moe"]["topk"], "cpu")
    for index, block in enumerate(model.blocks):
        if isinstance(block.ffn, Moe):
            block.ffn.stats, block.ffn.slot = stats, index
            stats.present[index] = 1.0
    return stats


def report(cfg: dict[str, Any], files: RankFiles, iteration: int, loss: torch.Tensor, grad_norm: torch.Tensor,
           lr: float, step: float, world: int, extra: dict[str, Any] | None = None) -> None:
    """All-reduce the loss, gather every rank's step time, write the metrics line (rank 0), beat."""
    loss = loss.clone()
    dist.all_reduce(loss)
    times = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(times, torch.tensor([step]))
    files.beat(iteration)
    if files.rank != 0:
        return
    train_cfg = cfg["training"]
    tokens = train_cfg["global_batch_size"] * train_cfg["seq_length"]
    slowest = max(t.item() for t in times)
    values = {"iteration": iteration, "loss": round(loss.item() / world, 5), "grad_norm": round(grad_norm.item(), 5),
              "lr": lr, "step_time_s": round(slowest, 4), "tokens_per_s": round(tokens / slowest, 1),
              "rank_step_time_s": [round(t.item(), 4) for t in times], "time": time.time(), **(extra or {})}
    files.record(values)
    log(0, f"iter {iteration}/{train_cfg['iterations']} loss {values['loss']:.4f} grad_norm "
           f"{values['grad_norm']:.3f} lr {lr:.2e} step {slowest:.3f}s {values['tokens_per_s']:.0f} tok/s")


def should_save(iteration: int, train_cfg: dict[str, Any]) -> bool:
    interval = train_cfg["save_interval"]
    return iteration == train_cfg["iterations"] or bool(interval and iteration % interval == 0)
