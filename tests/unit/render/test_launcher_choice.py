"""Which launcher launch.sh runs: stepdeploy's launch_ranks.py for the static rendezvous, under every executor
(Slurm included: it records its node's first failure for the controller, render/options.py says why), torchrun for
what only it does (a c10d rendezvous, restarting its own workers)."""

from __future__ import annotations

import pytest

from stepdeploy.plan.layout import Layout
from stepdeploy.render import RenderOptions

from .cases import cpu_nodes, render


def launch_script(**options: object) -> str:
    opts = RenderOptions(run_id="launcher-1", iterations=2, seq_length=16, global_batch_size=2, **options)
    rendered = render(cpu_nodes(), "tiny-dense", Layout(), opts)
    return next(f.text for f in rendered.files if f.path.endswith("/launch.sh") and "0-node1" in f.path)


def test_the_static_rendezvous_starts_the_ranks_without_torchrun() -> None:
    text = launch_script()
    assert '-I "$run_dir/workload/launch_ranks.py"' in text
    assert "torch.distributed.run" not in text
    assert "--node-rank=0" in text and "--master-addr=10.83.0.11" in text and "--master-port=29500" in text
    # where the launcher records what it saw: the status files the workload writes (--out-dir "$run_dir/out")
    assert '--status-dir="$run_dir/out/status"' in text and '--out-dir "$run_dir/out"' in text


@pytest.mark.parametrize(("options", "flag"), [({"rendezvous": "c10d"}, "--rdzv-backend=c10d"),
                                               ({"max_restarts": 2}, "--max-restarts=2")])
def test_torchrun_stays_for_what_only_it_does(options: dict[str, object], flag: str) -> None:
    text = launch_script(**options)
    assert "-m torch.distributed.run" in text and flag in text
    assert "launch_ranks.py" not in text


@pytest.mark.parametrize("executor", ["slurm", "fabric", "local"])
def test_every_executor_uses_launch_ranks(executor: str) -> None:
    text = launch_script(executor=executor)
    assert '-I "$run_dir/workload/launch_ranks.py"' in text and '--status-dir="$run_dir/out/status"' in text
    assert "torch.distributed.run" not in text


def test_slurm_keeps_torchrun_only_for_what_only_it_does() -> None:
    assert "--rdzv-backend=c10d" in launch_script(executor="slurm", rendezvous="c10d")
