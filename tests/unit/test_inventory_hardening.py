"""Issue 18: what a hostile or careless inventory can no longer do.

Host names that would run in a shell or reach the terminal, address variables stepdeploy and ansible would read
differently, whole values that a trailing newline slips through, host-key checking switched off in silence, and
group_vars that block (a FIFO) or explode (YAML aliases). Blocking and exploding cases run in a subprocess under
a time and memory limit: without the fix they hang or run out of memory instead of failing.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from test_inventory_errors import error_of, write  # tests/unit is on sys.path (pytest's rootdir-relative import)

from stepdeploy.inventory import load_cluster


@pytest.mark.parametrize("name", ["n2';touch /tmp/x;'", "n2$(id)", "n2\x1bc", "n2\x07", "-n2", ".n2", "n 2",
                                  "n2\u202e", "n2`id`"])
def test_host_names_that_could_run_or_restyle_anything_are_refused(tmp_path: Path, name: str) -> None:
    inventory = {"all": {"hosts": {name: {"ansible_host": "192.0.2.1"}}}}
    message = error_of(write(tmp_path, "inv.yml", yaml.safe_dump(inventory)))
    assert "is not a host name stepdeploy accepts" in message
    assert "\x1b" not in message and "\x07" not in message and "\u202e" not in message


@pytest.mark.parametrize("name", ["node1", "dgx-01.example.org", "192.0.2.7", "2001:db8::7", "gpu_07"])
def test_ordinary_host_names_still_load(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, "inv.yml", yaml.safe_dump({"all": {"hosts": {name: {"ansible_host": "192.0.2.1"}}}}))
    assert load_cluster(path).nodes[0].name == name


@pytest.mark.parametrize(("newer", "older", "a", "b"), [
    ("ansible_ssh_host", "ansible_host", "192.0.2.1", "192.0.2.2"),
    ("ansible_ssh_port", "ansible_port", "2222", "22"),
    ("ansible_ssh_user", "ansible_user", "admin", "root"),
    ("ansible_ssh_private_key_file", "ansible_private_key_file", "/k/a", "/k/b"),
])
def test_two_spellings_with_different_values_are_refused(tmp_path: Path, newer: str, older: str, a: str,
                                                         b: str) -> None:
    address = "" if "host" in newer else " ansible_host=192.0.2.9"
    path = write(tmp_path, "inv.ini", f"n1{address} {newer}={a} {older}={b}\n")
    message = error_of(path)
    shown = (a, b) if "port" in newer else (repr(a), repr(b))  # ansible reads an INI port as a number
    assert f"{newer} = {shown[0]} and {older} = {shown[1]}" in message and "disagree" in message
    assert f"ansible uses {newer}" in message


def test_two_spellings_that_agree_load_and_ansible_s_preferred_one_counts(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.1 ansible_ssh_host=192.0.2.1 ansible_port=2200 "
                                      "ansible_ssh_port=2200\n")
    node = load_cluster(path).node("n1")
    assert (node.address, node.ssh.port) == ("192.0.2.1", 2200)


@pytest.mark.parametrize(("variable", "value"), [
    ("stepdeploy_ib_hcas", ["mlx5_0\n"]),
    ("stepdeploy_train_iface", "eth0\nx"),
    ("stepdeploy_slurm_partition", "gpu\nx"),
])
def test_a_trailing_newline_does_not_pass_a_whole_value_check(tmp_path: Path, variable: str, value: object) -> None:
    inventory = {"all": {"hosts": {"n1": {"ansible_host": "192.0.2.1", variable: value}}}}
    path = write(tmp_path, "inv.yml", yaml.safe_dump(inventory))
    assert variable in error_of(path)


@pytest.mark.parametrize(("assignment", "named"), [
    ("ansible_host_key_checking=false", "ansible_host_key_checking=false"),
    ("ansible_ssh_host_key_checking=no", "ansible_ssh_host_key_checking=no"),
    ("ansible_ssh_common_args='-o StrictHostKeyChecking=no'", "ansible_ssh_common_args"),
    ("ansible_ssh_extra_args='-oStrictHostKeyChecking=accept-new'", "ansible_ssh_extra_args"),
    ("ansible_ssh_args='-o \"StrictHostKeyChecking off\"'", "ansible_ssh_args"),
])
def test_inventory_that_turns_host_key_checking_off_is_marked(tmp_path: Path, assignment: str, named: str) -> None:
    path = write(tmp_path, "inv.ini", f"n1 ansible_host=192.0.2.1 {assignment}\nn2 ansible_host=192.0.2.2\n")
    cluster = load_cluster(path)
    assert [n.name for n in cluster.unverified()] == ["n1"]
    by = cluster.node("n1").ssh.unverified_by
    assert by is not None and by.startswith(named) and "inv.ini" in by
    assert cluster.node("n1").ssh.host_key_checking  # still verified: only --insecure accepts it


def test_strict_checking_and_true_values_keep_verification(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.1 ansible_host_key_checking=true "
                                      "ansible_ssh_common_args='-o StrictHostKeyChecking=yes'\n")
    assert load_cluster(path).unverified() == []
    bad = write(tmp_path, "bad.ini", "n1 ansible_host=192.0.2.1 ansible_host_key_checking=maybe\n")
    assert "ansible_host_key_checking = 'maybe' is not a boolean" in error_of(bad)


def test_proxy_jump_in_the_ssh_args_is_read_and_checked(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.1 ansible_ssh_common_args='-J admin@bastion:2222'\n"
                                      "n2 ansible_host=192.0.2.2 ansible_ssh_extra_args='-o ProxyJump=a.example,b'\n")
    cluster = load_cluster(path)
    assert cluster.node("n1").ssh.proxy_jump == "admin@bastion:2222"
    assert cluster.node("n2").ssh.proxy_jump == "a.example,b"
    bad = write(tmp_path, "bad.ini", "n1 ansible_host=192.0.2.1 ansible_ssh_common_args='-J \"x;y\"'\n")
    assert "names a jump host" in error_of(bad)


# --- input that blocks or explodes: each case in a subprocess, bounded in time and memory -----------------

_LOAD = textwrap.dedent("""
    import sys
    from stepdeploy.errors import BadInput
    from stepdeploy.inventory import load_cluster
    try:
        load_cluster(sys.argv[1])
    except BadInput as exc:
        print(exc.message)
        sys.exit(2)
