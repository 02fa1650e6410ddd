"""The torch engine's checkpoints: one directory per node, written in the background by its local rank 0 with
ckpt.py's protocol, committed once every node's write ended, discarded on a stop or a failure, with room on the
disk checked and a full disk named (ckpt_room.py). Standard library + torch only (shipped as a file)."""

from __future__ import annotations

import atexit
import contextlib
import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ckpt
import ckpt_room
import torch
import torch.distributed as dist
from metrics import RankFiles, log
from torch import nn

WRITER_JOIN_S = 5.0  # a stop waits this long at most for the write in flight before its directory goes


class Saver:
    """Checkpoints written in the background (ckpt.py's protocol, one directory per node, written by its local
    rank 0): save() blocks only for a copy of the state in memory; a thread writes it, fsyncs and seals it; poll(),
    called by every rank after every step, commits it once every node's write finished (an all-reduce while a
    save is in flight), then applies retention. At most one save in flight: the next save and the end of training
    wait for it. A stop or a failure (discarding()) removes the save in flight's staging directory: `latest`
    stays on the previous checkpoint, and nothing uncommitted is left on the disk.

    Room: the writing rank holds ckpt_room.Reserve from its start; a save checks the disk has room for one more
    checkpoint of the newest one's size before it writes, and a save that fails for room (ENOSPC, or a write
    error with the disk full) gives the reserve back and ends the rank with ckpt_room.DiskFull, which names the
    path, what is free and the fix; the other ranks say which rank's disk is full."""

    def __init__(self, ckpt_dir: Path, files: RankFiles, keep: int, writes: bool) -> None:
        self.ckpt_dir, self.files, self.keep, self.writes = ckpt_dir, files, keep, writes
        self.token = ckpt.new_token()
        self.pending: dict[str, Any] | None = None
        self.size = 0  # bytes of the newest checkpoint (the room the next save needs; 0: not known yet)
        self.remover = ckpt.Remover()  # retention's deletions, off the step loop
        self.reserve = ckpt_room.Reserve(ckpt_dir, files.rank) if writes else None
        atexit.register(self.remover.drain, ckpt.REMOVER_EXIT_WAIT_S)  # a stop: what is left, repair removes

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Repair this node's store, then load the newest committed iteration every node has (0: a fresh start)."""
        rank = dist.get_rank()
        if self.writes:
            for action in ckpt.repair(self.ckpt_dir):
                log(rank, f"checkpoints: {action}")
        dist.barrier()
        mine = ckpt.committed_iterations(self.ckpt_dir)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        iteration = ckpt.newest_common(everyone)
        if iteration == 0:
            if mine:
                log(rank, f"no checkpoint every node has (this one has {mine}): starting from iteration 0")
            return 0
        where = self.ckpt_dir / ckpt.iteration_name(iteration)
        state = torch.load(where / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        self.size = ckpt_room.tree_bytes(where)
        log(rank, f"resumed from checkpoint {iteration}")
        return iteration

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int) -> None:
        began = time.time()
        with self.files.saving(iteration):
            self.poll(blocking=True)
            outcome: dict[str, Any] = {}
            thread, staging = None, None
            if self.writes:
                snapshot = {"iteration": iteration,
                            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                            "optimizer": copy.deepcopy(optimizer.state_dict())}
                staging = ckpt.staging_dir(self.ckpt_dir, iteration, self.token)
                thread = threading.Thread(target=_write, args=(snapshot, staging, iteration, self.size, outcome),
                                          name=f"checkpoint-{iteration}", daemon=True)
                thread.start()
        ended = time.time()
        self.pending = {"iteration": iteration, "began": began, "ended": ended, "thread": thread,
                        "staging": staging, "outcome": outcome}
        self.files.phase("save", ended, iteration=iteration, began=began, blocking_s=round(ended - began, 4),
                         background=True)

    def finish(self, iteration: int) -> None:
        """The end of training: wait for the save in flight and commit it (the heartbeat says "saving")."""
        if self.pending is not None:
            with self.files.saving(iteration):
                self.poll(blocking=True)
        self.remover.drain()
        self._discard()
        if self.reserve is not None:
            self.reserve.release()

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """Around the step loop: a stop (SIGTERM) or a failure removes this start's staging directories before
        the rank's exit record is written (on a full disk that frees the room to write it)."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """End the save in flight without committing it: its staging directory goes (renamed out of sight first,
        so the writer thread, given WRITER_JOIN_S to end, cannot refill it), and the reserve with it."""
        pending, self.pending = self.pending, None
        thread = pending["thread"] if pending is not None else None
        self._discard()
        if thread is not None:
            thread.join(WRITER_JOIN_S)
            self._discard()
        if self.reserve is not None:
            self.reserve.release()

    def _discard(self) -> None:
        if self.writes:
            for action in ckpt.discard_staging(self.ckpt_dir, self.token):
                log(dist.get_rank(), f"checkpoints: {action}")

    def poll(self, blocking: bool = False) -> None:
        """Every rank: commit the save in flight once every node's write is done (blocking: wait for it)."""
        pending = self.pending
        if pending is None:
            return
        thread, outcome = pending["thread"], pending["outcome"]
        if blocking and thread is not None:
            thread.join()
        full = "error" in outcome and self._full(outcome)
        flags = torch.tensor([int(thread is not None and thread.is_alive()), int("error" in outcome),
                              dist.get_rank() + 1 if full else 0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # any still writing, any failed, the last full rank + 1
        if flags[0]:
            return
        self.pending = None
        iteration = pending["iteration"]
        if flags[1]:
            self.abort()
            self._raise(outcome, iteration, int(flags[2]))
        committing = time.time()
        if self.writes:
            final = ckpt.commit(self.ckpt_dir, iteration, pending["staging"], keep=self.keep, remove=self.remover)
            self.size = ckpt_room.tree_bytes(final)
        now = time.time()
        written = outcome.get("written", committing)
        self.files.phase("save_committed", now, iteration=iteration, began=pending["began"],
                         background_s=round(written - pending["ended"], 4), commit_s=round(now - committing, 4))
        log(dist.get_rank(), f"checkpoint {iteration} committed")

    def _full(self, outcome: dict[str, Any]) -> bool:
        """Whether this rank's write failed for room: ENOSPC said, or a write error with the disk (nearly) full
        (torch.save's zip writer says only "file write failed"). Measured before the staging directory goes."""
        if outcome.get("full") is None:
            free = ckpt_room.free_bytes(self.ckpt_dir)
            outcome["full"] = ckpt_room.is_disk_full(outcome["error"]) or (free is not None
                                                                           and free < ckpt_room.NEARLY_FULL)
        return bool(outcome["full"])

    def _raise(self, outcome: dict[str, Any], iteration: int, full_rank: int) -> None:
        rank = dist.get_rank()
        error = outcome.get("error")
        if error is not None and outcome.get("full"):
            if isinstance(error, ckpt_room.DiskFull):  # the room check: nothing written
                log(rank, f"disk full: {error}")
                raise error
            full = ckpt_room.DiskFull.of(self.ckpt_dir, iteration, self.size, cause=repr(error)[:300])
            log(rank, f"disk full: {full}")
            raise full from error
        if error is not None:
            raise error
        if full_rank:
            raise RuntimeError(f"checkpoint {iteration}: the checkpoint disk of rank {full_rank - 1}'s node is full "
                               "(No space left on device there: see its log)")
        raise RuntimeError(f"checkpoint {iteration}: the write failed on another node (see its log)")


def _write(snapshot: dict[str, Any], staging: Path, iteration: int, needed: int, outcome: dict[str, Any]) -> None:
    try:
        ckpt_room.check_room(staging.parent, iteration, needed)
        torch.save(snapshot, staging / "state.pt")
        ckpt.seal(staging, iteration)
        outcome["written"] = time.time()
    except Exception as exc:  # handed to the training thread, which raises it
        outcome["error"] = exc
