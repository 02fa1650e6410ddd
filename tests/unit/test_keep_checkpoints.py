"""`--keep-checkpoints` and `--env` of `rollout run`: stored in the rollout's configuration, shown by the dry run,
passed to every attempt's render (workload.json's training.keep_checkpoints, which the engines' retention reads;
env.sh)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from stepdeploy.cli.app import main
from stepdeploy.rollout.config import RolloutConfig
from stepdeploy.rollout.service import AttemptService

CPU_PAIR = "[g]\nnode1 ansible_host=10.90.0.11\nnode2 ansible_host=10.90.0.12\n[g:vars]\nstepdeploy_gpus_per_node=0\n"


def _cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, str, str]:
    (tmp_path / "inv.ini").write_text(CPU_PAIR)
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--stages", "soak",
              "--run-dir", str(tmp_path / "r"), *args])
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


def test_the_dry_run_shows_it_and_zero_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _cli(capsys, tmp_path, "--dry-run")
    assert code == 0 and json.loads(out)["soak"]["keep_checkpoints"] == 2
    code, out, _ = _cli(capsys, tmp_path, "--keep-checkpoints", "3", "--dry-run")
    assert code == 0 and json.loads(out)["soak"]["keep_checkpoints"] == 3
    code, out, err = _cli(capsys, tmp_path, "--keep-checkpoints", "0", "--dry-run")
    assert code == 2 and out == "" and "--keep-checkpoints" in err and not (tmp_path / "r").exists()


def test_every_attempt_renders_with_it() -> None:
    config = RolloutConfig(inventory="inv.ini", model="tiny-dense", stages=("soak",), keep_checkpoints=3).checked()
    assert RolloutConfig.from_json(config.to_json()).keep_checkpoints == 3
    old = {k: v for k, v in config.to_json().items() if k != "keep_checkpoints"}  # a ledger from before
    assert RolloutConfig.from_json(old).keep_checkpoints == 2
    opts = AttemptService.render_options(SimpleNamespace(config=config), "soak", SimpleNamespace(nproc_per_node=1),
                                         10, "r-soak-a1", save_interval=5)
    assert opts.keep_checkpoints == 3 and opts.save_interval == 5


def test_env_reaches_every_attempt_and_a_secret_is_refused(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    """`--env KEY=VALUE` (e.g. STEPDEPLOY_PROFILE_FIRST=1): shown by the dry run, kept in the configuration the ledger
    stores, rendered for every attempt; a name that says secret is refused before anything exists (its value
    would be written into env.sh and the ledger)."""
    code, out, _ = _cli(capsys, tmp_path, "--env", "STEPDEPLOY_PROFILE_FIRST=1", "--env", "NCCL_DEBUG=INFO",
                        "--dry-run")
    assert code == 0 and json.loads(out)["env"] == {"STEPDEPLOY_PROFILE_FIRST": "1", "NCCL_DEBUG": "INFO"}
    for bad, why in (("HF_TOKEN=abc", "secret"), ("WANDB_API_KEY=k", "secret"), ("NOEQUALS", "KEY=VALUE")):
        code, out, err = _cli(capsys, tmp_path, "--env", bad, "--dry-run")
        assert code == 2 and out == "" and why in err and not (tmp_path / "r").exists(), (bad, err)
    config = RolloutConfig(inventory="inv.ini", model="tiny-dense", stages=("soak",),
                           extra_env=(("STEPDEPLOY_PROFILE_FIRST", "1"),)).checked()
    assert RolloutConfig.from_json(json.loads(json.dumps(config.to_json()))).extra_env == config.extra_env
    old = {k: v for k, v in config.to_json().items() if k != "extra_env"}  # a ledger from before
    assert RolloutConfig.from_json(old).extra_env == ()
    opts = AttemptService.render_options(SimpleNamespace(config=config), "soak", SimpleNamespace(nproc_per_node=1),
                                         10, "r-soak-a1")
    assert opts.extra_env == (("STEPDEPLOY_PROFILE_FIRST", "1"),)
