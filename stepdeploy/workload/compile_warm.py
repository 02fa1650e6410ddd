"""What a start's first step would compute before torch.compile can use its caches, computed in a thread while the
model is built and the checkpoint read (issue 37 item 3): the hashes of torch's and triton's own sources that key
the caches (0.57 s of a restart's first step on the H100, cProfile, call AY). And a start that resumes loads its
kernels in its own process (compile_in_process): they are in the node's compile cache, and inductor's pool of
compile workers would only cost its start (0.2 s of the same first step; the pool is not ready in time to be used).
Every step is best effort: these are torch's private functions, and a version without one loses only the head
start. Standard library + torch only (shipped as a file).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from metrics import log


def _steps() -> list[tuple[str, Callable[[], object]]]:
    from torch._inductor import codecache

    return [("torch_key", codecache.torch_key), ("triton_key", codecache.CacheBase.get_system)]


def start(rank: int, device: int | None) -> threading.Thread:
    """Begin in a daemon thread; returns it (join it to wait, e.g. in a test). `device`: the rank's GPU, made the
    thread's own (a new thread's current device is 0: the system key reads the current device's properties)."""

    def run() -> None:
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            steps = _steps()
        except (ImportError, AttributeError) as exc:
            log(rank, f"compile caches not warmed ahead: {exc!r}")
            return
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # best effort: the first step computes it itself
                log(rank, f"compile caches: {name} not warmed ahead: {exc!r}")

    thread = threading.Thread(target=run, name="compile-warm", daemon=True)
    thread.start()
    return thread


def compile_in_process(rank: int) -> None:
    """Kernels compiled (or loaded from the cache) in this process, without inductor's worker pool."""
    try:
        from torch._inductor import config

        config.compile_threads = 1
    except (ImportError, AttributeError) as exc:
        log(rank, f"compile workers left as they are: {exc!r}")
