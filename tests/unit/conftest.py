"""Import order guard for the unit tests.

ansible-core 2.19 replaces `sys.intern` with a patch object once its module_utils are imported (the tests of
the roles' own Ansible modules import them in-process), and torch._dynamo -- which megatron-core imports through
torch.compile -- refuses to load after that. Loading torch._dynamo first keeps the result independent of the
order in which test modules are collected."""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def megatron_single_rank() -> Iterator[None]:
    """A gloo process group of one rank and megatron-core's parallel state (TP = PP = 1), for the module."""
    import torch
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def forked_cli() -> Iterator[Any]:
    """The fuzz suite's zygote (tests/unit/fuzz/zygote.py) for a module: `stepdeploy ARGV` as forked processes, each
    with its own exit code, stderr and working directory, for a fraction of a fresh interpreter's start-up."""
    from fuzz.harness import Runner

    zygote = Runner()
    yield zygote
    zygote.close()
