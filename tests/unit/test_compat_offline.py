"""One stack verdict (compat.stack_verdict), offline, in plan and render alike (issue 38 item 1): the inventory's
profile against its declared GPUs and CPU architecture, and against what the engine calls (megatron-core's API
level, FlexAttention, TransformerEngine); a refusal is exit 2 naming the rule, its source and a profile that works
for that architecture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepdeploy import compat
from stepdeploy.catalog import load_model
from stepdeploy.catalog.loader import model_names
from stepdeploy.cli.app import app
from stepdeploy.errors import BadInput
from stepdeploy.inventory import load_cluster
from stepdeploy.plan import engines
from stepdeploy.plan.layout import Layout
from stepdeploy.render import RenderOptions, render_run
from stepdeploy.render.build import build_run
from stepdeploy.stack import get_profile

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = ("inventory/dgx.ini", "inventory/examples/hgx-h100-pair.ini", "inventory/examples/dgx-spark-pair.yml")
TOP = 3
B200_INI = """[b200]
b1 ansible_host=192.0.2.51
b2 ansible_host=192.0.2.52

[b200:vars]
stepdeploy_profile={profile}
stepdeploy_gpus_per_node=8
stepdeploy_gpu_model=B200
stepdeploy_arch=x86_64
stepdeploy_fabric=infiniband
"""
SIM_INI = """[sim]
node1 ansible_host=10.83.0.11
node2 ansible_host=10.83.0.12

[sim:vars]
stepdeploy_gpus_per_node=0
stepdeploy_profile={profile}
stepdeploy_fabric=ethernet
"""
LAYOUT_FIELDS = {f.name for f in dataclasses.fields(Layout)}


def _cli(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def _exit(res: object) -> int:
    """The exit code the command line gives (the app's main turns a StepdeployError into its code; CliRunner
    hands the exception back instead)."""
    exc = getattr(res, "exception", None)
    return exc.exit_code if isinstance(exc, BadInput) else getattr(res, "exit_code", -1)


def _inventory(tmp_path: Path, text: str) -> str:
    path = tmp_path / "inv.ini"
    path.write_text(text)
    return str(path)


def test_b200_with_the_seed_profile_is_refused_by_plan_and_render_naming_an_x86_64_blackwell_profile(
        tmp_path: Path) -> None:
    inv = _inventory(tmp_path, B200_INI.format(profile="seed-2024"))
    for args in (["plan", "-m", "tiny-dense", "-i", inv], ["render", "-m", "tiny-dense", "-i", inv, "--out",
                                                            str(tmp_path / "run")]):
        res = _cli(*args)
        assert _exit(res) == 2 and isinstance(res.exception, BadInput), (args, res.output)
        message, hint = res.exception.message, res.exception.hint or ""
        assert "CUDA 12.3 — needs >= 12.8 for sm_100" in message and "cuda-toolkit-release-notes" in message
        assert "PyTorch 2.3.1 — needs >= 2.7 for sm_100" in message and "pytorch-2-7" in message
        first = hint.split(": ", 1)[1].split(", ")[0]
        assert first == "blackwell-cu130", hint
        assert get_profile(first).arch == ("x86_64",) and "blackwell" in get_profile(first).gpu_families
        assert "spark-cuda13" not in hint and "sim-" not in hint  # aarch64 and test stand-ins never offered
    assert not (tmp_path / "run").exists()
    assert _cli("plan", "-m", "tiny-dense", "-i", _inventory(tmp_path, B200_INI.format(profile="blackwell-cu130"))
                ).exit_code == 0


def test_rollout_run_refuses_the_stack_before_its_run_directory_exists(tmp_path: Path) -> None:
    """`rollout run` (its --dry-run too) judges the stack as every stage's rendering will."""
    seed = str(ROOT / "inventory/dgx.ini")  # H100 with seed-2024: megatron-core 0.8.0
    run_dir = tmp_path / "r1"
    for extra in (["--dry-run"], ["--run-dir", str(run_dir)]):
        res = _cli("rollout", "run", "-i", seed, "-m", "step-3.5-flash-slice-ep2", *extra)
        assert _exit(res) == 2 and isinstance(res.exception, BadInput), res.output
        assert "megatron-core 0.8.0" in res.exception.message and "hopper-cu128" in (res.exception.hint or "")
    assert not run_dir.exists()
    hgx = str(ROOT / "inventory/examples/hgx-h100-pair.ini")
    assert _cli("rollout", "run", "-i", hgx, "-m", "step-3.5-flash-slice-ep2", "--dry-run").exit_code == 0
    cpu = _inventory(tmp_path, SIM_INI.format(profile="sim-standin"))
    assert _cli("rollout", "run", "-i", cpu, "-m", "tiny-moe", "--dry-run").exit_code == 0


