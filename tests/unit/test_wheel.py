"""The wheel is the whole product: it holds every file of the package and of the checkout's top-level playbooks/,
roles/ and templates/ (every role file whatever its suffix), and installed into a fresh venv it renders a run from
a directory outside this checkout, and every help example names only what the wheel ships. `provision --check` from
the same install is tests/integration/test_wheel_provision.py; `ansible-playbook ... playbooks/site.yml --check` from
the checkout is tests/integration/test_checkout_playbook.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.wheel_venv import REPO, SHIPPED_AS, InstalledWheel

INVENTORY = ("[cpu]\nn1 ansible_host=192.0.2.1\nn2 ansible_host=192.0.2.2\n[cpu:vars]\nstepdeploy_gpus_per_node=0\n"
             "stepdeploy_profile=sim-cpu\n")


def _files(top: Path) -> set[str]:
    """Every file under `top` (bytecode and hidden caches aside), relative to it."""
    return {p.relative_to(top).as_posix() for p in top.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            and not any(part.startswith(".") for part in p.relative_to(top).parts)}


def _source_files() -> set[str]:
    """Every file of the package in this checkout, as the wheel names it, and those of the top-level directories
    it ships (playbooks/, roles/, templates/, inventory/, docs/: pyproject.toml's package-dir)."""
    return ({f"stepdeploy/{name}" for name in _files(REPO / "stepdeploy")}
            | {f"{inside}/{name}" for top, inside in SHIPPED_AS.items() for name in _files(REPO / top)})


def test_the_wheel_holds_every_file_of_the_package_and_nothing_else(wheel_install: InstalledWheel) -> None:
    in_wheel = {name for name in wheel_install.names() if not name.startswith("stepdeploy-")}  # minus dist-info
    source = _source_files()
    assert source - in_wheel == set(), "files of the checkout the wheel leaves out: widen pyproject.toml's package-data"
    assert in_wheel - source == set(), "files in the wheel that are in neither stepdeploy/ nor a shipped directory"


def test_the_top_level_playbooks_roles_and_templates_ship_under_the_package(wheel_install: InstalledWheel,
                                                                             tmp_path: Path) -> None:
    """The design card's layout: playbooks/, roles/ and templates/ at the checkout's top level (none inside
    stepdeploy/), each shipped under the package, where stepdeploy.resources finds it in an install."""
    assert not any((REPO / "stepdeploy" / top).exists() for top in ("ansible", "playbooks", "roles", "templates"))
    in_wheel = set(wheel_install.names())
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    assert {"common", "nvidia_driver", "cuda_toolkit", "nccl", "python_env", "infiniband"} <= set(roles)
    expected = {"stepdeploy/playbooks/site.yml", "stepdeploy/playbooks/compat.yml",
                "stepdeploy/playbooks/group_vars/all/stack.yml",
                "stepdeploy/playbooks/filter_plugins/stepdeploy_filters.py"}
    expected |= {f"stepdeploy/roles/{role}/{part}" for role in roles
                 for part in ("meta/argument_specs.yml", "tasks/validate.yml", "tasks/main.yml")}
    expected |= {f"stepdeploy/templates/{p.name}" for p in (REPO / "templates").glob("*.j2")}
    assert "stepdeploy/templates/launch.sh.j2" in expected
    assert expected - in_wheel == set(), "the wheel lacks these"
    where = wheel_install.run(wheel_install.python, "-c", "from stepdeploy import resources as r; "
                              "print(r.playbooks_dir()); print(r.roles_dir()); print(r.templates_dir())", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    dirs = [Path(line) for line in where.stdout.split()]
    assert [d.name for d in dirs] == ["playbooks", "roles", "templates"]
    for found in dirs:
        assert wheel_install.venv in found.parents and found.parent.name == "stepdeploy", found


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


# A help example run where the user stands: it may name what it makes (runs/r1, data/corpus) and a seed inventory
# (inventory/...: every command finds the copy the wheel ships), never another file of this checkout.
CHECKOUT_ONLY = ("README.md", "pyproject.toml", "docs", "stepdeploy", "playbooks", "roles", "templates", "tests",
                 "bench")
HELP_EXAMPLES = """
import json, typer
from stepdeploy.cli.app import app
from stepdeploy.seed import shipped_inventory

def walk(command, path):
    yield " ".join(path), command.epilog or ""
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from walk(sub, [*path, name])

examples = dict(walk(typer.main.get_command(app), ["stepdeploy"]))
words = {w for text in examples.values() for w in text.split() if w.startswith("inventory/")}
print(json.dumps({"examples": examples, "inventories": {w: str(shipped_inventory(w)) for w in words}}))
"""


def _example_words(epilog: str) -> list[str]:
    """The arguments of every `stepdeploy ...` command an epilog's examples give (chains split at &&)."""
    words: list[str] = []
    for example in epilog.split("Example: ")[1:]:
        for command in example.split("\n", 1)[0].split("&&"):
            program, *arguments = command.split()
            assert program == "stepdeploy", example
            words += arguments
    return words


def test_every_help_example_names_only_what_the_wheel_ships(wheel_install: InstalledWheel, tmp_path: Path) -> None:
    res = wheel_install.run(wheel_install.python, "-c", HELP_EXAMPLES, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    examples: dict[str, str] = found["examples"]
    assert "stepdeploy demo" in examples and "Example: stepdeploy demo" in examples["stepdeploy demo"]
    with_example = {name for name, text in examples.items() if "Example: stepdeploy " in text}
    assert {"stepdeploy", "stepdeploy render", "stepdeploy provision", "stepdeploy plan"} <= with_example
    checkout_paths = {(name, word) for name, text in examples.items() for word in _example_words(text)
                      if not word.startswith("-") and word.split("/", 1)[0] in CHECKOUT_ONLY}
    assert checkout_paths == set(), "help examples that name a file only a checkout has (the wheel user has none)"
    assert found["inventories"], "no help example names a seed inventory: this test lost its subject"
    for word, shipped in found["inventories"].items():
        assert shipped != "None" and wheel_install.venv in Path(shipped).parents, f"{word}: no packaged copy"
