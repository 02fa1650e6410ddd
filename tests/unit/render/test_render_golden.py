"""Every rendered file is pinned by a golden file, and every shell file passes shellcheck.

Regenerate after an intended change:  STEPDEPLOY_UPDATE_GOLDEN=1 pytest tests/unit/render
(then read the diff of tests/golden/render/ before committing it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .cases import CASES

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "render"
UPDATE = os.environ.get("STEPDEPLOY_UPDATE_GOLDEN") == "1"
HOW = "regenerate with: STEPDEPLOY_UPDATE_GOLDEN=1 pytest tests/unit/render, then review git diff tests/golden"


@pytest.mark.parametrize("case", list(CASES))
def test_rendered_files_equal_golden(case: str) -> None:
    rendered = CASES[case]()
    where = GOLDEN / case
    if UPDATE:
        shutil.rmtree(where, ignore_errors=True)
        for item in rendered.files:
            (where / item.path).parent.mkdir(parents=True, exist_ok=True)
            (where / item.path).write_text(item.text)
    golden = {p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file()}
    assert golden == {f.path for f in rendered.files}, f"files differ from {where}; {HOW}"
    for item in rendered.files:
        expected = (where / item.path).read_text()
        assert item.text == expected, f"{case}/{item.path} differs from its golden file; {HOW}"


@pytest.mark.parametrize("case", list(CASES))
def test_shell_files_are_shellcheck_clean(case: str, tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed; the README's test command installs it (apt-get install shellcheck)")
    rendered = CASES[case]()
    scripts = []
    for item in rendered.files:
        if item.path.endswith(".sh"):
            path = tmp_path / item.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(item.text)
            scripts.append(str(path))
    assert scripts
    res = subprocess.run(["shellcheck", "--severity=style", *scripts], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_manifest_hashes_every_file_and_names_its_template() -> None:
    import hashlib
    import json

    rendered = CASES["sim-cpu"]()
    manifest = json.loads(rendered.file("manifest.json").text)
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == {f.path for f in rendered.files} - {"manifest.json"}
    for item in rendered.files:
        if item.path != "manifest.json":
            assert listed[item.path]["sha256"] == hashlib.sha256(item.text.encode()).hexdigest()
    assert listed["nodes/0-node1/launch.sh"]["from"] == "templates/launch.sh.j2"
    assert len(listed["nodes/0-node1/launch.sh"]["template_sha256"]) == 64
    assert listed["workload/train.py"]["from"] == "stepdeploy/workload"
    assert manifest["inputs"]["inventory"]["sha256"] == "0" * 64
