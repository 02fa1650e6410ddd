"""The megatron engine's checkpoint writer process and the set-up a process's first save would otherwise pay inside
its blocking window: which writer (persistent or forked per save), its environment, megatron-core's write-results
queue, and page-locked host memory ahead. Standard library + torch + megatron-core only (shipped as a file)."""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from metrics import log

SETUP_EXIT_WAIT_S = 60.0
WRITER_DIED_EXIT = 1  # train.py's "anything else"
# a stop signals every process of the run (node_probe.py), the writer and its rank alike: the rank exits by its own
# stop path (exit 143), which disarms the watchdog, within the grace
STOP_SIGNALS, STOP_GRACE_S = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP), 15.0
# ... but only when the rank's own stop began within this long (train.py's handler ignores SIGTERM from its first
# one): a stop signal that reached the writer alone is its death, reported in seconds (issue 36), not after the grace
STOP_NOTICE_S = 2.0


class SaveSetup:
    """The one-off set-up of megatron-core's save, which a process's first save otherwise pays inside its blocking
    window (4.9-8.5 s on an H200; 2.6-3.0 s of a tiny model's first save on a CPU, whose later saves block
    0.1-0.2 s: docs/benchmarks.md), done by a background thread while the first steps run:

    - the writer's results queue: megatron-core's FileSystemWriterAsync creates it on first use, once per process,
      as a multiprocessing Manager -- a server process started with "spawn", a fresh interpreter that imports torch
      and re-runs the main module's imports -- and keeps it in a module global (0.16 `_get_write_results_queue`,
      0.19 `get_write_results_queue`: the same global, which the save then finds made);
    - the imports of the save's strategy (torch.distributed.checkpoint's planner and writer);
    - on GPUs, after the first step: pinned host memory for the device-to-host copy. The save copies each tensor
      with `.to("cpu", non_blocking=True)`, into page-locked memory from torch's caching host allocator, which
      keeps freed blocks in power-of-two size bins and reuses only a block of the same bin: a later save reuses
      the first one's blocks, the first one page-locks them (cudaHostAlloc, about the checkpoint's size). pin()
      allocates a block per tensor of the sizes the save will copy, all held at once as the save holds them, then
      frees them into the cache (the memory the first save would keep cached anyway, held a little earlier).

    save() waits for the thread (inside its "saving" window: a first save sooner than the set-up waits for the
    rest of it, and no longer than it would have taken there). What is written does not change."""

    def __init__(self, files: Any, rank: int, persistent: bool = False) -> None:
        self.files, self.rank = files, rank
        self.threads: list[threading.Thread] = []
        self._start("writer", functools.partial(start_writer, rank, persistent))

    def pin(self, sizes: list[int]) -> None:
        device = torch.cuda.current_device()

        def pin_blocks() -> str:
            torch.cuda.set_device(device)
            held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
            return f"{len(held)} blocks, {sum(sizes) / 2**30:.2f} GiB"
        self._start("host_memory", pin_blocks)

    def wait(self, timeout: float | None = None) -> float:
        """Wait for the set-up in progress (`timeout`: for each part). -> the seconds waited"""
        began = time.time()
        for thread in self.threads:
            thread.join(timeout)
        self.threads = [thread for thread in self.threads if thread.is_alive()]
        return time.time() - began

    def _start(self, part: str, work: Any) -> None:
        def run() -> None:
            began = time.time()
            try:
                done = work()
            except Exception as exc:  # the save then does it itself, as before
                log(self.rank, f"checkpoint set-up ({part}) failed, the first save will do it: {exc!r}")
                return
            self.files.phase("save_setup", part=part, began=began, seconds=round(time.time() - began, 3),
                             **({"done": done} if isinstance(done, str) else {}))

        thread = threading.Thread(target=run, name=f"checkpoint-setup-{part}", daemon=True)
        thread.start()
        self.threads.append(thread)


