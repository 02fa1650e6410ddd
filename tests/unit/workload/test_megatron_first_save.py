"""Issue 21: a process's first megatron save must not pay megatron-core's one-off set-up inside its blocking window
(4.9-8.5 s on an H200 against 0.24-0.42 s for the later ones). The Saver does it beforehand in the background
(megatron_writer.SaveSetup); these tests check where it happens, not how long it takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import megatron_writer  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest
import torch


def test_the_first_save_finds_the_writer_set_up_and_the_set_up_predicts_its_host_copies(tmp_path: Path) -> None:
    """The writer forked per save (STEPDEPLOY_CKPT_WRITER=fork): the rank makes the host copies."""
    pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
    pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")
    script = Path(__file__).with_name("megatron_cpu_first_save.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--saves", "2", "--steps", "2",
                           "--writer", "fork"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # megatron's write-results queue is a multiprocessing Manager (a spawned server process) that its writer
    # creates on the process's first save: it was started once, by the set-up thread, and by no save
    assert result["manager_threads"] == ["checkpoint-setup-writer"], result["manager_threads"]
    assert [p["part"] for p in result["setup"]] == ["writer"], result["setup"]
    assert [s["iteration"] for s in result["saves"]] == [2, 4]
    assert all("setup_wait_s" in s for s in result["saves"]), result["saves"]
    # what the GPU set-up page-locks after the first step: one block per tensor the save copies to host memory,
    # of its size (torch's caching host allocator reuses a freed block of the same power-of-two bin only)
    copied, predicted = result["first_save_copied"], result["predicted"]
    assert copied and sorted(predicted) == sorted(copied), (len(copied), len(predicted))
    assert result["committed"] == ["iter_0000002", "iter_0000004", "latest"], result["committed"]


def test_the_persistent_writer_makes_the_host_copies_and_every_save_commits(tmp_path: Path) -> None:
    """The default writer, megatron-core's persistent worker: one process spawned for the run (not one per save),
    which copies the tensors itself -- the rank made none of the host copies -- and whose writes commit."""
    pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
    pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")
    script = Path(__file__).with_name("megatron_cpu_first_save.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--saves", "3", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [s["iteration"] for s in result["saves"]] == [2, 4, 6]
    assert all(s["background"] for s in result["saves"]), result["saves"]
    assert result["first_save_copied"] == [], "the rank copied the tensors itself: the writer is not the persistent one"
    assert result["writer_processes"] == 1, result["writer_processes"]
    assert result["committed"] == ["iter_0000004", "iter_0000006", "latest"], result["committed"]


def test_the_writer_is_persistent_or_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPDEPLOY_CKPT_WRITER", raising=False)
    assert megatron_writer.writer_kind() == "persistent"
    monkeypatch.setenv("STEPDEPLOY_CKPT_WRITER", "fork")
    assert megatron_writer.writer_kind() == "fork"
    monkeypatch.setenv("STEPDEPLOY_CKPT_WRITER", "threads")
    with pytest.raises(ValueError, match="persistent or fork"):
        megatron_writer.writer_kind()


def test_only_the_persistent_writer_is_spawned_with_registered_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with megatron_writer.writer_environment(True):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True," + megatron_writer.WRITER_HOST_ALLOC
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    with megatron_writer.writer_environment(False):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with megatron_writer.writer_environment(True):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == megatron_writer.WRITER_HOST_ALLOC
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


class Phases:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def phase(self, name: str, when: float | None = None, **data: Any) -> None:
        self.lines.append({"phase": name, **data})


def test_the_host_memory_set_up_holds_every_block_at_once_then_frees_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned blocks are page-locked on another thread, all held at once (as the save holds its copies), on the
    rank's device; save() waits for it."""
    allocated: list[tuple[int, bool, str]] = []
    alive: list[int] = []

    class Block:
        def __init__(self, size: int) -> None:
            alive.append(size)

        def __del__(self) -> None:
            alive.pop()

    def empty(size: int, dtype: Any = None, pin_memory: bool = False) -> Block:
        allocated.append((size, pin_memory, threading.current_thread().name))
        assert len(alive) == len(allocated) - 1  # none freed before the last is allocated
        return Block(size)

    devices: list[int] = []
    monkeypatch.setattr(megatron_writer, "write_results_queue", lambda: None)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    files = Phases()
    setup = megatron_writer.SaveSetup(files, 0)
    setup.pin([4096, 10, 1 << 20])
    setup.wait()
    assert setup.threads == []
    assert allocated == [(4096, True, "checkpoint-setup-host_memory"), (10, True, "checkpoint-setup-host_memory"),
                         (1 << 20, True, "checkpoint-setup-host_memory")]
    assert alive == [] and devices == [3]
    assert sorted(p["part"] for p in files.lines) == ["host_memory", "writer"]
    assert [p.get("done") for p in files.lines if p["part"] == "host_memory"] == ["3 blocks, 0.00 GiB"]


@pytest.mark.parametrize(("chosen", "ahead"), [(None, False), ("0", False), ("1", True)])
def test_the_host_memory_is_locked_ahead_only_when_asked(monkeypatch: pytest.MonkeyPatch, chosen: str | None,
                                                         ahead: bool) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_cuda_host_register:True")
    if chosen is None:
        monkeypatch.delenv("STEPDEPLOY_CKPT_PIN_AHEAD", raising=False)
    else:
        monkeypatch.setenv("STEPDEPLOY_CKPT_PIN_AHEAD", chosen)
    assert megatron_writer.pin_ahead() is ahead


def test_a_save_refuses_a_dead_persistent_writer_instead_of_waiting_for_it_forever() -> None:
    """megatron-core waits for the persistent worker's host copies with no timeout: a worker that died (killed for
    memory, say) would hang the rank inside its save. The Saver checks it is alive before it hands over a save."""
    import megatron_ckpt

    class Dead:
        pid, exitcode = 4242, -9

        def is_alive(self) -> bool:
            return False

    scheduled: list[Any] = []

    class Queue:
        def _get_async_caller(self) -> Any:
            return type("Caller", (), {"process": Dead()})()

        def schedule_async_request(self, request: Any) -> None:
            scheduled.append(request)

    saver = megatron_ckpt.Saver.__new__(megatron_ckpt.Saver)
    saver.persistent, saver.queue = True, Queue()
    with pytest.raises(RuntimeError, match=r"writer process \(pid 4242\) has died \(exit code -9\)"):
        saver._schedule("a save")
    assert scheduled == []
    saver.persistent = False  # the writer forked per save: nothing to check
    saver._schedule("a save")
    assert scheduled == ["a save"]
