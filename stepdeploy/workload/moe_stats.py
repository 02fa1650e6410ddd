"""Expert load balance, router bias drift and dropped tokens, per step and per MoE layer, for both engines
(standard library + torch only; shipped as a file).

Each router adds the tokens it sent to each expert (its routing map, summed over the tokens) while gradients
are on: a full-recompute's second forward and evaluation passes are not counted twice, as megatron-core's own
expert-bias counter does. `reduce()` sums the counts over every rank (tensor-parallel ranks that see the same
tokens scale every expert alike, so max/mean is unchanged) and each layer's expert bias over the ranks that hold
the layer (the same on each: the sum over their number is the bias), and clears the counts for the next step.
Layers are named by their global 1-based number; MTP layers come after the decoder's (megatron numbers them so).

    max/mean   the busiest expert's tokens over the mean: 1.0 is perfect balance; its ceiling E/k (experts over
               the experts each token goes to: `moe_load_ceiling`) is one expert taking every token.
               Computed over the tokens of one global batch.
    router_bias          each layer's largest |expert bias|. It grows by the update rate every step while any one
                         expert stays on one side of the mean load: an expert that is never busy does so too.
    router_bias_busiest  the expert bias of each layer's busiest expert of the step: below zero and falling when
                         the update pushes against it (bias += rate x sign(mean load - load)).
    dropped    the fraction of (token, expert) assignments the router did not deliver (a capacity factor
               drops them); 0 for the dropless dispatchers stepdeploy renders.
    aux_loss   megatron-core's load-balancing loss of each layer before its coefficient (what megatron logs as
               load_balancing_loss: about 1 when balanced, up to E/k collapsed), averaged over the step's
               micro-batches, read from megatron's tracker (`moe_aux_loss`, and `moe_aux_loss_mean` over the
               layers); the tracker is cleared each step (megatron's training loop does so when it logs).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist


class RouterStats:
    def __init__(self, slots: int, experts: int, topk: int, device: str, micro_batches: int = 1) -> None:
        self.experts, self.topk, self.device, self.micro_batches = experts, topk, device, max(micro_batches, 1)
        self.counts = torch.zeros(slots, experts, device=device)
        self.assigned = torch.zeros(slots, device=device)  # tokens x topk the routers were asked to route
        self.present = torch.zeros(slots, device=device)  # 1 where this rank holds the layer's router
        self.bias_of: dict[int, Any] = {}  # slot -> the router's expert bias (None without one)

    def add(self, slot: int, routed: torch.Tensor, tokens: int) -> None:
        """`routed`: tokens sent to each expert by one forward of the router in layer slot+1."""
        if torch.is_grad_enabled():
            self.counts[slot] += routed.to(self.counts.dtype)
            self.assigned[slot] += tokens * self.topk

    def watch_megatron(self, model: Any) -> int:
        """Hook every megatron-core TopKRouter of `model`: (probs, routing_map) = router(input). -> routers hooked"""
        from megatron.core.transformer.moe.router import TopKRouter

        hooked = 0
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.layer_number is not None:
                slot = module.layer_number - 1
                self.present[slot] = 1.0
                self.bias_of[slot] = module if getattr(module, "enable_expert_bias", False) else None
                module.register_forward_hook(self._megatron_hook(slot))
                hooked += 1
        return hooked

    def _megatron_hook(self, slot: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            routing_map = output[1]
            self.add(slot, routing_map.sum(dim=0), routing_map.shape[0])
        return hook

    def reduce(self) -> dict[str, Any]:
        """The step's figures (every rank calls it: one collective), counts cleared."""
        slots = self.counts.shape[0]
        bias = torch.zeros(slots, self.experts, device=self.device)  # summed over the ranks holding the layer
        for slot, router in self.bias_of.items():
            if router is not None and router.expert_bias is not None:
                bias[slot] = router.expert_bias.detach().float()
        aux, has_aux = aux_losses(slots, self.device)
        flag = torch.full((1,), float(has_aux), device=self.device)  # ranks whose tracker held a loss
        summed = torch.cat([self.counts.flatten(), self.assigned, self.present, aux, flag, bias.flatten()])
        if dist.is_initialized():
            dist.all_reduce(summed)
        summed = summed.cpu()  # one device-to-host copy for every figure below
        cut = slots * self.experts
        counts = summed[:cut].view(slots, self.experts)
        assigned, present = summed[cut:cut + slots], summed[cut + slots:cut + 2 * slots]
        holders = present.clamp_min(1.0)
        aux = summed[cut + 2 * slots:cut + 3 * slots] / holders / self.micro_batches
        has_aux = bool(summed[cut + 3 * slots] > 0)
        bias = summed[cut + 3 * slots + 1:].view(slots, self.experts) / holders.unsqueeze(1)
        self.counts.zero_()
        self.assigned.zero_()
        busiest = bias.gather(1, counts.argmax(dim=1, keepdim=True)).squeeze(1)
        out = summarise(counts, assigned, present, bias.abs().amax(dim=1), bool(self.bias_of)
                        and any(r is not None for r in self.bias_of.values()), ceiling=self.experts / self.topk,
                        busiest_bias=busiest)
        if has_aux:
            per_layer = {str(s + 1): round(float(aux[s]), 5) for s in range(slots) if present[s] > 0}
            out |= {"moe_aux_loss": per_layer,
                    "moe_aux_loss_mean": round(sum(per_layer.values()) / len(per_layer), 5) if per_layer else None}
        return out


