"""The wheel is the whole product: it holds every file of the package (templates, playbooks, every role file
whatever its suffix), and installed into a fresh venv it renders a run from a directory outside this checkout.
`provision --check` from the same install is tests/integration/test_wheel_provision.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.wheel_venv import REPO, InstalledWheel

INVENTORY = ("[cpu]\nn1 ansible_host=192.0.2.1\nn2 ansible_host=192.0.2.2\n[cpu:vars]\nstepdeploy_gpus_per_node=0\n"
             "stepdeploy_profile=sim-cpu\n")


def _files(top: Path) -> set[str]:
    """Every file under `top` (bytecode and hidden caches aside), relative to it."""
    return {p.relative_to(top).as_posix() for p in top.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            and not any(part.startswith(".") for part in p.relative_to(top).parts)}


def _source_files() -> set[str]:
    """Every file of the package in this checkout, as the wheel names it, and the top-level inventory/ and docs/
    it ships as stepdeploy/seed/ (pyproject.toml's package-dir)."""
    return ({f"stepdeploy/{name}" for name in _files(REPO / "stepdeploy")}
            | {f"stepdeploy/seed/{top}/{name}" for top in ("inventory", "docs") for name in _files(REPO / top)})


def test_the_wheel_holds_every_file_of_the_package_and_nothing_else(wheel_install: InstalledWheel) -> None:
    in_wheel = {name for name in wheel_install.names() if not name.startswith("stepdeploy-")}  # minus dist-info
    source = _source_files()
    assert source - in_wheel == set(), "files of stepdeploy/ the wheel leaves out: widen pyproject.toml's package-data"
    assert in_wheel - source == set(), "files in the wheel that are not in stepdeploy/"
    for shipped in ("stepdeploy/templates/launch.sh.j2", "stepdeploy/ansible/playbooks/site.yml",
                    "stepdeploy/ansible/roles/common/meta/argument_specs.yml",
                    "stepdeploy/ansible/roles/slurm/templates/slurm.conf.j2"):
        assert shipped in in_wheel


def test_the_help_examples_and_the_demos_files_work_outside_a_checkout(wheel_install: InstalledWheel,
                                                                      tmp_path: Path) -> None:
    """A user of the wheel has no checkout: `inventory/dgx.ini` in the help examples is the seed inventory the
    package ships, and the demo trains on the docs it ships."""
    shown = wheel_install.run(wheel_install.stepdeploy, "inventory", "show", "inventory/dgx.ini", "--json",
                              cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "dgx-01" in shown.stdout and "using the copy shipped with stepdeploy" in shown.stderr
    example = wheel_install.run(wheel_install.stepdeploy, "render", "--help", cwd=tmp_path).stdout
    argv = example.split("Example: stepdeploy ", 1)[1].split()
    rendered = wheel_install.run(wheel_install.stepdeploy, *argv, cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    assert (tmp_path / "runs/r1/manifest.json").is_file()
    where = wheel_install.run(wheel_install.python, "-c", "from stepdeploy.cli import demo; "
                              "print(demo.seed_path(demo.PLAN_INVENTORY)); print(demo.DEMO_TEXT)", cwd=tmp_path)
    seed_inventory, text = (Path(line) for line in where.stdout.split())
    assert seed_inventory.is_file() and wheel_install.venv in seed_inventory.parents
    assert wheel_install.venv in text.parents and len(list(text.glob("*.md"))) >= 10


def test_the_venv_imports_the_wheel_not_this_checkout(wheel_install: InstalledWheel, tmp_path: Path) -> None:
    res = wheel_install.run(wheel_install.python, "-c", "import stepdeploy; print(stepdeploy.__file__)", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where = Path(res.stdout.strip())
    assert wheel_install.venv in where.parents and REPO not in where.parents, where


def test_the_installed_wheel_renders_a_run(wheel_install: InstalledWheel, tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text(INVENTORY)
    res = wheel_install.run(wheel_install.stepdeploy, "render", "-i", "inv.ini", "-m", "tiny-dense", "--out", "out",
                            cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    assert {"workload.json", "nodes/0-n1/launch.sh", "nodes/1-n2/env.sh", "workload/train.py"} <= set(listed)
    for path, entry in listed.items():
        assert hashlib.sha256((out / path).read_bytes()).hexdigest() == entry["sha256"], path
    assert listed["nodes/0-n1/launch.sh"]["from"] == "templates/launch.sh.j2"
    # The run directory is one the installed package reads back (manifest checked, nothing connects).
    dry = wheel_install.run(wheel_install.stepdeploy, "run", "launch", "--dry-run", "out", "-i", "inv.ini",
                            cwd=tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "n1 (192.0.2.1): upload out to " in dry.stdout and "nodes/1-n2/launch.sh" in dry.stdout
    print(f"\nwheel {wheel_install.wheel.stat().st_size / 1024:.0f} KiB; " +
          ", ".join(f"{k} {v:.1f} s" for k, v in wheel_install.timings.items()))
