"""A function through torch.compile that falls back to itself, once and said, where compiling fails on a node (no
compiler or triton). Used by the engine's compiled element-wise kernels (rope.py, layers.py). Standard library +
torch only (shipped as a file)."""

from __future__ import annotations

from typing import Any

import torch


class CompiledOrEager:
    """`fn` through torch.compile (`compiler`), or `fn` itself from the first call on which compiling or running the
    compiled code raises (no compiler or triton on the node): said once on stdout. An error of the inputs raises
    again from the eager call, so nothing is hidden."""

    def __init__(self, fn: Any, name: str, compiler: Any = torch.compile) -> None:
        self.fn, self.name, self._compile = fn, name, compiler
        self._compiled: Any = None
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            try:
                if self._compiled is None:
                    self._compiled = self._compile(self.fn)
                return self._compiled(*args)
            except Exception as exc:  # any compiler failure: eager from now on
                self.failed = True
                print(f"{self.name}: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); eager from now on",
                      flush=True)
        return self.fn(*args)
