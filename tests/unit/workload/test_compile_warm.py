"""compile_warm.py: the thread computes torch.compile's cache keys ahead (the first step then finds them cached),
and a step that fails is logged, not raised (the first step computes it itself)."""

from __future__ import annotations

import os
from typing import Any

import compile_warm
import pytest
from torch._inductor import codecache


def test_the_source_hash_is_computed_in_the_thread_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    clear = getattr(codecache.torch_key, "clear", None) or getattr(codecache.torch_key, "cache_clear", None)
    if clear is None:
        pytest.skip("this torch's torch_key has no way to forget its value")
    clear()
    hashed: list[Any] = []
    real = codecache.build_code_hash
    monkeypatch.setattr(codecache, "build_code_hash", lambda *a, **k: hashed.append(a) or real(*a, **k))
    thread = compile_warm.start(0, None)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert hashed  # the thread hashed torch's sources
    count = len(hashed)
    assert isinstance(codecache.torch_key(), bytes) and len(hashed) == count  # and the first step will not again


def test_a_step_that_fails_is_logged_and_the_rest_still_run(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("no such thing in this torch")

    monkeypatch.setattr(compile_warm, "_steps", lambda: [("first", broken), ("second", lambda: ran.append("x"))])
    compile_warm.start(3, None).join(timeout=30)
    assert ran == ["x"]
    assert "[rank 3] compile caches: first not warmed ahead: RuntimeError('no such thing in this torch')" in (
        capsys.readouterr().out)


def test_a_resuming_start_compiles_in_its_own_process() -> None:
    from torch._inductor import config

    # config.patch puts the setting back (monkeypatch would delete the entry of inductor's config module)
    with config.patch(compile_threads=8):
        compile_warm.compile_in_process(0)
        assert config.compile_threads == 1
    assert config.compile_threads != 1 or os.cpu_count() == 1 or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ
