"""How provisioning brings the NCCL facts back: the variable `stepdeploy provision` sets, and the infiniband
role's facts tasks run by real Ansible on the controller itself (local connection; the discovery module only
reads /sys, the facts file goes to a temporary directory) - fetched on a real run, not in check mode, and a
second run changes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stepdeploy import ansible_run
from stepdeploy.provision.runner import ProvisionRequest, extravars, saved_facts
from stepdeploy.render.facts import default_facts_dir, load_facts

ROOT = Path(__file__).resolve().parents[3]


def test_provision_sends_the_facts_directory_next_to_the_inventory(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.ini"
    assert extravars(ProvisionRequest(inventory=inventory)) == {
        "infiniband_nccl_facts_fetch_dir": str(tmp_path / ".stepdeploy" / "facts")}
    assert ProvisionRequest(inventory=inventory).nccl_facts_dir == default_facts_dir(inventory)
    given = ProvisionRequest(inventory=inventory, facts_dir=tmp_path / "f")
    assert extravars(given)["infiniband_nccl_facts_fetch_dir"] == str(tmp_path / "f")


def test_saved_facts_lists_the_hosts_with_a_file(tmp_path: Path) -> None:
    (tmp_path / "node1.json").write_text("{}")
    assert saved_facts(tmp_path, ["node1", "node2"]) == ("node1",)


def _play(tmp_path: Path, name: str, *, check: bool, fetch_dir: Path):
    play = tmp_path / "facts.yml"
    play.write_text(f"""---
- name: The infiniband role's facts tasks
  hosts: all
  gather_facts: false
  tasks:
    - name: Discover, save and fetch the NCCL facts
      ansible.builtin.include_role:
        name: infiniband
        tasks_from: facts.yml
      vars:
        infiniband_netdevs: [lo]
        infiniband_nccl_facts_path: {json.dumps(str(tmp_path / "node/etc/stepdeploy/nccl.json"))}
""")
    inventory = tmp_path / "inv.ini"
    inventory.write_text(f"fakenode ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    (tmp_path / name).mkdir()
    return ansible_run.run(tmp_path / name, inventory, playbook=str(play), cmdline="--check" if check else None,
                           extravars={"infiniband_nccl_facts_fetch_dir": str(fetch_dir)},
                           envvars={"ANSIBLE_ROLES_PATH": str(ROOT / "roles")})


def _task_status(runner, task: str) -> str:
    ends = ("runner_on_ok", "runner_on_skipped", "runner_on_failed")
    return next(e["event"] for e in runner.events if e.get("event") in ends and e["event_data"].get("task") == task)


def test_role_fetches_the_facts_file_on_a_real_run_only(tmp_path: Path) -> None:
    fetch_dir = tmp_path / "controller" / ".stepdeploy" / "facts"
    fetch = "Bring the NCCL facts back to the controller"
    checked = _play(tmp_path, "check", check=True, fetch_dir=fetch_dir)
    assert checked.rc == 0 and _task_status(checked, fetch) == "runner_on_skipped"
    assert not fetch_dir.exists(), "check mode writes nothing on the controller either"

    first = _play(tmp_path, "first", check=False, fetch_dir=fetch_dir)
    assert first.rc == 0 and first.stats["changed"]["fakenode"] > 0
    saved = fetch_dir / "fakenode.json"
    assert saved.read_bytes() == (tmp_path / "node/etc/stepdeploy/nccl.json").read_bytes()
    facts = load_facts(fetch_dir, ["fakenode"])["fakenode"]
    assert facts.source == str(saved) and facts.ib_hcas == tuple(
        f"{h['device']}:{h['port']}" for h in json.loads(saved.read_text())["hcas"])

    again = _play(tmp_path, "again", check=False, fetch_dir=fetch_dir)
    assert again.rc == 0 and again.stats["changed"].get("fakenode", 0) == 0, "a second run changes nothing"