def test_the_default_rollout_name_fits_for_every_catalog_model() -> None:
    """`rollout run` without --run-dir names the run MODEL-STAMP: step-3.5-flash-slice-1gpu's name used to make it
    41 characters, refused by the run-name rule before anything ran."""
    import time

    from stepdeploy.cli.rollout_checks import MAX_RUN_NAME, check_run_name, default_run_name

    when = time.gmtime(0)
    for model in model_names():
        name = default_run_name(model, when)
        check_run_name(name)
        assert len(name) <= MAX_RUN_NAME and name.endswith("-19700101T000000Z")
        assert model.startswith(name.removesuffix("-19700101T000000Z"))
    assert default_run_name("tiny-moe", when) == "tiny-moe-19700101T000000Z"


def test_an_aarch64_node_is_offered_only_aarch64_profiles(tmp_path: Path) -> None:
    spark = load_cluster(ROOT / "inventory/examples/dgx-spark-pair.yml")
    seed = spark.model_copy(update={"profile": get_profile("seed-2024")})
    found = compat.stack_verdict(seed, load_model("tiny-dense"))
    assert not found.ok and found.working_profiles == ("spark-cuda13",)
    assert "CPU architecture" in {c.component for c in found.conflicts}


def test_megatron_core_0_8_is_refused_for_the_megatron_engine_naming_what_it_lacks() -> None:
    dgx = load_cluster(ROOT / "inventory/dgx.ini")  # H100, seed-2024: the hardware rules pass
    found = compat.stack_verdict(dgx, load_model("tiny-dense"))
    assert not found.ok and {c.component for c in found.conflicts} == {"megatron-core"}
    text = found.one_line()
    for api in ("get_gpt_decoder_block_spec", "GPTModel(mtp_block_spec=)", "HybridDeviceOptimizer", "vp_stage="):
        assert api in text, api
    assert "github.com/NVIDIA/Megatron-LM/blob/core_v0.13.0" in text and found.working_profiles[0] == "hopper-cu128"
    assert compat.engine_api_level() == compat.Version("0.13.0")
    at = {v: dgx.model_copy(update={"profile": get_profile("hopper-cu128").model_copy(update={"megatron_core": v})})
          for v in ("0.12.3", "0.13.0")}
    lacking = compat.stack_verdict(at["0.12.3"], load_model("tiny-dense")).conflicts
    assert [c.required.split(" for ")[0] for c in lacking] == [">= 0.13.0"]
    assert compat.stack_verdict(at["0.13.0"], load_model("tiny-dense")).ok
    with pytest.raises(BadInput, match="HybridDeviceOptimizer"):
        build_run(dgx, load_model("tiny-dense"), None, RenderOptions(run_id="r"))


