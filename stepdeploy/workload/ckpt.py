"""Checkpoint and small-file protocol shared by both engines (standard library + torch only; shipped as a file).

A checkpoint is complete or absent, never half: it is written under a temporary name, flushed, renamed into
place, and only then is the `latest` marker (itself written to a temporary file and renamed) pointed at it
-- the order Megatron uses with latest_checkpointed_iteration.txt.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest"


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Readers see the old text or the new, never a part. durable=False skips the fsync: for a file rewritten
    every step (the heartbeat), where what matters is that the reader sees a whole file, not a power loss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, data: Any, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(data, sort_keys=True) + "\n", durable)


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_iteration(ckpt_dir: Path) -> int | None:
    """The iteration the `latest` marker names, if that checkpoint exists; None for a fresh start."""
    try:
        iteration = int((ckpt_dir / LATEST).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return iteration if (ckpt_dir / iteration_name(iteration)).exists() else None


def staging_dir(ckpt_dir: Path, iteration: int) -> Path:
    """An empty directory to write checkpoint `iteration` into before commit()."""
    tmp = ckpt_dir / f".{iteration_name(iteration)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(ckpt_dir: Path, iteration: int) -> Path:
    """Rename the staged checkpoint into place, then point `latest` at it."""
    tmp, final = ckpt_dir / f".{iteration_name(iteration)}.tmp", ckpt_dir / iteration_name(iteration)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / LATEST, f"{iteration}\n")
    _fsync_dir(ckpt_dir)
    return final


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