def pin_ahead() -> bool:
    """Whether to page-lock the save's host memory ahead (STEPDEPLOY_CKPT_PIN_AHEAD=1; off by default). Measured on
    an H200 (docs/benchmarks.md, issue 21) it does not pay either way:
    - torch's default host allocator (cudaHostAlloc): the 9.63 GiB locked in a thread stalled the step loop as long
      as the save would have (step 2: 7.67 s against 0.63 s), so the first save's stall only moved into a step;
    - with PYTORCH_CUDA_ALLOC_CONF's pinned_use_cuda_host_register (malloc + cudaHostRegister, 8 threads) the loop
      ran on (steps 2-6: 0.64-0.71 s; a first host copy of 10 GiB took 2.0-2.4 s instead of 5.1-12.8 s), but the
      first save then blocked 8.9 s: megatron-core's writer is a process forked per save, and a fork copies
      registered anonymous memory at once (8.1 s with 10 GiB registered; 0.008 s with cudaHostAlloc's)."""
    return os.environ.get("STEPDEPLOY_CKPT_PIN_AHEAD", "0") == "1"


def writer_kind() -> str:
    """The asynchronous save's writer process (STEPDEPLOY_CKPT_WRITER):

    - persistent (the default): megatron-core's persistent worker, spawned once per rank; it copies the tensors to
      its own page-locked host memory, which it keeps between saves and locks ahead, before the first save, with
      cudaHostRegister (writer_environment): a process's first save then blocks as briefly as the later ones;
    - fork: a process forked per save from the rank, which makes the host copies itself (the first save page-locks
      its memory with cudaHostAlloc inside the blocking window: 5-7 s on an H200, docs/benchmarks.md)."""
    kind = os.environ.get("STEPDEPLOY_CKPT_WRITER", "persistent")
    if kind not in ("persistent", "fork"):
        raise ValueError(f"STEPDEPLOY_CKPT_WRITER={kind!r}: persistent or fork")
    return kind


# the persistent writer's page-locked memory: malloc + cudaHostRegister over 8 threads (2.0-2.4 s for 10 GiB on an
# H200, a GPU loop beside it +15 %; cudaHostAlloc 5.1-12.8 s and 12-35x). Registered memory makes every fork of its
# process copy it (8.1 s for 10 GiB): the writer never forks, the rank keeps cudaHostAlloc.
WRITER_HOST_ALLOC = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


@contextlib.contextmanager
def writer_environment(persistent: bool) -> Any:
    """While the persistent writer is spawned: its PYTORCH_CUDA_ALLOC_CONF adds WRITER_HOST_ALLOC (a spawned process
    reads the environment as it is then; this process's allocator read its settings long before)."""
    if not persistent:
        yield
        return
    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, (before, WRITER_HOST_ALLOC)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before


def start_writer(rank: int, persistent: bool) -> str | None:
    """The set-up's writer part: megatron-core's write-results queue, and the persistent worker where megatron-core
    can start it ahead (0.19's warmup_persistent_caller; 0.16 starts it at the first request)."""
    write_results_queue()
    if not persistent:
        return None
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    warmup = getattr(AsyncCallsQueue, "warmup_persistent_caller", None)
    if warmup is None:
        return None
    with writer_environment(True):
        warmup(rank)
    return "persistent writer started"


def pin_host_blocks(sizes: list[int]) -> None:
    """In the persistent writer: page-lock one host block per tensor a save copies, all held at once as a save
    holds them, then free them into torch's caching host allocator, whose blocks the save's copies then reuse (it
    reuses a freed block of the same power-of-two bin only)."""
    if sizes and torch.cuda.is_available():
        held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
        del held


def write_results_queue() -> Any:
    """megatron-core's write-results queue, created (a Manager process) on the first call in this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies import torch as _torch_strategy  # noqa: F401 (its imports)

    make = getattr(filesystem_async, "get_write_results_queue", None)  # 0.19
    return (make or filesystem_async._get_write_results_queue)()  # 0.16


def writer_process(queue: Any) -> Any:
    """megatron-core's persistent writer process once started, else None; read without side effects (from any
    thread): 0.19 keeps one per process on the class (PersistentAsyncCaller._persistent_process, which
    warmup_persistent_caller may start before any request), 0.16 on the queue's caller, started by its first
    request."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    process = (getattr(PersistentAsyncCaller, "_persistent_process", None)
               or getattr(getattr(queue, "persistent_caller", None), "process", None))
    return process if process is not None and process.pid is not None else None


