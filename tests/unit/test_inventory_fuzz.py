"""Hypothesis: whatever an inventory file holds, load_cluster returns a Cluster or raises BadInput."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepdeploy.errors import BadInput
from stepdeploy.inventory import STEPDEPLOY_VARS, Cluster, load_cluster

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_counter = itertools.count()

VARIABLES = [*STEPDEPLOY_VARS, "stepdeploy_gpus", "ansible_host", "ansible_port", "ansible_user",
             "ansible_connection", "ansible_ssh_common_args", "ansible_ssh_private_key_file"]
names = st.from_regex(r"[a-z][a-z0-9_.-]{0,10}", fullmatch=True)
host_names = names | st.integers(1, 254).map(lambda i: f"192.0.2.{i}")
scalars = st.one_of(
    st.integers(-5, 100), st.booleans(), st.none(), st.floats(allow_nan=False, width=16),
    st.sampled_from(["8", "eight", "roce", "ib", "wifi", "x86_64", "arm64", "sim-cpu", "seed-2024",
                     "192.0.2.1", "10.0.0.300", "node.example.org", "local", "ssh", "mlx5_0,mlx5_1",
                     "{{ x }}", "-o UserKnownHostsFile=/k", "-o 'unbalanced", "", "eth0"]),
    st.text(max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(names, scalars, max_size=2))
# Mostly-valid values, so that generated inventories also reach the "valid Cluster" side.
GOOD = {
    "stepdeploy_gpus_per_node": st.integers(0, 64) | st.integers(0, 64).map(str),
    "stepdeploy_gpu_model": st.sampled_from(["H100", "H200", "GB10", "B200"]),
    "stepdeploy_arch": st.sampled_from(["x86_64", "aarch64", "amd64", "ARM64"]),
    "stepdeploy_train_iface": st.from_regex(r"[a-z][a-z0-9]{0,14}", fullmatch=True),
    "stepdeploy_fabric": st.sampled_from(["infiniband", "roce", "ethernet", "IB"]),
    "stepdeploy_ib_hcas": st.lists(st.from_regex(r"mlx5_[0-9]", fullmatch=True), unique=True, max_size=4),
    "stepdeploy_profile": st.just("sim-cpu"),
    "stepdeploy_ssh_known_hosts": st.from_regex(r"/[a-z]{1,8}/known_hosts", fullmatch=True),
    "ansible_port": st.integers(1, 65535),
    "ansible_user": st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    "ansible_connection": st.sampled_from(["ssh", "smart"]),
    "ansible_ssh_common_args": st.just("-o UserKnownHostsFile=/k/known_hosts -o StrictHostKeyChecking=yes"),
    "ansible_ssh_private_key_file": st.from_regex(r"~?/[a-z]{1,8}/id_ed25519", fullmatch=True),
}
assignments = st.dictionaries(st.sampled_from(sorted(GOOD)), st.just(None), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: GOOD[k] | GOOD[k] | GOOD[k] | values for k in keys})
)


def _ini_value(value: object) -> str:
    text = repr(value) if isinstance(value, list | dict) else str(value)
    return text.replace("\n", " ")


ini_lines = st.one_of(
    st.builds(lambda g: f"[{g}]", names),
    st.builds(lambda g, kind: f"[{g}:{kind}]", names, st.sampled_from(["vars", "children", "hosts", "x"])),
    st.builds(lambda h, assigns: " ".join([h, *(f"{k}={_ini_value(v)}" for k, v in assigns)]),
              host_names, st.lists(st.tuples(st.sampled_from(VARIABLES), values), max_size=4)),
    st.builds(lambda k, v: f"{k}={_ini_value(v)}", st.sampled_from(VARIABLES), values),
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=30),
    st.sampled_from(["", "# comment", "; comment", "=", "[", "]", "[]", "a:b:c"]),
)
ini_texts = st.lists(ini_lines, max_size=12).map("\n".join)

var_maps = st.dictionaries(st.sampled_from(VARIABLES), values, max_size=4)
host_maps = st.dictionaries(host_names, st.none() | var_maps, max_size=4)
groups = st.recursive(
    st.fixed_dictionaries({}, optional={"hosts": host_maps, "vars": var_maps}),
    lambda inner: st.fixed_dictionaries({}, optional={"children": st.dictionaries(names, inner, max_size=2),
                                                      "hosts": host_maps}),
    max_leaves=6,
)
yaml_documents = st.one_of(
    st.builds(lambda g: {"all": g}, groups),
    st.dictionaries(names, st.one_of(groups, values), max_size=3),
    values,
)
yaml_texts = st.one_of(
    yaml_documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
    st.text(max_size=80),
)
group_vars_texts = st.one_of(
    st.none(),
    var_maps.map(yaml.safe_dump),
    st.text(max_size=40),
)


def _write_case(root: Path, name: str, text: str, group_vars: str | None) -> Path:
    case = root / f"case{next(_counter)}"
    case.mkdir()
    if group_vars is not None:
        (case / "group_vars").mkdir()
        (case / "group_vars" / "all.yml").write_text(group_vars, encoding="utf-8")
    path = case / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


def _assert_cluster_or_bad_input(path: Path) -> None:
    try:
        cluster = load_cluster(path)
    except BadInput as exc:
        assert exc.message and "\n" not in exc.message
        exc.message.encode("utf-8")  # printable on any terminal
        return
    assert isinstance(cluster, Cluster) and cluster.nodes
    assert len({(n.address, n.ssh.port) for n in cluster.nodes}) == len(cluster.nodes)


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inventory-fuzz")


@FUZZ
@given(text=ini_texts, group_vars=group_vars_texts, suffix=st.sampled_from(["ini", "", "cfg"]))
def test_random_ini_inventories(fuzz_root: Path, text: str, group_vars: str | None, suffix: str) -> None:
    _assert_cluster_or_bad_input(_write_case(fuzz_root, f"hosts.{suffix}".rstrip("."), text, group_vars))


@FUZZ
@given(text=yaml_texts, group_vars=group_vars_texts, suffix=st.sampled_from(["yml", "yaml", "json"]))
def test_random_yaml_inventories(fuzz_root: Path, text: str, group_vars: str | None, suffix: str) -> None:
    _assert_cluster_or_bad_input(_write_case(fuzz_root, f"hosts.{suffix}", text, group_vars))


@FUZZ
@given(group=assignments, hosts=st.lists(assignments, min_size=1, max_size=3))
def test_random_values_for_our_variables(fuzz_root: Path, group: dict[str, object],
                                         hosts: list[dict[str, object]]) -> None:
    members = {f"n{i}": {"ansible_host": f"192.0.2.{i + 1}", **extra} for i, extra in enumerate(hosts)}
    document = {"all": {"children": {"gpu": {"hosts": members, "vars": group}}}}
    _assert_cluster_or_bad_input(_write_case(fuzz_root, "hosts.yml", yaml.safe_dump(document), None))