def test_a_torch_without_flex_attention_is_refused_by_plan_for_sliding_windows(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    hgx = load_cluster(ROOT / "inventory/examples/hgx-h100-pair.ini")
    old = get_profile("hopper-cu128").model_copy(update={"name": "old-torch", "torch": "2.3.1"})
    monkeypatch.setattr("stepdeploy.cli.plan.load_cluster", lambda _path: hgx.model_copy(update={"profile": old}))
    res = _cli("plan", "-m", "step-3.5-flash-slice-1gpu", "-i", "any.ini")
    assert _exit(res) == 2 and isinstance(res.exception, BadInput), res.output
    assert "PyTorch 2.3.1 — needs >= 2.5 for sliding-window attention" in res.exception.message
    assert "flex_attention" in res.exception.message and "hopper-cu128" in (res.exception.hint or "")
    assert _cli("plan", "-m", "tiny-dense", "-i", "any.ini").exit_code == 0  # no windows: torch 2.3.1 is fine


def test_context_parallel_needs_transformer_engine_in_the_profile() -> None:
    hgx = load_cluster(ROOT / "inventory/examples/hgx-h100-pair.ini")
    found = compat.stack_verdict(hgx, load_model("tiny-dense"), Layout(cp=2))
    assert [c.component for c in found.conflicts] == ["TransformerEngine"]
    assert compat.stack_verdict(hgx, load_model("tiny-dense"), Layout(tp=2)).ok


@pytest.mark.parametrize("profile", ["sim-cpu", "sim-standin"])
def test_cpu_inventories_and_the_torch_engine_are_unaffected(tmp_path: Path, profile: str) -> None:
    inv = _inventory(tmp_path, SIM_INI.format(profile=profile))
    found = compat.stack_verdict(load_cluster(inv), load_model("tiny-dense"))
    assert found.ok and found.subject.startswith("tiny-dense with the torch engine")
    res = _cli("render", "-m", "tiny-moe", "-i", inv, "--out", str(tmp_path / "r"), "--dry-run")
    assert res.exit_code == 0, res.output
    no_profile = load_cluster(ROOT / "inventory/dgx.ini").model_copy(update={"profile": None})
    assert compat.stack_verdict(no_profile, load_model("step-3.5-flash")).ok  # nothing named: nothing judged


def _listed(model: str, inventory: str) -> tuple[int, list[Layout]]:
    """plan's exit code and the top layouts it lists as fitting (its --json)."""
    res = _cli("plan", "-m", model, "-i", str(ROOT / inventory), "--top", str(TOP), "--json")
    if _exit(res) == 2:
        return 2, []
    data = json.loads(res.stdout)
    return res.exit_code, [Layout(**{k: v for k, v in row["layout"].items() if k in LAYOUT_FIELDS})
                           for row in data["fitting"]]


@pytest.mark.parametrize("inventory", INVENTORIES)
def test_every_layout_plan_lists_renders_and_can_run(inventory: str) -> None:
    """Every catalog model x this shipped inventory x plan's top layouts: 0 refused by render, 0 rendered for a
    stack that cannot run them; a stack plan refuses (exit 2, nothing listed), render refuses alike."""
    cluster = load_cluster(ROOT / inventory)
    refused, cannot_run, stack_refused = [], [], []
    for model in model_names():
        spec = load_model(model)
        code, layouts = _listed(model, inventory)
        if code == 2:
            stack_refused.append(model)
            with pytest.raises(BadInput, match="cannot run"):
                build_run(cluster, spec, None, RenderOptions(run_id="prop"))
            continue
        for layout in layouts:
            opts = RenderOptions(run_id="prop")
            try:
                rendered = render_run(cluster, spec, layout, opts, inputs={}, created="t",
                                      version="0", workload_sources={})
            except BadInput as exc:
                refused.append(f"{model} {layout.short()}: {exc.message}")
                continue
            engine = rendered.workload["engine"]
            verdict = compat.stack_verdict(cluster, spec, layout, engine=engine)
            why = engines.refusal(engine, engines.settle(engine, layout), spec) if engine == "megatron" else None
            if not verdict.ok or why:
                cannot_run.append(f"{model} {layout.short()}: {why or verdict.one_line()}")
    assert refused == [] and cannot_run == [], (refused, cannot_run)
    shipped = cluster.profile.name if cluster.profile else None
    assert (stack_refused == model_names()) is (shipped == "seed-2024"), stack_refused
