"""Issue 21: a process's first megatron save must not pay megatron-core's one-off set-up inside its blocking window
(4.9-8.5 s on an H200 against 0.24-0.42 s for the later ones). The Saver does it beforehand in the background
(megatron_ckpt.SaveSetup); these tests check where it happens, not how long it takes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import megatron_ckpt  # tests/unit/workload/conftest.py puts the workload directory on sys.path
import pytest
import torch


def test_the_first_save_finds_the_writer_set_up_and_the_set_up_predicts_its_host_copies(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not importable (pip install megatron-core==0.16.1)")
    pytest.importorskip("psutil", reason="dist-checkpointing's writer needs psutil")
    script = Path(__file__).with_name("megatron_cpu_first_save.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--saves", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, check=False)
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
    monkeypatch.setattr(megatron_ckpt, "write_results_queue", lambda: None)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    files = Phases()
    setup = megatron_ckpt.SaveSetup(files, 0)
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
    assert megatron_ckpt.pin_ahead() is ahead
