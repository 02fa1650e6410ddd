"""What a layout needs on the nodes (plan/engines.needs: TransformerEngine for context parallelism), judged by
preflight's transformer_engine check against the facts the probe collects; the collector run for real here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepdeploy.catalog import load_hardware, load_model
from stepdeploy.plan import engines
from stepdeploy.plan.layout import Layout
from stepdeploy.preflight import host, probe, runner
from stepdeploy.preflight.model import NodeOutput, Section, Status

FIXTURES = Path(__file__).parents[2] / "fixtures" / "h200-x2"
# the probe's python section as on the H200 machine (whose recorded `pip list` has no TransformerEngine)
CUDA_ENV = {"python": "3.12.3", "executable": "/opt/torch/.venv/bin/python3", "torch": "2.11.0+cu130",
            "torch_cuda": "13.0", "cuda_available": True, "cuda_devices": 2, "torch_nccl": "2.28.9",
            "megatron_core": "0.19.2", "megatron_core_error": None, "flash_attn": None, "transformer_engine": None}
WITH_TE = {**CUDA_ENV, "transformer_engine": "2.8.0", "transformer_engine_error": None}


def py(env: dict) -> Section:
    return Section(0, "UserWarning: Transformer Engine is not installed\n" + json.dumps(env))


def cp_needs(model: str, cp: int) -> tuple[str, ...]:
    return tuple(engines.needs(load_model(model), Layout(cp=cp)))


def test_a_cp_layout_of_a_sliding_window_model_needs_te_with_a2a_or_all_gather() -> None:
    needs = cp_needs("step-3.5-flash", 2)
    assert len(needs) == 1 and needs[0].startswith("transformer_engine: ")
    exp = host.Expect(gpus=2, needs=needs)
    missing = host.check_transformer_engine(py(CUDA_ENV), exp)
    assert missing.status is Status.FAIL and missing.observed == "not installed"
    assert "a2a or all_gather" in missing.expected and "cp=1" in missing.fix
    present = host.check_transformer_engine(py(WITH_TE), exp)
    assert present.status is Status.OK and present.observed == "2.8.0: the layout's need is met"
    broken = {**WITH_TE, "transformer_engine_error": "ImportError: libcudnn.so.9"}
    result = host.check_transformer_engine(py(broken), exp)
    assert result.status is Status.FAIL and "libcudnn" in result.observed


def test_full_attention_takes_any_cp_comm_type_and_cp1_needs_nothing() -> None:
    needs = cp_needs("tiny-dense", 2)
    assert "any cp_comm_type" in host.check_transformer_engine(py(CUDA_ENV), host.Expect(needs=needs)).expected
    assert cp_needs("step-3.5-flash", 1) == ()
    exp = host.Expect(gpus=2)
    assert host.check_transformer_engine(py(CUDA_ENV), exp).status is Status.SKIP  # absence is a fact
    assert host.check_transformer_engine(py(WITH_TE), exp).status is Status.OK
    broken = {**WITH_TE, "transformer_engine_error": "ImportError: x"}
    assert host.check_transformer_engine(py(broken), exp).status is Status.WARN
    assert host.check_transformer_engine(Section(127, "no python found"), exp).status is Status.SKIP


def _node(env: dict) -> NodeOutput:
    sections = {"uname": Section(0, "Linux 6.18.44-fc-v657-gpu x86_64"),
                "nvidia_smi": Section(0, (FIXTURES / "nvidia-smi-q.xml").read_text()), "python": py(env)}
    return NodeOutput(node="node1", sections=sections)


@pytest.mark.parametrize(("env", "status"), [(CUDA_ENV, Status.FAIL), (WITH_TE, Status.OK)])
def test_preflight_judges_every_node_against_the_layouts_needs(env: dict, status: Status) -> None:
    opts = runner.Options(needs=cp_needs("step-3.5-flash", 2))
    node = _node(env)
    exp = runner.expect_for(runner.this_machine(), None, opts)
    results = {r.check: r for r in runner.node_results(node, exp, load_hardware())}
    assert results["transformer_engine"].status is status and results["transformer_engine"].node == "node1"
    assert runner.versions_of(node)["transformer-engine"] == env["transformer_engine"]


def _python_section(pythonpath: str | None) -> dict:
    """The probe's python section run by this interpreter (not -I, so PYTHONPATH can add a stand-in)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", probe.PYTHON_ENV], capture_output=True, text=True, env=env,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    return host.python_env(Section(0, res.stdout)) or {}


def test_the_probe_collects_transformer_engine_absent_and_present(tmp_path: Path) -> None:
    assert _python_section(None)["transformer_engine"] is None  # not in this venv: a fact, not an error
    info = tmp_path / "transformer_engine-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 9.9.9\n")
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    (tmp_path / "transformer_engine" / "pytorch.py").write_text("raise ImportError('stand-in without libcudnn')\n")
    env = _python_section(str(tmp_path))
    assert env["transformer_engine"] == "9.9.9"
    assert env["transformer_engine_error"] == "ImportError: stand-in without libcudnn"
    exp = host.Expect(needs=cp_needs("step-3.5-flash", 2))
    assert host.check_transformer_engine(py(env), exp).status is Status.FAIL


def test_layout_without_model_is_bad_input() -> None:
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", "--local", "--layout", "cp=2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: --layout needs --model")
    res = subprocess.run([sys.executable, "-m", "stepdeploy", "preflight", "--local", "-m", "tiny-dense", "--layout",
                          "cp=two"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: --layout: cp takes a positive integer")


def test_check_needs_judges_each_needed_package_with_its_own_check_and_fails_an_unknown_one() -> None:
    """What the rollout runs before a launch (rollout/stages/needs.py): the same checks, one per needed package."""
    needs = (*cp_needs("step-3.5-flash", 2), "nccl_sharp: a plugin no check knows")
    results = host.check_needs(py(WITH_TE), host.Expect(needs=needs))
    assert [(r.check, r.status) for r in results] == [("transformer_engine", Status.OK), ("nccl_sharp", Status.FAIL)]
    assert results[1].expected == "installed: a plugin no check knows"
    assert host.check_needs(py(CUDA_ENV), host.Expect(needs=needs[:1]))[0].status is Status.FAIL
    assert host.check_needs(py(CUDA_ENV), host.Expect()) == []


def test_the_rollouts_python_command_is_the_probes_python_section() -> None:
    pythons = ("/opt/stepdeploy/venv/bin/python",)
    assert probe.python_command(pythons) == probe.commands(probe.PreflightProbeSpec(pythons=pythons))["python"]
