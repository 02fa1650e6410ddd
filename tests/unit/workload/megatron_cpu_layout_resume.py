"""Run by test_megatron_layouts.py in a process of its own: save and resume of the layouts megatron_cpu_layouts.py
trains, on 2 CPU ranks (gloo), with the engine's Saver (asynchronous: a forked writer) and resume:
- vpp: tiny-dense, PP 2 x VPP 2 (two model chunks per rank, keyed model0/model1 as megatron's training loop does);
- offload: tiny-dense, DP 2, the optimizer on the host (HybridDeviceOptimizer, precision-aware).
Each trains 2 steps, saves checkpoint 2, trains 2 more while it is written (the uninterrupted run), commits; then
a model and optimizer from another seed resume from checkpoint 2 and take the same 2 steps. Each rank reports the
losses of both runs' last 2 steps and how many parameters (and fp32 master weights) differ from the uninterrupted
run's before the resume and after its 2 steps; rank 0 prints one JSON line with every rank's report per layout.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402,F401 (a process spawned from here -- a rank's checkpoint writer -- needs its set-up)

CASES = {"offload": "mbs=2,offload=on,precision_aware_optimizer=on", "vpp": "pp=2,vpp=2,mbs=2"}


def resume_case(name: str, layout_text: str, workdir: Path) -> dict[str, Any]:
    import megatron_ckpt
    import megatron_resume
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_cpu_layouts import Layout
    from metrics import RankFiles

    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank}
    try:
        first = Layout("tiny-dense", layout_text, gbs=4)
        report["losses_before_save"] = [first.step() for _ in range(2)]
        ckpt_dir = workdir / name / "checkpoints"
        saver = megatron_ckpt.Saver(ckpt_dir, RankFiles(workdir / name / "out", rank), 2, rank)
        saver.save(first.model, first.optimizer, 2)
        report["losses_continued"] = [first.step() for _ in range(2)]  # while checkpoint 2 is written
        saver.finish(2)
        dist.barrier()  # rank 0 commits after the finalize every rank took part in
        report["committed"] = sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("."))
        continued = {n: p.detach().clone() for n, p in first.model.named_parameters()}
        continued_master = _master_weights(first.optimizer)
        second = Layout("tiny-dense", layout_text, gbs=4, seed=7)
        report["params_differing_before"] = _differing(second.model, continued)
        report["resumed"] = megatron_resume.resume(second.model, second.optimizer, ckpt_dir, rank)
        report["losses_resumed"] = [second.step() for _ in range(2)]
        report["params_differing_after"] = _differing(second.model, continued)
        report["params"] = len(continued)
        master = _master_weights(second.optimizer)
        report["master_weights"] = [len(continued_master), len(master)]
        report["master_differing_after"] = sum(not torch.equal(a, b) for a, b in zip(master, continued_master,
                                                                                      strict=True))
    except Exception as exc:  # reported, so the test can say what failed on which rank
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    ps.destroy_model_parallel()
    return {"name": name, "ranks": gathered}


def _master_weights(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 weights the optimizer steps (the distributed optimizer's shards; with offload, the host copies)."""
    import megatron_ckpt

    found = []
    for inner in megatron_ckpt.inner_optimizers(optimizer):
        stepped = getattr(inner.optimizer, "cpu_optimizers", None) or [inner.optimizer]
        groups = [g for o in stepped for g in o.param_groups]
        found += [p.detach().clone() for g in groups for p in g["params"]]
    return found


def _differing(model: Any, reference: dict[str, torch.Tensor]) -> int:
    return sum(not torch.equal(p, reference[n]) for n, p in model.named_parameters())


def resume_cases(workdir: Path) -> list[dict[str, Any]]:
    return [resume_case(name, layout, workdir) for name, layout in CASES.items()]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from megatron_cpu_layouts import main

    main(sys.argv[1], "resume")
