"""`--checkpoint-interval auto` and `--mtbf` through the CLI (parsing, the dry run), the config's round trip, the
soak's resolution from measured saves (recorded as an event, rendered with) and its goodput event."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from stepdeploy.cli.app import main
from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.plan import checkpoint
from stepdeploy.rollout import checkpoint_interval
from stepdeploy.rollout.config import AUTO, RolloutConfig
from stepdeploy.rollout.service import AttemptService
from stepdeploy.rollout.stages.soak import SoakSchedule, _record_goodput, _save_interval

CPU_PAIR = "[g]\nnode1 ansible_host=10.90.0.11\nnode2 ansible_host=10.90.0.12\n[g:vars]\nstepdeploy_gpus_per_node=0\n"
TINY_DENSE_PARAMS = 7_096_576


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return int(exit_info.value.code or 0), captured.out, captured.err


def _rollout(tmp_path: Path, *args: str) -> list[str]:
    (tmp_path / "inv.ini").write_text(CPU_PAIR)
    return ["rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", "tiny-dense", "--stages", "soak",
            "--run-dir", str(tmp_path / "r"), *args]


@pytest.mark.parametrize(("args", "message"), [
    (("--checkpoint-interval", "often"), "error: --checkpoint-interval 'often' is neither a number of iterations "
                                         "nor auto"),
    (("--checkpoint-interval", "0"), "error: --checkpoint-interval 0 must be at least 1 (or auto)"),
    (("--checkpoint-interval", "auto", "--mtbf", "6 hours"), "error: --mtbf duration '6 hours' is not like 90s"),
    (("--checkpoint-interval", "auto", "--mtbf", "0s"), "error: --mtbf must be longer than 0 s"),
    (("--mtbf", "6h"), "error: --mtbf is what --checkpoint-interval auto computes the interval from"),
])
def test_bad_values_exit_2_with_the_reason_and_write_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             args: tuple[str, ...], message: str) -> None:
    code, out, err = _cli(capsys, *_rollout(tmp_path, *args))
    assert code == 2 and out == ""
    assert err.startswith(message) and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_an_integer_interval_is_shown_as_before(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _cli(capsys, *_rollout(tmp_path, "--dry-run"))
    assert code == 0 and json.loads(out)["soak"]["checkpoint_interval"] == 20
    code, out, _ = _cli(capsys, *_rollout(tmp_path, "--checkpoint-interval", "7", "--dry-run"))
    soak = json.loads(out)["soak"]
    assert soak["checkpoint_interval"] == 7 and "checkpoint_interval_auto" not in soak


def test_the_dry_run_resolves_auto_from_the_planner_and_llama3s_rate(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    code, out, _ = _cli(capsys, *_rollout(tmp_path, "--checkpoint-interval", "auto", "--soak-duration", "1h",
                                          "--dry-run"))
    assert code == 0
    soak = json.loads(out)["soak"]
    auto = soak["checkpoint_interval_auto"]
    # CPU nodes: the torch engine writes 12 B per parameter on every node, at 0.8 GB/s
    save_s = TINY_DENSE_PARAMS * 12 / 0.8e9
    mtbf = 54 * 86400 * 16384 / 419 / 2  # two CPU nodes count as two GPUs
    assert auto["save_s"] == pytest.approx(save_s) and auto["save_source"].startswith("estimated: 0.0852 GB per node")
    assert (auto["gpus"], auto["mtbf_s"], auto["step_s"]) == (2, pytest.approx(mtbf), 1.0)
    assert auto["step_source"].startswith("assumed (1.0 s: no warm-up measured; CPU nodes: no plan)")
    assert soak["checkpoint_interval"] == auto["iterations"] == round(checkpoint.daly_interval_s(save_s, mtbf))
    assert auto["warning"].startswith("the interval is longer than the soak's ~3,600 iterations")
    assert "resolved again when the soak starts" in auto["note"] and "Llama 3" in auto["describe"]
    code, out, _ = _cli(capsys, *_rollout(tmp_path, "--checkpoint-interval", "AUTO", "--mtbf", "10m", "--dry-run"))
    auto = json.loads(out)["soak"]["checkpoint_interval_auto"]
    assert (auto["mtbf_s"], auto["mtbf_source"], auto["warning"]) == (600.0, "given (--mtbf)", None)
    assert auto["iterations"] == round(checkpoint.daly_interval_s(save_s, 600.0))  # 11 s at 1 s a step


def test_the_config_round_trips_through_the_ledger_json() -> None:
    config = RolloutConfig(inventory="i", model="m", stages=("soak",), checkpoint_interval=AUTO, mtbf_s=21600.0)
    assert RolloutConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    plain = RolloutConfig(inventory="i", model="m", stages=("soak",), checkpoint_interval=5)
    assert RolloutConfig.from_json(json.loads(json.dumps(plain.to_json()))) == plain
    older = {k: v for k, v in plain.to_json().items() if k != "mtbf_s"}  # a ledger written before --mtbf
    assert RolloutConfig.from_json(older).mtbf_s is None


def _soak_rollout(tmp_path: Path, interval: int | str) -> AttemptService:
    (tmp_path / "inv.ini").write_text(CPU_PAIR)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.create_run("r", {}, ["warmup", "soak"])
    config = RolloutConfig(inventory=str(tmp_path / "inv.ini"), model="tiny-dense", stages=("warmup", "soak"),
                           checkpoint_interval=interval)
    return AttemptService(tmp_path, ledger, "r", config, load_cluster(config.inventory))


def _fetched(run: Path, name: str, lines: list[dict]) -> None:
    out = run / "fetched" / "nodes" / "0-node1" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_auto_takes_the_save_stall_the_warmup_measured(tmp_path: Path) -> None:
    r = _soak_rollout(tmp_path, AUTO)
    warmup = tmp_path / "attempts" / "warmup-target-a1"
    _fetched(warmup, "phases.jsonl", [{"phase": "start", "time": 1.0, "pid": 3},
                                      {"phase": "save", "time": 10.5, "pid": 3, "iteration": 10, "began": 10.0},
                                      {"phase": "save", "time": 21.0, "pid": 3, "iteration": 20, "began": 20.0},
                                      {"phase": "save", "time": 33.0, "pid": 3, "iteration": 30, "began": 30.0}])
    proxy = tmp_path / "attempts" / "scale-proxy-a1"
    _fetched(proxy, "phases.jsonl", [{"phase": "save", "time": 100.0, "pid": 4, "iteration": 5, "began": 0.0}])
    r.ledger.start_attempt("r", "warmup", "target", {"local_run": str(warmup), "rung": {"model": "tiny-dense"}})
    r.ledger.start_attempt("r", "scale", "proxy", {"local_run": str(proxy), "rung": {"model": "other"}})
    schedule = SoakSchedule(0.5, "measured in the warm-up", 7200, 360, 7200)
    interval = _save_interval(r, schedule)
    mtbf = checkpoint.GPU_MTBF_S / 2
    assert interval == round(checkpoint.daly_interval_s(1.0, mtbf) / 0.5)  # the median save: 1.0 s; 0.5 s a step
    (event,) = [e for e in r.ledger.events("r") if e["kind"] == "checkpoint"]
    assert event["data"]["iterations"] == interval and event["data"]["save_s"] == 1.0
    assert event["data"]["save_source"] == "measured: the median of 3 save(s) of the target so far"
    assert event["stage"] == "soak" and event["message"].startswith("checkpoint interval (auto): every ")
    assert "longer than the soak's ~7,200 iterations" in event["message"]


def test_an_integer_interval_is_rendered_as_given_without_an_event(tmp_path: Path) -> None:
    r = _soak_rollout(tmp_path, 20)
    assert _save_interval(r, SoakSchedule(0.5, "assumed", 100, 5, 100)) == 20
    assert [e for e in r.ledger.events("r") if e["kind"] == "checkpoint"] == []


def test_without_a_measurement_auto_estimates_the_save() -> None:
    cluster = SimpleNamespace(nodes=[SimpleNamespace(gpus_per_node=8)] * 2)
    save_s, source = checkpoint_interval.estimated_save(cluster, "step-3.5-flash-slice-1gpu")
    assert save_s == pytest.approx(3_437_421_824 * 14 / 2 / 0.8e9)  # megatron: the nodes share one copy
    assert source.startswith("estimated: 24.1 GB per node, the planner's checkpoint size at 0.8 GB/s")


def test_the_soak_records_its_goodput_from_the_fetched_files(tmp_path: Path) -> None:
    r = _soak_rollout(tmp_path, 3)
    local = tmp_path / "attempts" / "soak-target"
    attempt = r.ledger.start_attempt("r", "soak", "target", {"local_run": str(local)})
    started = r.ledger.attempts("r", "soak")[0]["started"]
    _fetched(local, "metrics.jsonl", [{"iteration": 1, "step_time_s": 0.5, "time": started + 3.0},
                                      {"iteration": 2, "step_time_s": 0.5, "time": started + 3.5}])
    _fetched(local, "phases.jsonl", [{"phase": "start", "time": started + 1.0, "pid": 5},
                                     {"phase": "first_step", "time": started + 3.0, "pid": 5, "iteration": 1,
                                      "step_s": 0.5}])
    r.ledger.finish_attempt(attempt, "passed")
    _record_goodput(r, local, started - 1.0)
    (event,) = [e for e in r.ledger.events("r") if e["kind"] == "goodput"]
    assert event["stage"] == "soak" and event["message"].startswith("goodput ")
    data = event["data"]
    assert (data["productive_s"], data["iterations"], data["started"]) == (1.0, 2, started - 1.0)
    assert data["starts"][0]["parts"]["launch"] == 2.0  # the soak's start to the process start
    assert data["ended"] >= started and data["wall_s"] == data["ended"] - data["started"]


def test_no_attempt_no_goodput(tmp_path: Path) -> None:
    r = _soak_rollout(tmp_path, 3)
    _record_goodput(r, tmp_path / "nowhere", 0.0)
    assert [e for e in r.ledger.events("r") if e["kind"] == "goodput"] == []


def test_the_dry_run_lists_the_gates_each_rung_and_the_soak_will_get(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    (tmp_path / "inv.ini").write_text("[g]\nh200 ansible_host=192.0.2.9\n[g:vars]\nstepdeploy_gpus_per_node=1\n"
                                      "stepdeploy_gpu_model=H200\n")
    code, out, _ = _cli(capsys, "rollout", "run", "-i", str(tmp_path / "inv.ini"), "-m", "step-3.5-flash-slice-1gpu",
                        "--run-dir", str(tmp_path / "r"), "--max-step-time", "5", "--dry-run")
    plan = json.loads(out)
    assert code == 0
    scale = {r["rung"]: r["gates"] for r in plan["scale"] if r["skip_reason"] is None}
    # the MoE proxy is judged as scaling; the target, another model, by its MFU against the plan
    assert scale == {"proxy-1-gpu": ["completed", "loss_finite", "loss_falling", "scaling_efficiency",
                                     "memory_vs_plan", "step_time"],
                     "target-all-nodes": ["completed", "loss_finite", "loss_falling", "mfu_vs_plan",
                                          "memory_vs_plan", "step_time"]}
    assert plan["soak"]["gates"] == ["no_unrecovered_failure", "loss_finite", "loss_trend", "loss_spikes",
                                     "grad_norm", "expert_load", "tokens_dropped", "router_bias"]
    code, out, _ = _cli(capsys, *_rollout(tmp_path, "--dry-run"))
    assert json.loads(out)["soak"]["gates"][2:] == ["loss_trend", "loss_spikes", "grad_norm"]  # dense: no MoE gates