class WriterWatchdog:
    """A thread that turns the persistent writer's death into `on_death(process)`, at once. megatron-core waits
    for the writer without a timeout (0.16-0.19: `preload_q.join()` while it copies the tensors, a sleep loop on
    its completion queue for a blocking finalize), so a writer killed mid-save (the OOM killer) would otherwise
    hang the rank in "saving" until the heartbeat's limit and the hang timeout declared it (~10 minutes).

    Armed from construction (the Saver's first request to the writer) until disarm(), which the Saver calls
    before it ends the writer itself (finish(), abort()): a writer it closed is never a death. `locate()` gives
    the writer's process, or None while it is not started yet (0.16 starts it inside the first request). A writer
    ended by a stop signal gets `stop_grace_s` for the rank's own stop to disarm the watchdog first."""

    def __init__(self, locate: Callable[[], Any], on_death: Callable[[Any], None], interval: float = 0.5,
                 stop_grace_s: float = STOP_GRACE_S, stop_notice_s: float = STOP_NOTICE_S) -> None:
        self.locate, self.on_death, self.interval, self.stop_grace_s = locate, on_death, interval, stop_grace_s
        self.stop_notice_s = stop_notice_s
        self.disarmed = threading.Event()
        self.lock = threading.Lock()  # disarm() returns only once a death being reported is done
        self.thread = threading.Thread(target=self._watch, name="checkpoint-writer-watchdog", daemon=True)
        self.thread.start()

    def disarm(self) -> None:
        with self.lock:
            self.disarmed.set()

    def _watch(self) -> None:
        while not self.disarmed.is_set():
            process = self.locate()
            if process is None:
                self.disarmed.wait(self.interval)
                continue
            process.join(self.interval)  # returns at once when the process ends (it waits on its sentinel)
            if process.exitcode is None:
                continue
            if -process.exitcode in STOP_SIGNALS:
                self._stop_grace()
            with self.lock:
                if not self.disarmed.is_set():
                    self.on_death(process)
            return

    def _stop_grace(self) -> None:
        """The writer ended by a stop signal: up to stop_grace_s for the rank's own stop to disarm the watchdog,
        unless the rank has not begun stopping within stop_notice_s (the signal reached the writer alone)."""
        began = time.monotonic()
        while not self.disarmed.wait(0.05):
            waited = time.monotonic() - began
            if waited >= self.stop_grace_s or (waited >= self.stop_notice_s and not _rank_stopping()):
                return


def _rank_stopping() -> bool:
    """Whether this process's stop began: train.py's SIGTERM handler ignores SIGTERM from its first one on."""
    return signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def exit_cause(exitcode: int) -> str:
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def writer_died(rank: int, files: Any, process: Any, during: str) -> None:
    """The rank cannot save any more and may be blocked inside megatron-core waiting for the writer: log the cause,
    record the exit, end this process's other children (megatron's results Manager) and exit at once (os._exit:
    the main thread cannot be interrupted). Nothing when the rank already recorded an exit of its own (a stop)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(files.status.read_text()).get("state") == "exited":
            return
    message = f"checkpoint writer process {process.pid} died ({exit_cause(process.exitcode)}) {during}"
    log(rank, f"{message}: the rank cannot save, it exits")
    with contextlib.suppress(Exception):
        files.exited(WRITER_DIED_EXIT, message)
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(WRITER_DIED_EXIT)


def snapshot_host_tensors(state: Any) -> int:
    """Copy, in place of the originals, the host-memory tensors of a sharded state dict handed to the persistent
    writer; returns how many. megatron-core's worker makes its "host copy" with tensor.to("cpu"), which for a
    tensor already in host memory is the tensor itself, shared with the rank through torch.multiprocessing: the
    next optimizer step would change it while it is written (a torn checkpoint; the forked writer copies on write
    instead). The host tensors: an offloaded optimizer's master weights and moments, every tensor of a CPU run.
    Applies megatron's factories first (save() would, on the same dict), so the tensors they make are copied too."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(state)
    copied = 0

    def copy(item: Any) -> Any:
        nonlocal copied
        if isinstance(item, ShardedTensor) and item.data is not None and item.data.device.type == "cpu":
            item.data = item.data.clone()
            copied += 1
        return item

    dict_list_map_inplace(copy, state)
    return copied
