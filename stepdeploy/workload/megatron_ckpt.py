"""The megatron engine's checkpoints: megatron-core dist-checkpointing of the model and the (distributed)
optimizer into a directory all ranks share, written in the background and committed by rank 0 with ckpt.py's
protocol (Saver), then copied to the node's memory (host_copy.py); the restore is megatron_resume.py. Standard
library + torch + megatron-core only (shipped as a file).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import time
from pathlib import Path
from typing import Any

import ckpt
import ckpt_room
import host_copy
import megatron_writer
import torch
import torch.distributed as dist
from megatron_state import (  # noqa: F401 (re-exported: the engine's and the tests' names)
    checkpoint_metadata,
    host_copy_sizes,
    inner_optimizers,
    materialize_optimizer_state,
    restore_adam_steps,
    sharded_state,
)
from megatron_writer import SETUP_EXIT_WAIT_S, SaveSetup, pin_ahead, pin_host_blocks, writer_environment, writer_kind
from metrics import log


class Saver:
    """megatron-core dist-checkpointing saves, asynchronous by default (STEPDEPLOY_CKPT_ASYNC=0: synchronous).

    The foreground -- the step loop waits for it, the heartbeat says "saving" -- builds the sharded state dict,
    plans the save and has the tensors copied to host memory; a writer process writes and fsyncs them. The writer
    (writer_kind()) is megatron-core's persistent worker by default (AsyncCallsQueue(persistent=True): one process
    per rank, spawned once, which makes the host copies itself from the rank's GPU tensors and keeps its
    page-locked memory between saves), or a process forked per save (TemporalAsyncCaller; the host copies made
    by the rank). poll(), called by every rank after every step, finalizes the save once every rank's write ended
    (megatron's finalize: write results gathered, metadata written); then rank 0 seals the staging directory and
    commits it (ckpt.py), retention's deletions in a thread (ckpt.Remover). At most one save in flight: the next
    save and the end of training wait for it. The staging directory's name carries a token of this start, so a
    writer left over from a killed start never writes into a later one's.

    What a process's first save would otherwise pay once inside its blocking window is done beforehand, off the
    step loop (SaveSetup): `prepare` (when this run saves at all) starts it at construction, prepare_host_memory()
    after the first step.

    The persistent writer is watched (WriterWatchdog) from the first request handed to it until finish() or
    abort() ends it: a writer that dies before (killed, out of memory) ends the rank at once, with the cause in its
    log and status, instead of leaving it blocked in megatron-core's wait for the writer."""

    def __init__(self, ckpt_dir: Path, files: Any, keep: int, rank: int, prepare: bool = True,
                 host: host_copy.Copier | None = None) -> None:
        """`host`: makes the host copy of each committed checkpoint (host_copy.py); None: none."""
        self.ckpt_dir, self.files, self.keep, self.rank = ckpt_dir, files, keep, rank
        self.host, self.host_pending = host, None
        self.asynchronous = os.environ.get("STEPDEPLOY_CKPT_ASYNC", "1") != "0"
        self.persistent = self.asynchronous and writer_kind() == "persistent"
        self.warming: float | None = None  # when the writer's host memory set-up was scheduled (persistent)
        self.warming_bytes = 0
        token = [ckpt.new_token() if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.token = token[0]
        self.queue: Any = None
        self.pending: dict[str, Any] | None = None
        self.remover = ckpt.Remover()
        self.reserve = ckpt_room.Reserve(ckpt_dir, rank)  # room to say so when the disk fills (ckpt_room.py)
        self.size = 0  # bytes of the newest checkpoint committed or loaded: the room the next save needs
        self.handing: int | None = None  # the iteration whose save is being handed to the writer
        self.watchdog: megatron_writer.WriterWatchdog | None = None
        # STEPDEPLOY_CKPT_SETUP=0 (`render --env`): no set-up beforehand, the first save does it (to compare)
        prepare = prepare and os.environ.get("STEPDEPLOY_CKPT_SETUP", "1") != "0"
        self.setup = SaveSetup(files, rank, self.persistent) if prepare else None
        # a stop or a crash: end the writer process before multiprocessing's exit handler would wait for it
        atexit.register(self.abort)

    def save(self, model: Any, optimizer: Any, iteration: int) -> None:
        from megatron.core import dist_checkpointing

        began = time.time()
        with self.files.saving(iteration):
            setup_wait = self.setup.wait() if self.setup is not None else 0.0
            self.poll(blocking=True)
            if getattr(getattr(model, "ddp_config", None), "overlap_param_gather", False):
                # overlapped param all-gather: after the step each rank holds only its own shard's new weights
                # until the next forward gathers the rest; the model's state dict must see every weight (megatron's
                # training loop does the same before a save)
                with torch.no_grad():
                    model.start_param_sync(force_sync=True)
            staging = ckpt.staging_path(self.ckpt_dir, iteration, self.token)
            self._check_room(iteration)
            if self.rank == 0:
                ckpt.staging_dir(self.ckpt_dir, iteration, self.token)
            dist.barrier()
            # megatron adds process groups to the metadata dict it is given: each use gets a fresh one
            state = sharded_state(model, optimizer, is_loading=False, metadata=checkpoint_metadata(optimizer))
            content = checkpoint_metadata(optimizer)
            seal = functools.partial(self._seal, staging, iteration, content)
            if self.asynchronous:
                if self.persistent:  # its host copy of a host tensor is the tensor itself: copy those now
                    megatron_writer.snapshot_host_tensors(state)
                request = dist_checkpointing.save(state, str(staging), content_metadata=content,
                                                  async_sharded_save=True, **_async_options(dist_checkpointing))
                request.add_finalize_fn(seal)
                self.handing = iteration
                self._schedule(request)
            else:
                dist_checkpointing.save(state, str(staging), content_metadata=content)
                seal()
        ended = time.time()
        self.pending = {"iteration": iteration, "began": began, "ended": ended, "staging": staging}
        self.files.phase("save", ended, iteration=iteration, began=began, blocking_s=round(ended - began, 4),
                         background=self.asynchronous, setup_wait_s=round(setup_wait, 4))
        if not self.asynchronous:
            self._commit(self.pending, ended)

    def prepare_host_memory(self, model: Any, optimizer: Any) -> None:
        """After the first step (the optimizer's state exists then), on GPUs, every rank: the host memory the save
        copies the tensors into, page-locked in the background -- by the persistent writer (its first request, which
        the step loop does not wait for: pin_host_blocks), or, with the forked writer and pin_ahead(), by a thread
        of this process (SaveSetup.pin)."""
        if self.setup is None or not torch.cuda.is_available() or not (self.persistent or pin_ahead()):
            return
        try:
            sizes = host_copy_sizes(model, optimizer)
        except Exception as exc:  # only a head start: the first save then page-locks its own memory
            sizes = []
            log(self.rank, f"checkpoint set-up (host_memory) skipped: {exc!r}")
        if not self.persistent:
            if sizes:
                self.setup.pin(sizes)
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        # every rank schedules it (megatron finalizes each request with a collective), sizes or none
        self.setup.wait()
        self.warming, self.warming_bytes = time.time(), sum(sizes)
        self._schedule(AsyncRequest(functools.partial(pin_host_blocks, sizes), (), []))

    def poll(self, blocking: bool = False) -> bool:
        """Every rank, after every step: commit the save in flight once every rank's write ended (one small
        all-reduce while one is in flight; blocking: wait for it). True when it committed one."""
        self._copy_to_host()
        if self.pending is None and self.warming is None:
            return False
        polled = time.time()
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            try:
                self.queue.maybe_finalize_async_calls(blocking=blocking)
            except Exception as exc:  # a write failed on some rank (megatron-core raises it on every rank)
                self._failed(exc)
            if self.queue.get_num_unfinalized_calls():
                return False
        if self.warming is not None:  # the writer's host memory is page-locked (the request before any save's)
            self.files.phase("save_setup", part="writer_host_memory", began=self.warming,
                             seconds=round(polled - self.warming, 3), done=f"{self.warming_bytes / 2**30:.2f} GiB")
            self.warming = None
        if self.pending is None:
            return False
        self._commit(self.pending, polled)
        return True

    def finish(self, iteration: int) -> None:
        """The end of training: wait for the save in flight and commit it (the heartbeat says "saving"), then end the
        persistent writer."""
        if self.pending is not None:
            with self.files.saving(iteration):
                self.poll(blocking=True)
        if self.persistent and self.queue is not None:  # the writer ends with nothing in flight (not aborted)
            with contextlib.suppress(Exception):
                self.poll(blocking=True)
                self._disarm()  # the writer ends now because it is closed
                self.queue.close()
            self.queue = None
        if self.host is not None:  # training ended: no restart will read the host copy
            self.host.discard()
        self.remover.drain()
        self._discard()
        self.reserve.release()

    def _copy_to_host(self) -> None:
        """Once the checkpoint the last save wrote is committed (rank 0 renames it in the same poll), its host copy."""
        if self.host is not None and self.host_pending is not None:
            committed = self.ckpt_dir / ckpt.iteration_name(self.host_pending)
            if ckpt.is_complete(committed, self.host_pending):
                self.host.copy(committed, self.host_pending)
                self.host_pending = None

    def abort(self) -> None:
        """A stop or a failure: end the write in flight without committing it (what it left is not sealed).
        A set-up still starting the writer's Manager is waited for (a bounded time): only once started does the
        Manager have the exit handler that stops it, and multiprocessing's own exit handler, which runs after
        this one, waits for every child process it has."""
        self._disarm()
        if self.setup is not None:
            self.setup.wait(timeout=SETUP_EXIT_WAIT_S)
        if self.queue is not None:
            with contextlib.suppress(Exception):
                self.queue.close(abort=True)
        self.queue = self.pending = self.warming = None
        self._discard()  # the writer is ended: what it wrote for this start was never committed
        self.reserve.release()
        self.remover.drain(ckpt.REMOVER_EXIT_WAIT_S)  # a deletion cut short: the next start's repair ends it

    def _discard(self) -> None:
        """Rank 0 (the directory is shared): remove this start's staging directories (a stop, a failure, the end)."""
        if self.rank == 0:
            for action in ckpt.discard_staging(self.ckpt_dir, self.token):
                log(0, f"checkpoints: {action}")

    def _check_room(self, iteration: int) -> None:
        """Every rank, before the save writes: rank 0 looks at the room left for one more checkpoint of the newest
        one's size; a save that cannot fit ends every rank before it fills the disk (ckpt_room.DiskFull)."""
        verdict: list[Any] = [None]
        if self.rank == 0:
            try:
                ckpt_room.check_room(self.ckpt_dir, iteration, self.size)
            except ckpt_room.DiskFull as exc:
                verdict[0] = exc.strerror
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            self.reserve.release()
            full = ckpt_room.DiskFull(str(verdict[0]))
            log(self.rank, f"disk full: {full}")
            raise full

    def _failed(self, exc: Exception) -> None:
        """A save in flight failed: nothing of it is committed; its staging directory goes first (on a full disk
        that is the room the exit record needs), then the rank ends -- with DiskFull when it failed for room."""
        pending, self.pending = self.pending, None
        iteration = pending["iteration"] if pending is not None else self.handing
        free = ckpt_room.free_bytes(self.ckpt_dir)
        full = ckpt_room.is_disk_full(exc) or (free is not None and free < ckpt_room.NEARLY_FULL)
        self._discard()
        self.reserve.release()
        if not full or iteration is None:
            raise exc
        error = ckpt_room.DiskFull.of(self.ckpt_dir, iteration, self.size, cause=repr(exc)[:300])
        log(self.rank, f"disk full: {error}")
        raise error from exc

    def _schedule(self, request: Any) -> None:
        if self.queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue(persistent=self.persistent)
        if self.persistent:
            # megatron-core waits for the worker's host copies without a timeout: a dead worker would hang this rank
            writer = getattr(self.queue._get_async_caller(), "process", None)
            if writer is not None and not writer.is_alive():
                raise RuntimeError(f"the checkpoint writer process (pid {writer.pid}) has died "
                                   f"(exit code {writer.exitcode}): no save can be written")
            if self.watchdog is None:
                self.watchdog = megatron_writer.WriterWatchdog(lambda: megatron_writer.writer_process(self.queue),
                                                               self._writer_died)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the writer reads this rank's tensors from its own CUDA context
        with writer_environment(self.persistent):  # megatron-core 0.16 spawns the worker at its first request
            self.queue.schedule_async_request(request)

    def _disarm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()
            self.watchdog = None

    def _writer_died(self, process: Any) -> None:
        pending = self.pending  # (the step loop may change it meanwhile)
        iteration = pending["iteration"] if pending is not None else self.handing
        during = (f"during the save of iteration {iteration}" if iteration is not None
                  else "while it page-locked its host memory" if self.warming is not None else "between saves")
        megatron_writer.writer_died(self.rank, self.files, process, during)

    def _seal(self, staging: Path, iteration: int, content: dict[str, Any]) -> None:
        """The last finalize step, after megatron's (every rank's write ended, metadata written): rank 0 seals."""
        if self.pending is not None:
            self.pending["written"] = time.time()
        if self.rank == 0:
            ckpt.atomic_write_json(staging / "stepdeploy.json", {"iteration": iteration, "optimizer": True,
                                                                 "metadata": content})
            ckpt.seal(staging, iteration)

    def _commit(self, pending: dict[str, Any], polled: float) -> None:
        """`polled`: when the poll that found every write ended began (commit_s: the finalize and the commit,
        which the step loop waits for)."""
        self.pending = self.handing = None
        iteration = self.host_pending = pending["iteration"]
        if self.rank == 0:
            final = ckpt.commit(self.ckpt_dir, iteration, pending["staging"], keep=self.keep, remove=self.remover)
            self.size = ckpt_room.tree_bytes(final)
            log(0, f"checkpoint {iteration} committed")
        now = time.time()
        written = min(pending.get("written", polled), polled)
        self.files.phase("save_committed", now, iteration=iteration, began=pending["began"],
                         background_s=round(max(written - pending["ended"], 0.0), 4),
                         commit_s=round(now - polled, 4))


def _async_options(dist_checkpointing: Any) -> dict[str, Any]:
    """megatron-core 0.19 defaults to nvidia-resiliency-ext's async writer (it needs nvrx >= 0.6, which has no
    wheel for the GPU machine's platform: FACTS); its own ("mcore") writer is the one 0.16 has."""
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}
