"""How often a rollout polls its run: the executor's own interval unless the configuration sets one."""

from __future__ import annotations

from stepdeploy.remote.fabric_executor import FabricExecutor
from stepdeploy.remote.local_executor import LocalExecutor
from stepdeploy.rollout.config import DEFAULT_POLL_INTERVAL_S, RolloutConfig, poll_interval

CONFIG = RolloutConfig(inventory="", model="tiny-dense", stages=("soak",))


def test_the_local_executor_is_polled_four_times_as_often_as_one_over_ssh() -> None:
    assert poll_interval(CONFIG, LocalExecutor.__new__(LocalExecutor)) == 0.5
    assert poll_interval(CONFIG, FabricExecutor.__new__(FabricExecutor)) == 2.0


def test_an_executor_without_its_own_interval_gets_the_default() -> None:
    assert poll_interval(CONFIG, object()) == DEFAULT_POLL_INTERVAL_S == 2.0


def test_the_configuration_overrides_the_executor() -> None:
    config = RolloutConfig(inventory="", model="tiny-dense", stages=("soak",), poll_interval_s=3.0)
    assert poll_interval(config, LocalExecutor.__new__(LocalExecutor)) == 3.0


def test_a_ledger_written_before_has_its_interval_read_back() -> None:
    assert RolloutConfig.from_json({**CONFIG.to_json(), "poll_interval_s": 2.0}).poll_interval_s == 2.0
    assert RolloutConfig.from_json(CONFIG.to_json()).poll_interval_s is None