def summarise(counts: torch.Tensor, assigned: torch.Tensor, present: torch.Tensor, bias: torch.Tensor,
              has_bias: bool, ceiling: float | None = None, busiest_bias: torch.Tensor | None = None
              ) -> dict[str, Any]:
    load: dict[str, float] = {}
    for slot in range(counts.shape[0]):
        total = float(counts[slot].sum())
        if present[slot] > 0 and total > 0:
            load[str(slot + 1)] = round(float(counts[slot].max()) * counts.shape[1] / total, 4)
    routed, asked = float(counts.sum()), float(assigned.sum())
    out: dict[str, Any] = {"moe_load": load, "moe_load_max": max(load.values()) if load else None,
                           "moe_dropped": round(max(0.0, 1.0 - routed / asked), 6) if asked else None}
    if ceiling is not None:
        out["moe_load_ceiling"] = round(ceiling, 4)
    if has_bias:
        per_layer = {str(s + 1): round(float(bias[s]), 6) for s in range(bias.shape[0]) if present[s] > 0}
        out |= {"router_bias": per_layer, "router_bias_absmax": max(per_layer.values()) if per_layer else None}
        if busiest_bias is not None:
            out["router_bias_busiest"] = {str(s + 1): round(float(busiest_bias[s]), 6) for s in range(bias.shape[0])
                                          if present[s] > 0}
    return out


def aux_losses(slots: int, device: str) -> tuple[torch.Tensor, bool]:
    """This rank's load-balancing losses of the step per layer slot (megatron-core's tracker: the sum over its
    micro-batches of each router's loss before the coefficient; zeros for layers it does not hold), whether the
    tracker had any, and the tracker cleared for the next step. Zeros where megatron-core's MoE code is not loaded
    (the torch engine: nothing is imported for it)."""
    out = torch.zeros(slots, device=device)
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        return out, False
    entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None or "values" not in entry:
        return out, False
    values = entry["values"].detach().float()
    n = min(slots, values.numel())
    out[:n] = values[:n].to(device)
    entry["values"].zero_()
    return out, True


def mtp_losses(layers: int, micro_batches: int, device: str) -> torch.Tensor:
    """This rank's MTP losses of the step, one per MTP layer, averaged over its micro-batches (megatron-core's
    tracker sums them on the last pipeline stage; zeros elsewhere), and the tracker cleared for the next step.
    The caller averages them over the last-stage ranks, as it does the LM loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "values" not in tracker:
        return torch.zeros(layers, device=device)
    values = tracker["values"].detach().float().clone() / max(micro_batches, 1)
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return values
