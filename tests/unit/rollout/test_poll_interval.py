"""How often a rollout polls its run: the executor's own interval unless the configuration sets one."""

from __future__ import annotations

import importlib

from stepdeploy.remote import registry
from stepdeploy.remote.executor import Executor
from stepdeploy.remote.fabric_executor import FabricExecutor
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.remote.slurm_executor import SlurmExecutor
from stepdeploy.rollout.config import RolloutConfig, poll_interval
from stepdeploy.testing.executor import FakeExecutor

CONFIG = RolloutConfig(inventory="", model="tiny-dense", stages=("soak",))


def test_a_crash_is_seen_within_a_second_over_ssh_as_on_this_machine() -> None:
    """Issue 37: detection over SSH within 1 s; a crash is seen at the first poll after it (an SSH poll measured at
    ~0.1 s median on 2 simulated nodes: bench/fault_matrix.py)."""
    assert poll_interval(CONFIG, LocalExecutor.__new__(LocalExecutor)) == 0.5
    assert poll_interval(CONFIG, FabricExecutor.__new__(FabricExecutor)) == 0.5


def test_every_executor_declares_its_interval_as_the_protocol_says() -> None:
    assert Executor.__annotations__["poll_interval_s"] == "float"
    classes = [SlurmExecutor, FakeExecutor]
    for module in registry.EXECUTORS.values():  # every registered one, and the simulated cluster's stand-in
        classes += [c for c in vars(importlib.import_module(module)).values()
                    if isinstance(c, type) and c.__module__ == module and hasattr(c, "poll")]
    assert {c.__name__ for c in classes} >= {"FabricExecutor", "LocalExecutor", "SlurmExecutor"}
    for cls in classes:
        assert isinstance(cls.poll_interval_s, float) and cls.poll_interval_s > 0, cls.__name__
    assert poll_interval(CONFIG, SlurmExecutor.__new__(SlurmExecutor)) == 2.0


def test_the_configuration_overrides_the_executor() -> None:
    config = RolloutConfig(inventory="", model="tiny-dense", stages=("soak",), poll_interval_s=3.0)
    assert poll_interval(config, LocalExecutor.__new__(LocalExecutor)) == 3.0


def test_a_ledger_written_before_has_its_interval_read_back() -> None:
    assert RolloutConfig.from_json({**CONFIG.to_json(), "poll_interval_s": 2.0}).poll_interval_s == 2.0
    assert RolloutConfig.from_json(CONFIG.to_json()).poll_interval_s is None
