"""`--inject` specs: the valid forms, their defaults, and a clear BadInput for each kind of mistake."""

from __future__ import annotations

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.rollout import inject


def test_examples_parse():
    kill = inject.parse("kill:rank=last@10m")
    assert (kill.kind, kill.rank, kill.at_s, kill.for_s) == ("kill", "last", 600.0, None)
    hang = inject.parse("hang:rank=0@20m")
    assert (hang.kind, hang.rank, hang.at_s) == ("hang", 0, 1200.0)
    link = inject.parse("link-down:node=2@30m,for=90s")
    assert (link.kind, link.node, link.at_s, link.for_s) == ("link-down", 2, 1800.0, 90.0)
    loss = inject.parse("node-loss:node=dgx-2@40m")
    assert (loss.node, loss.at_s, loss.for_s) == ("dgx-2", 2400.0, inject.DEFAULT_FOR_S)
    assert inject.parse("kill:rank=first@30").at_s == 30.0


@pytest.mark.parametrize(("spec", "says"), [
    ("kill", "is not KIND:rank=R@T"),
    ("kill:rank=last", "is not KIND:rank=R@T"),
    ("explode:rank=1@10s", "unknown fault 'explode'"),
    ("kill:node=1@10s", "kill takes rank=..., not node=..."),
    ("link-down:rank=1@10s", "link-down takes node=..., not rank=..."),
    ("kill:rank=lastt@10s", "rank 'lastt' is not a number, first or last"),
    ("kill:rank=-1@10s", "rank '-1' is not a number"),
    ("hang:rank=0@10x", "time '10x' is not a duration"),
    ("kill:rank=0@10s,for=5s", "kill takes no options"),
    ("link-down:node=1@10s,for=soon", "for 'soon' is not a duration"),
    ("link-down:node=1@10s,for=0s", "for= must be longer than 0 s"),
    ("node-loss:node=1@10s,until=5s", "unknown option 'until'"),
    ("node-loss:node=1@10s,for", "option 'for' is not KEY=VALUE"),
])
def test_bad_specs_are_refused_in_one_line(spec: str, says: str):
    with pytest.raises(BadInput) as exc:
        inject.parse(spec)
    assert says in exc.value.message and "\n" not in exc.value.message


def test_the_same_spec_twice_is_refused():
    with pytest.raises(BadInput, match="given twice"):
        inject.parse_all(["kill:rank=0@1m", "kill:rank=0@1m"])


def test_ranks_and_nodes_resolve_against_the_run():
    nodes = ["node1", "node2", "node3"]
    assert inject.resolve_rank(inject.parse("kill:rank=last@1s"), 4) == 3
    assert inject.resolve_rank(inject.parse("kill:rank=first@1s"), 4) == 0
    assert inject.resolve_node(inject.parse("node-loss:node=last@1s"), nodes) == "node3"
    assert inject.resolve_node(inject.parse("node-loss:node=2@1s"), nodes) == "node2"
    assert inject.resolve_node(inject.parse("node-loss:node=node1@1s"), nodes) == "node1"
    with pytest.raises(BadInput, match="rank 4 does not exist"):
        inject.resolve_rank(inject.parse("kill:rank=4@1s"), 4)
    with pytest.raises(BadInput, match="node 4 does not exist"):
        inject.resolve_node(inject.parse("node-loss:node=4@1s"), nodes)
    with pytest.raises(BadInput, match="no node 'dgx9'"):
        inject.resolve_node(inject.parse("node-loss:node=dgx9@1s"), nodes)


def test_due_fires_each_once_in_time_order():
    specs = inject.parse_all(["hang:rank=0@20s", "kill:rank=1@10s", "link-down:node=1@1m"])
    assert [i.spec for i in inject.due(specs, 100.0, 125.0, set())] == ["kill:rank=1@10s", "hang:rank=0@20s"]
    assert [i.spec for i in inject.due(specs, 100.0, 125.0, {"kill:rank=1@10s"})] == ["hang:rank=0@20s"]
    assert inject.due(specs, 100.0, 105.0, set()) == []


def test_commands_quote_and_guard():
    assert inject.signal_rank_command(4242, "STOP") == "kill -0 4242 && kill -STOP 4242"
    down = inject.guarded_link_down_command("ens1f0; reboot", 90)
    assert down.startswith("setsid sh -c ") and "'\"'\"'ens1f0; reboot'\"'\"'" in down
    assert "sleep 90; ip link set" in down and down.endswith("& echo started")
    assert "STEPDEPLOY_RUN_ID=r1-soak" in inject.kill_run_command("r1-soak")
    assert "'STEPDEPLOY_RUN_ID=a b'" in inject.run_pids_command("a b")


def test_cli_refuses_a_bad_inject_before_anything_starts(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    inventory = Path(__file__).parents[2] / "inventory" / "examples" / "hgx-h100-pair.ini"  # a stack the engine runs
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "rollout", "run", "-i", str(inventory), "-m",
                          "tiny-dense", "--stages", "soak", "--inject", "hang:node=1@1m", "--run-dir",
                          str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "hang takes rank=..., not node=..." in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()


def test_soak_refuses_injections_naming_ranks_or_nodes_the_run_lacks():
    from stepdeploy.rollout.config import StageFailed
    from stepdeploy.rollout.stages.soak import _check_injections

    nodes = ["node1", "node2"]  # the run's manifest's
    _check_injections(inject.parse_all(["kill:rank=last@1m", "node-loss:node=node2@2m"]), nodes, 2)
    with pytest.raises(StageFailed, match="rank 2 does not exist"):
        _check_injections([inject.parse("hang:rank=2@1m")], nodes, 2)
    with pytest.raises(StageFailed, match="node 3 does not exist"):
        _check_injections([inject.parse("link-down:node=3@1m")], nodes, 2)


def test_soak_monitor_options_reach_the_plan_and_bad_values_exit_2(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    inventory = Path(__file__).parents[2] / "inventory" / "examples" / "hgx-h100-pair.ini"  # a stack the engine runs
    base = [sys.executable, "-m", "stepdeploy", "rollout", "run", "-i", str(inventory), "-m", "tiny-dense",
            "--stages", "soak", "--run-dir", str(tmp_path / "r")]
    res = subprocess.run([*base, "--heartbeat-timeout", "5m", "--monitor-interval", "2s", "--max-restarts", "1",
                          "--inject", "kill:rank=last@10m", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    soak = json.loads(res.stdout)["soak"]
    assert (soak["heartbeat_timeout_s"], soak["monitor_interval_s"], soak["max_restarts"]) == (300.0, 2.0, 1)
    assert [i["kind"] for i in soak["inject"]] == ["kill"]
    res = subprocess.run([*base, "--heartbeat-timeout", "0s"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "longer than 0 s" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()
