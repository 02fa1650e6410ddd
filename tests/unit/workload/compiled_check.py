"""What the compiled-kernel tests share: a function compiled whole (no graph break) giving eager's outputs and input
gradients, on the CPU (inductor's C++ backend) as it would on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def assert_compiled_matches_eager(compiled: Any, eager_fn: Any, x: torch.Tensor, *rest: Any) -> None:
    """`compiled(x, *rest)` against `eager_fn(x, *rest)`: the output and x's gradient for a random upstream gradient.
    Skips where inductor cannot build (no C++ toolchain)."""
    x = x.detach().clone().requires_grad_()
    try:
        out = compiled(x, *rest)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        pytest.skip(f"inductor cannot build on this machine: {str(exc)[:120]}")
    eager_in = x.detach().clone().requires_grad_()
    eager = eager_fn(eager_in, *rest)
    torch.testing.assert_close(out, eager)
    grad = torch.randn_like(out)
    out.backward(grad)
    eager.backward(grad)
    torch.testing.assert_close(x.grad, eager_in.grad)
