"""Diagnostics of the megatron engine, off unless asked for: rank 0's memory at named phases
(STEPDEPLOY_MEMTRACE=1), a torch.profiler summary of chosen iterations (STEPDEPLOY_PROFILE=FIRST:LAST) and the
host side of a start's first step under cProfile (STEPDEPLOY_PROFILE_FIRST=1).
Standard library + torch only (shipped as a file)."""

from __future__ import annotations

import cProfile
import os
import pstats
import re
from pathlib import Path
from typing import Any

import ckpt
import torch

COMMUNICATION, NCCL_KERNEL = "communication (NCCL)", re.compile(r"nccl", re.I)
# kernel name -> category of GPU time; the first pattern that matches wins
CATEGORIES = (
    (COMMUNICATION, NCCL_KERNEL),
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("grouped GEMM", re.compile(r"grouped|GroupProblemShape", re.I)),  # torch._grouped_mm: cutlass GroupProblemShape
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|wgmma", re.I)),
    # MoE routing: the router's top-k and the sorts of the token permutation (megatron's permute is an argsort
    # and index_select/scatter of the routed rows)
    ("router (top-k, sort)", re.compile(r"topk|sort|bitonic|radix", re.I)),
    ("permutation (gather, scatter, index)", re.compile(r"index|scatter|gather", re.I)),
    ("optimizer (Adam)", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("compiled elementwise (triton)", re.compile(r"^triton_")),  # e.g. triton_red_fused__to_copy_...: not a copy
    ("copies and fills", re.compile(r"memcpy|memset|copy|fill", re.I)),
)


class MemoryTrace:
    """Rank 0's allocated/peak GiB at named phases (out/memtrace.json), when STEPDEPLOY_MEMTRACE=1: what the
    planner's memory model is checked against, component by component."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        wanted = rank == 0 and os.environ.get("STEPDEPLOY_MEMTRACE") == "1"
        self.path = out_dir / "memtrace.json" if wanted else None
        self.phases: dict[str, dict[str, float]] = {}

    def mark(self, phase: str) -> None:
        if self.path is None:
            return
        torch.cuda.synchronize()
        self.phases[phase] = {"allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
                              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
        ckpt.atomic_write_json(self.path, self.phases)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """"FIRST:LAST" (or one iteration "N") -> (first, last); None when unset. ValueError names the form."""
    if not text:
        return None
    first, _, last = text.partition(":")
    try:
        window = (int(first), int(last or first))
    except ValueError:
        raise ValueError(f"STEPDEPLOY_PROFILE={text!r}: expected FIRST:LAST iterations, e.g. 16:17") from None
    if window[0] < 1 or window[1] < window[0]:
        raise ValueError(f"STEPDEPLOY_PROFILE={text!r}: expected 1 <= FIRST <= LAST")
    return window


def categorize(kernels: list[tuple[str, float, int]]) -> dict[str, float]:
    """(kernel name, GPU microseconds, calls) -> microseconds per category (CATEGORIES, then "other")."""
    totals: dict[str, float] = {}
    for name, micros, _calls in kernels:
        category = next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")
        totals[category] = totals.get(category, 0.0) + micros
    return totals


def summarize(kernels: list[tuple[str, float, int]], wall_s: float, iterations: int) -> dict[str, Any]:
    """Where an iteration's time goes: GPU time per category, and the part of the wall time in which no
    compute kernel ran (communication that was not hidden, the host, synchronisation)."""
    per_iteration = {k: v / iterations / 1e6 for k, v in categorize(kernels).items()}
    compute = sum(v for k, v in per_iteration.items() if k != COMMUNICATION)
    wall = wall_s / iterations
    top = sorted(kernels, key=lambda k: -k[1])[:25]
    return {"iterations": iterations, "wall_s": round(wall, 4),
            "gpu_s_by_category": {k: round(v, 4) for k, v in sorted(per_iteration.items(), key=lambda kv: -kv[1])},
            "compute_s": round(compute, 4), "no_compute_s": round(max(0.0, wall - compute), 4),
            "top_kernels": [{"name": n[:160], "s_per_iteration": round(us / iterations / 1e6, 5), "calls": c}
                            for n, us, c in top]}


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 12, min_us: float = 100.0) -> dict[str, Any]:
    """Where the GPU ran no compute kernel: (start us, end us, name) of every kernel in the window -> the gaps
    between the union of the compute kernels' intervals (NCCL kernels do not count: a collective nobody computes
    beside is exposed communication), the total, and the largest with the kernels on either side."""
    compute = sorted((k for k in kernels if not NCCL_KERNEL.search(k[2])), key=lambda k: k[0])
    gaps: list[tuple[float, float, str, str]] = []  # (start, length, kernel before, kernel after)
    end, last = None, ""
    for start, stop, name in compute:
        if end is not None and start - end >= min_us:
            gaps.append((end, start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
    origin = compute[0][0] if compute else 0.0
    largest = sorted(gaps, key=lambda g: -g[1])[:top]
    return {"total_ms": round(sum(g[1] for g in gaps) / 1e3, 3), "count": len(gaps), "min_us": min_us,
            "largest": [{"at_ms": round((g[0] - origin) / 1e3, 3), "ms": round(g[1] / 1e3, 3),
                         "after": g[2][:100], "before": g[3][:100]} for g in largest]}


def kernel_intervals(profiler: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the GPU kernels a stopped torch.profiler recorded."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
            if e.device_type == DeviceType.CUDA]


class StepProfile:
    """torch.profiler over iterations FIRST..LAST (STEPDEPLOY_PROFILE), every rank: out/profile-rank<R>.json
    with GPU time per kernel category, the wall time, and the top kernels (CPU operators' time on a machine
    without a GPU). The profiled iterations are flagged in metrics.jsonl so that step-time means can leave
    them out."""

    def __init__(self, out_dir: Path, rank: int, spec: str | None, first_step: int | None = None) -> None:
        self.window = parse_window(spec)
        self.path = out_dir / f"profile-rank{rank}.json"
        self.profiler: Any = None
        self.on_gpu = False
        self.wall = 0.0
        # with STEPDEPLOY_PROFILE_FIRST=1, this start's first step (`first_step`) under cProfile: FirstStepProfile
        self.first = FirstStepProfile(out_dir, rank, first_step) if os.environ.get(
            "STEPDEPLOY_PROFILE_FIRST") == "1" and first_step else None

    def before(self, iteration: int) -> None:
        if self.first is not None and iteration == self.first.iteration:
            self.first.start()
        if self.window and iteration == self.window[0]:
            from torch.profiler import ProfilerActivity, profile

            self.on_gpu = torch.cuda.is_available()
            self.profiler = profile(activities=[ProfilerActivity.CUDA if self.on_gpu else ProfilerActivity.CPU])
            self.profiler.start()

    def after(self, iteration: int, step_s: float) -> bool:
        """Account the iteration just timed; True when it was profiled."""
        first = self.first if self.first is not None and iteration == self.first.iteration else None
        if first is not None:
            first.stop(step_s)
        if self.profiler is None:
            return first is not None
        self.wall += step_s
        if iteration == self.window[1]:
            self.profiler.stop()
            kernels = []
            for event in self.profiler.key_averages():
                micros = event.self_device_time_total if self.on_gpu else event.self_cpu_time_total
                if micros > 0:
                    kernels.append((event.key, float(micros), int(event.count)))
            result = summarize(kernels, self.wall, self.window[1] - self.window[0] + 1)
            if self.on_gpu:
                result["idle_gaps"] = idle_gaps(kernel_intervals(self.profiler))
            ckpt.atomic_write_json(self.path, result | {"window": list(self.window)})
            self.profiler = None
        return True


# where a first step's host time goes, by the files its functions are in (FirstStepProfile.categories)
HOST_CATEGORIES = (
    ("torch.compile (dynamo, inductor, triton: compiling or loading from its cache)",
     ("/torch/_dynamo/", "/torch/_inductor/", "/torch/_functorch/", "/triton/")),
    ("imports", ("<frozen importlib._bootstrap",)),
    ("waiting for the GPU (synchronize)", ("synchronize",)),
    ("megatron-core", ("/megatron/core/",)),
)


class FirstStepProfile:
    """The host side of the first step after a start under cProfile, every rank: what it does that later steps
    do not (torch.compile loading or compiling kernels, lazy imports, first allocations) by Python function.
    out/first-step-rank<R>-<iteration>.json (one per start): the step's wall time (cProfile's overhead in it),
    the time under each of HOST_CATEGORIES (the cumulative time of the category's outermost functions), and the
    top functions by cumulative and by own time; which functions of the model called into torch.compile and for
    how long (`compile_callers`: a compiled function is named by its call site), and torch.compile's caches
    during the step (`compile_counters`: dynamo's counters that changed, e.g. inductor's fxgraph_cache_hit,
    aot_autograd's autograd_cache_miss)."""

    def __init__(self, out_dir: Path, rank: int, iteration: int, name: str = "first-step") -> None:
        """`name`: what is profiled (the file's name); `start` is a start's model build and checkpoint read
        (STEPDEPLOY_PROFILE_START=1, engine_megatron.train), with `iteration` the one it resumes from."""
        self.iteration, self.path = iteration, out_dir / f"{name}-rank{rank}-{iteration}.json"
        self.profiler = cProfile.Profile()
        self.counters_before: dict[str, dict[str, int]] = {}

    def start(self) -> None:
        self.counters_before = compile_counters()
        self.profiler.enable()

    def stop(self, step_s: float) -> None:
        self.profiler.disable()
        stats = pstats.Stats(self.profiler).stats  # type: ignore[attr-defined]
        ckpt.atomic_write_json(self.path, {"iteration": self.iteration, "step_s": round(step_s, 4),
                                           "categories": categories(stats), "by_cumulative": top(stats, 3),
                                           "by_own_time": top(stats, 2), "compile_callers": compile_callers(stats),
                                           "compile_counters": counter_changes(self.counters_before,
                                                                               compile_counters())})


def function_name(key: tuple[str, int, str]) -> str:
    path, line, name = key
    short = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
    return f"{short}:{line}({name})" if line else name


def categories(stats: dict[Any, Any]) -> dict[str, float]:
    """Seconds under each category: the cumulative time of its functions that no function of it called."""
    out = {}
    for label, marks in HOST_CATEGORIES:
        out[label] = round(sum(row[3] for key, row in stats.items()
                               if within(key, marks) and not any(within(caller, marks) for caller in row[4])), 3)
    return out


def within(key: tuple[str, int, str], marks: tuple[str, ...]) -> bool:
    """A function (cProfile's (file, line, name)) is in a HOST_CATEGORIES category: its file or name has a mark."""
    return any(mark in key[0] or mark in key[2] for mark in marks)


def compile_callers(stats: dict[Any, Any], count: int = 15) -> list[list[Any]]:
    """The functions of the model (not torch's, not built-ins) that called into torch.compile, with the seconds
    under each call edge (a compiled function's frame is dynamo's wrapper, so its caller is the call site):
    [name, seconds, calls], largest first."""
    marks = HOST_CATEGORIES[0][1]
    edges: dict[tuple[str, int, str], list[float]] = {}
    for key, row in stats.items():
        if not within(key, marks):
            continue
        for caller, (_, calls, _, cumulative) in row[4].items():
            if caller[0] != "~" and "/torch/" not in caller[0]:
                edge = edges.setdefault(caller, [0.0, 0])
                edge[0] += cumulative
                edge[1] += calls
    rows = sorted(edges.items(), key=lambda item: item[1][0], reverse=True)[:count]
    return [[function_name(key), round(seconds, 4), int(calls)] for key, (seconds, calls) in rows]


def compile_counters() -> dict[str, dict[str, int]]:
    """torch.compile's counters (torch._dynamo.utils.counters) for the caches and compiles; {} without dynamo."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # a torch without dynamo: nothing to count
        return {}
    return {group: dict(counters[group]) for group in ("inductor", "aot_autograd", "stats") if group in counters}


def counter_changes(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, int]:
    """The counters that changed between two compile_counters() snapshots: {"group/name": change}."""
    changes = {}
    for group, values in after.items():
        for name, value in values.items():
            change = value - before.get(group, {}).get(name, 0)
            if change:
                changes[f"{group}/{name}"] = change
    return dict(sorted(changes.items()))


def top(stats: dict[Any, Any], column: int, count: int = 30) -> list[list[Any]]:
    """The `count` functions with the most time in `column` (2: own, 3: cumulative): [name, seconds, calls]."""
    rows = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:count]
    return [[function_name(key), round(row[column], 4), row[1]] for key, row in rows]
