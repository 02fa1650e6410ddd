"""Hostile inventory values (`; rm -rf /`, `$(...)`, backticks, quotes, spaces, newlines) arrive as inert data.

The inventory loader refuses most of these already; the renderer must not depend on that, so the nodes here
are built directly. The rendered launch script is then RUN, with the Python it starts replaced by a stub
that records its arguments and environment: every value must arrive byte for byte and nothing may execute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Node
from stepdeploy.plan.layout import Layout
from stepdeploy.render import RenderOptions

from .cases import render

STUB = """#!{python}
import json, os, sys
with open(os.environ["HOSTILE_RECORD"], "w") as handle:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, handle)
"""


def hostile(marker: Path) -> list[str]:
    # `; rm -rf /` in a shape that would be harmless if a regression ever executed it (a marker proves it).
    return [f"; rm -rf /nonexistent-stepdeploy-hostile; touch {marker} #", f"$(touch {marker})",
            f"`touch {marker}`", "a'b\"c\\d", "two words",
            f"new\nline; touch {marker}", f"'; touch {marker}; '", "*", "${HOME}", "=leading-equals"]


def test_hostile_values_arrive_as_inert_data(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    values = hostile(marker)
    run_root = tmp_path / f"runs; $(touch {marker}) 'x\"\ny"
    stub = tmp_path / "bin dir" / "py'thon $(x)"
    stub.parent.mkdir()
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    nodes = [Node(name=f"node1; rm -rf / #$(touch {marker})\n", address="10.83.0.11", gpus_per_node=0,
                  train_iface=f"eth0$(touch {marker})", fabric="infiniband", ib_hcas=[f"mlx5_0'; touch {marker}; '"]),
             Node(name="node2", address="10.83.0.12", gpus_per_node=0, train_iface="eth0", fabric="ethernet")]
    extra = tuple((f"HOSTILE_{i}", value) for i, value in enumerate(values))
    opts = RenderOptions(run_id="hostile-1", remote_dir=str(run_root), python=str(stub), extra_env=extra,
                         iterations=2, seq_length=16, global_batch_size=2)
    rendered = render(nodes, "tiny-dense", Layout(), opts)
    run_dir = Path(rendered.run_dir)
    for item in rendered.files:
        (run_dir / item.path).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / item.path).write_text(item.text)
    place = rendered.placements[0]
    record = tmp_path / "record.json"
    env = {"PATH": os.environ["PATH"], "HOSTILE_RECORD": str(record)}
    res = subprocess.run(["bash", str(run_dir / place.launch_script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert not marker.exists(), "a hostile value was executed"
    seen = json.loads(record.read_text())
    for key, value in extra:
        assert seen["env"][key] == value
    assert seen["env"]["STEPDEPLOY_NODE_NAME"] == nodes[0].name
    assert seen["env"]["NCCL_SOCKET_IFNAME"] == nodes[0].train_iface
    assert seen["env"]["NCCL_IB_HCA"] == "=" + nodes[0].ib_hcas[0]
    assert seen["env"]["STEPDEPLOY_RUN_DIR"] == str(run_dir)
    assert seen["argv"][:2] == ["-I", f"{run_dir}/workload/launch_ranks.py"]
    assert seen["argv"][-6] == "--"
    assert seen["argv"][-5:] == [f"{run_dir}/workload/train.py", "--config", f"{run_dir}/workload.json",
                                 "--out-dir", f"{run_dir}/out"]
    assert (run_dir / place.node_dir / "exit_code").read_text() == "0\n"
    assert "/" not in place.node_dir.removeprefix("nodes/") and "\n" not in place.node_dir
    assert not marker.exists()


def test_env_file_keeps_each_value_on_its_own_line(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    extra = tuple((f"V{i}", value) for i, value in enumerate(hostile(marker)))
    rendered = render([Node(name="n\nexport EVIL=1", address="10.0.0.1", gpus_per_node=0)], "tiny-dense",
                      Layout(), RenderOptions(run_id="hostile-2", extra_env=extra))
    env_sh = rendered.file(f"{rendered.placements[0].node_dir}/env.sh").text
    res = subprocess.run(["bash", "-c", 'set -eu; . "$1"; env -0', "_", "/dev/stdin"], input=env_sh,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    got = dict(item.split("=", 1) for item in res.stdout.split("\0") if "=" in item)
    assert "EVIL" not in got
    assert all(got[key] == value for key, value in extra)
    assert not marker.exists()


@pytest.mark.parametrize("run_id", ["a b", "../x", "x;y", "$(id)", "", "-rf"])
def test_run_id_that_is_not_a_plain_name_is_refused(run_id: str) -> None:
    with pytest.raises(BadInput, match="run id"):
        RenderOptions(run_id=run_id)


@pytest.mark.parametrize("key", ["A B", "X;Y", "1X", "$(id)", ""])
def test_env_key_that_is_not_a_name_is_refused(key: str) -> None:
    with pytest.raises(BadInput, match="not an environment variable name"):
        RenderOptions(run_id="r", extra_env=((key, "v"),))
