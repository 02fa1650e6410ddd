"""Every kind of bad inventory is one BadInput line naming file, host, variable, the fault and the fix."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from stepdeploy.errors import BadInput
from stepdeploy.inventory import ansible_source, load_cluster


def write(root: Path, relative: str, text: str | bytes) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path | str) -> str:
    with pytest.raises(BadInput) as caught:
        load_cluster(path)
    message = caught.value.message
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_file_names_the_path_and_an_example(tmp_path: Path) -> None:
    message = error_of(tmp_path / "nope.ini")
    assert "nope.ini: no such inventory file" in message
    assert "inventory/dgx.ini" in message


def test_directory_is_not_an_inventory_file(tmp_path: Path) -> None:
    assert "is a directory" in error_of(tmp_path)


def test_device_or_fifo_is_refused_instead_of_read_forever() -> None:
    assert error_of("/dev/null").startswith("/dev/null: is not a regular file")


def test_empty_path() -> None:
    assert error_of("").startswith("no inventory file given")


def test_control_characters_from_the_file_are_escaped(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "inv.ini", "[gpu:vars]\nfoo\x1b]0;pwned\x07\n"))
    assert "\x1b" not in message and "\\x1b" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[gpu:vars]\nfoo\n", "inv.ini:2: not a valid INI inventory: Expected key=value, got: foo"),
        ("[gpu:bogus]\nx\n", "not a valid INI inventory: Section [gpu:bogus] has unknown type: bogus"),
        ("[a:children]\nb\n[b:children]\na\n", "creates a recursive dependency loop"),
        ("[gpu]\nn1 ansible_host\n", "inv.ini:2: not a valid INI inventory: Expected key=value host"),
    ],
)
def test_ini_syntax_errors(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(write(tmp_path, "inv.ini", text))


def test_yaml_syntax_error_has_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.yml", "all:\n  hosts:\n    n1: {ansible_host: 192.0.2.1\n")
    message = error_of(path)
    assert "inv.yml:4: not a valid YAML inventory: YAML parsing failed" in message


def test_yaml_part_ansible_would_skip_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.yml", "all:\n  host:\n    n1: {ansible_host: 192.0.2.1}\n")
    message = error_of(path)
    assert "unexpected key (host) in group (all)" in message
    assert "ansible would ignore that part" in message


def test_binary_garbage_is_bad_input(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "inv", b"\x00\xff\xfe\n\x80"))
    assert "inv" in message
    message.encode("utf-8")  # printable whatever the file held


def test_inventory_without_hosts(tmp_path: Path) -> None:
    assert "lists no hosts" in error_of(write(tmp_path, "inv.ini", "# empty\n[gpu]\n"))


def test_host_without_an_address(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "inv.ini", "[gpu]\nnode1\n"))
    assert "inv.ini: host 'node1' has no address" in message
    assert "ansible_host" in message


@pytest.mark.parametrize("address", ["10.0.0.300", "not an address", "-bad-.example"])
def test_malformed_ansible_host(tmp_path: Path, address: str) -> None:
    message = error_of(write(tmp_path, "inv.ini", f"[gpu]\nnode1 ansible_host='{address}'\n"))
    assert f"inv.ini:2: host 'node1': ansible_host = {address!r} is not an address" in message
    assert "IPv4/IPv6 address or a DNS name" in message


def test_duplicate_addresses_name_both_hosts(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\na ansible_host=192.0.2.5\nb ansible_host=192.0.2.5\n")
    message = error_of(path)
    assert "hosts 'a' and 'b' both have address 192.0.2.5 port 22" in message


def test_unknown_profile_lists_the_known_ones(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.1 stepdeploy_profile=seed2024\n"))
    assert "host 'n1': stepdeploy_profile = 'seed2024' is not a known stack profile" in message
    assert "(did you mean 'seed-2024'?)" in message
    assert "known profiles: seed-2024, hopper-cu128, hopper-cu130, spark-cuda13, sim-cpu" in message


def test_nodes_with_different_profiles(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "a ansible_host=192.0.2.1 stepdeploy_profile=sim-cpu\n"
                                      "b ansible_host=192.0.2.2 stepdeploy_profile=seed-2024\n"
                                      "c ansible_host=192.0.2.3\n")
    message = error_of(path)
    assert "stepdeploy_profile differs between nodes (a=sim-cpu, b=seed-2024, c=(none))" in message


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("stepdeploy_gpus_per_node=eight", "stepdeploy_gpus_per_node = 'eight' is not a whole number; "
                                           "use a whole number from 0 to 64"),
        ("stepdeploy_gpus_per_node=-1", "stepdeploy_gpus_per_node = -1 is out of range"),
        ("stepdeploy_gpus_per_node=65", "stepdeploy_gpus_per_node = 65 is out of range"),
        ("stepdeploy_gpus_per_node=8.5", "stepdeploy_gpus_per_node = 8.5 is not a whole number"),
        ("stepdeploy_gpus_per_node=True", "stepdeploy_gpus_per_node = True is a boolean"),
        ("stepdeploy_fabric=wifi", "stepdeploy_fabric = 'wifi' is not a known value; "
                                   "use one of ethernet, infiniband, roce"),
        ("stepdeploy_arch=sparc", "stepdeploy_arch = 'sparc' is not a known value; "
                                  "use one of aarch64, x86_64"),
        ("ansible_port=0", "ansible_port = 0 is out of range; use a TCP port from 1 to 65535"),
        ("ansible_port=ssh", "ansible_port = 'ssh' is not a whole number"),
        ("ansible_connection=docker", "ansible_connection = 'docker' is not a known value; "
                                      "stepdeploy drives nodes over ssh or local"),
        ("stepdeploy_ib_hcas=5", "stepdeploy_ib_hcas = 5 is not a list of device names"),
        ("stepdeploy_ib_hcas='[\"mlx5 0\"]'", "stepdeploy_ib_hcas = ['mlx5 0'] is not a list of devi"),
        ("stepdeploy_ib_hcas=mlx5_0,mlx5_0", "lists a device twice"),
        ("stepdeploy_train_iface=an-interface-name-too-long", "is not a network interface name"),
        ("stepdeploy_gpu_model='[1, 2]'", "stepdeploy_gpu_model = [1, 2] is not text"),
        ("stepdeploy_ssh_known_hosts=42", "stepdeploy_ssh_known_hosts = 42 is not a file path"),
        ("ansible_ssh_common_args='-o \"UserKnownHostsFile=/x'", "cannot be split into ssh arguments"),
    ],
)
def test_wrong_types_name_file_host_variable_and_what_is_valid(
    tmp_path: Path, assignment: str, expected: str
) -> None:
    message = error_of(write(tmp_path, "inv.ini", f"[gpu]\nnode1 ansible_host=192.0.2.1 {assignment}\n"))
    assert message.startswith(str(tmp_path / "inv.ini")), message
    assert "host 'node1'" in message
    assert expected in message


def test_error_names_the_group_vars_file_and_line_the_value_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nnode1 ansible_host=192.0.2.1\n")
    write(tmp_path, "group_vars/gpu.yml", "# GPUs\nstepdeploy_gpus_per_node: eight\n")
    message = error_of(path)
    assert message.startswith(f"{tmp_path}/group_vars/gpu.yml:2: host 'node1': stepdeploy_gpus_per_node")


def test_malformed_group_vars_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nnode1 ansible_host=192.0.2.1\n")
    write(tmp_path, "group_vars/gpu.yml", "a: 1\nb: [1, 2\n")
    message = error_of(path)
    assert message.startswith(f"{tmp_path}/group_vars/gpu.yml:3: YAML parsing failed")


def test_group_vars_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nnode1 ansible_host=192.0.2.1\n")
    write(tmp_path, "group_vars/gpu.yml", "- 1\n- 2\n")
    assert "group_vars/gpu.yml" in error_of(path)


def test_misspelt_stepdeploy_variable_suggests_the_right_one(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=192.0.2.1 stepdeploy_gpu_per_node=8\n")
    message = error_of(path)
    assert "host 'n1': stepdeploy_gpu_per_node is not a stepdeploy variable" in message
    assert "(did you mean 'stepdeploy_gpus_per_node'?)" in message


def test_jinja_template_is_refused_not_evaluated(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "n1 ansible_host=\"{{ lookup('pipe', 'touch pwned') }}\"\n")
    message = error_of(path)
    assert "ansible_host" in message and "is a Jinja template" in message
    assert not (Path.cwd() / "pwned").exists()


def test_vault_encrypted_value_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.ini", "[gpu]\nn1 ansible_host=192.0.2.1\n")
    write(tmp_path, "host_vars/n1.yml", "ansible_user: !vault |\n  $ANSIBLE_VAULT;1.1;AES256\n  6162636465\n")
    message = error_of(path)
    assert message.startswith(f"{tmp_path}/host_vars/n1.yml:1: host 'n1': ansible_user")
    assert "vault-encrypted" in message


def test_bad_input_prints_nothing_itself(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    for text in ("[gpu:vars]\nfoo\n", "all:\n  host: {}\n", "[gpu]\nn1\n"):
        with pytest.raises(BadInput):
            load_cluster(write(tmp_path, "inv.yml" if text.startswith("all") else "inv.ini", text))
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("inv.ini", "[gpu:vars]\nfoo\n", "inv.ini:2: not a valid INI inventory: Expected key=value"),
        ("inv.yml", "all:\n  hosts: {n1: [\n", "not a valid YAML inventory: YAML parsing failed"),
        ("inv.yml", "all:\n  host: {}\n", "unexpected key (host) in group (all)"),
    ],
)
def test_errors_without_ansibles_structured_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str, expected: str
) -> None:
    """If a future ansible-core drops the warning context we use, its printed warnings still give the line."""
    monkeypatch.setattr(ansible_source, "_deferred_warnings", lambda: contextlib.nullcontext(None))
    assert expected in error_of(write(tmp_path, name, text))
