"""`plan` says when the global batch caps data parallelism, and which global batch would not (stderr and JSON)."""

from __future__ import annotations

import json

import pytest

from stepdeploy.cli.app import main


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


def test_a_small_global_batch_on_many_gpus_is_named_with_the_batch_that_would_not_cap(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "-m", "proxy-0.7b-dense", "--nodes", "128", "--gpus-per-node", "8", "--gpu",
                          "H200", "--json")
    cap = json.loads(out)["batch_cap"]
    assert code == 0 and cap["global_batch_size"] == 32 and cap["uncapped_global_batch_size"] == 1024
    assert cap["uncapped"]["dp"] > cap["capped"]["dp"] and cap["uncapped"]["mfu"] > cap["capped"]["mfu"]
    assert "warning: global batch 32 caps data parallelism on 1,024 GPUs" in err and "--gbs 1024" in err


def test_a_batch_that_is_a_multiple_of_the_gpus_warns_of_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "-m", "tiny-dense", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H200",
                          "--json")
    assert code == 0 and json.loads(out)["batch_cap"] is None and "caps data parallelism" not in err
