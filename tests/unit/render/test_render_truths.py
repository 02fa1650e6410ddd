"""`stepdeploy render` says what is true: a layout that does not fit is refused with its shortfall (exit 1) unless
--force, which the manifest records; a sequence beyond the model's positions is bad input (exit 2); hints name the
real inventory; --out takes an empty directory as its help says; the help's example runs as written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.render.manifest import Manifest

REPO = Path(__file__).resolve().parents[3]
H200_PAIR = """[gpu]
g1 ansible_host=192.0.2.9
g2 ansible_host=192.0.2.10

[gpu:vars]
stepdeploy_profile=hopper-cu130
stepdeploy_gpus_per_node=8
stepdeploy_gpu_model=H200
stepdeploy_fabric=infiniband
stepdeploy_train_iface=ib0
"""


def render(tmp_path: Path, *args: str) -> object:
    inventory = tmp_path / "inv.ini"
    inventory.write_text(H200_PAIR)
    return CliRunner().invoke(app, ["render", "-i", str(inventory), *args])


def test_a_layout_that_does_not_fit_is_refused_with_its_shortfall(tmp_path: Path) -> None:
    out = tmp_path / "big"
    res = render(tmp_path, "-m", "step-3.5-flash", "--layout", "tp=8,pp=2", "--out", str(out))
    error = res.exception
    assert isinstance(error, StepdeployError) and not isinstance(error, BadInput) and error.exit_code == 1
    assert "layout tp=8,pp=2 does not fit on 2 node(s) x 8 H200" in error.message
    assert "GiB per GPU" in error.message and "the GPU has 140.40 GiB" in error.message
    assert "--force" in (error.hint or "") and str(tmp_path / "inv.ini") in (error.hint or "")
    assert not out.exists()


def test_force_renders_it_and_the_manifest_says_so(tmp_path: Path) -> None:
    out = tmp_path / "forced"
    res = render(tmp_path, "-m", "step-3.5-flash", "--layout", "tp=8,pp=2", "--out", str(out), "--force")
    assert res.exit_code == 0, res.output
    layout = json.loads((out / "manifest.json").read_text())["inputs"]["layout"]
    assert layout["fits"] is False and layout["forced"] is True and "GiB per GPU" in layout["shortfall"]


def test_a_layout_that_fits_is_not_marked_forced(tmp_path: Path) -> None:
    out = tmp_path / "fits"
    res = render(tmp_path, "-m", "proxy-0.7b-dense", "--layout", "tp=2,mbs=2", "--out", str(out), "--force")
    assert res.exit_code == 0, res.output
    layout = json.loads((out / "manifest.json").read_text())["inputs"]["layout"]
    assert layout["fits"] is True and "forced" not in layout and "shortfall" not in layout


def test_a_sequence_beyond_the_models_positions_is_bad_input(tmp_path: Path) -> None:
    res = render(tmp_path, "-m", "tiny-dense", "--seq", "99999999", "--out", str(tmp_path / "long"))
    assert isinstance(res.exception, BadInput) and res.exception.exit_code == 2
    assert "exceeds tiny-dense's max_position_embeddings 512" in res.exception.message
    assert not (tmp_path / "long").exists()


def test_an_odd_sequence_renders(tmp_path: Path) -> None:
    res = render(tmp_path, "-m", "tiny-dense", "--seq", "511", "--out", str(tmp_path / "odd"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "odd" / "workload.json").read_text())["training"]["seq_length"] == 511


def test_hints_name_the_inventory_and_the_job(tmp_path: Path) -> None:
    res = render(tmp_path, "-m", "tiny-dense", "--layout", "tp=3", "--seq", "128", "--out", str(tmp_path / "x"))
    assert isinstance(res.exception, BadInput)
    assert res.exception.hint == f"stepdeploy plan -m tiny-dense -i {tmp_path / 'inv.ini'} --seq 128"
    assert "INVENTORY" not in res.exception.hint


def test_a_broken_manifest_hints_the_render_of_its_own_inventory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert render(tmp_path, "-m", "tiny-dense", "--out", str(out)).exit_code == 0
    data = json.loads((out / "manifest.json").read_text())
    data["nodes"].append(data["nodes"][0])
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BadInput, match="names a node twice") as refused:
        Manifest.load(out)
    assert refused.value.hint == f"stepdeploy render -i {tmp_path / 'inv.ini'} -m tiny-dense --out {out}-2"


def test_out_may_be_an_existing_empty_directory_as_the_help_says(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    res = render(tmp_path, "-m", "tiny-dense", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert (out / "manifest.json").is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    help_text = " ".join(CliRunner().invoke(app, ["render", "--help"], terminal_width=400).output.split())
    assert "a new path or an empty directory" in help_text and "must not exist" not in help_text


def test_the_help_example_runs_as_written_from_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    help_text = CliRunner().invoke(app, ["render", "--help"], terminal_width=400).output
    example = next(line for line in help_text.splitlines() if line.strip().startswith("Example:"))
    words = shlex.split(example.split("Example:", 1)[1])
    assert words[:2] == ["stepdeploy", "render"] and "--out" in words
    words[words.index("--out") + 1] = str(tmp_path / "example")  # the example's own path, moved out of the checkout
    monkeypatch.chdir(REPO)
    res = CliRunner().invoke(app, words[1:])
    assert res.exit_code == 0, f"{example.strip()} -> exit {res.exit_code}: {res.output}{res.exception!r}"
    assert (tmp_path / "example" / "manifest.json").is_file()