""")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))


def load_bounded(path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """load_cluster(path) in a subprocess with 60 s and 2 GiB: a hang or an explosion fails the test."""
    try:
        return subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_limit_memory, env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_cluster({path}) did not return within {timeout} s")


def test_a_fifo_at_group_vars_all_yml_is_refused_not_waited_on(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nn1 ansible_host=192.0.2.1\n")
    (tmp_path / "group_vars").mkdir()
    os.mkfifo(tmp_path / "group_vars" / "all.yml")
    res = load_bounded(path)
    assert res.returncode == 2, res.stderr
    assert "group_vars/all.yml: is not a regular file (a FIFO (named pipe))" in res.stdout


def _laughs(levels: int = 9) -> str:
    lines = ['lol0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


def test_billion_laughs_in_group_vars_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nn1 ansible_host=192.0.2.1\n")
    write(tmp_path, "group_vars/gpu.yml", "stepdeploy_gpus_per_node: 8\n" + _laughs())
    res = load_bounded(path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "gpu.yml: its YAML anchors and aliases expand to more than" in res.stdout


def test_billion_laughs_in_yaml_inventory_vars_is_refused(tmp_path: Path) -> None:
    bomb = textwrap.indent(_laughs(), "      ")
    head = "all:\n  hosts:\n    n1:\n      ansible_host: 192.0.2.1\n  vars:\n    x:\n"
    path = write(tmp_path, "inv.yml", head + bomb)
    res = load_bounded(path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "inv.yml: its YAML anchors and aliases expand" in res.stdout


def test_a_few_anchors_and_aliases_are_still_fine(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.yml", "all:\n  vars: &common\n    stepdeploy_gpus_per_node: 8\n  hosts:\n"
                                      "    n1:\n      ansible_host: 192.0.2.1\n")
    write(tmp_path, "host_vars/n1.yml", "base: &b {a: 1}\nmore: *b\n")
    assert load_cluster(path).nodes[0].gpus_per_node == 8


def test_deeply_nested_group_vars_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nn1 ansible_host=192.0.2.1\n")
    write(tmp_path, "group_vars/all.yml", "x: " + "[" * 500 + "]" * 500 + "\n")
    res = load_bounded(path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "nested deeper than 64 levels" in res.stdout
