"""The probe: one POSIX shell script run on every node, printing each command's output as a section.

One script means one SSH round trip per node. Every command runs under `timeout`, so one hung tool
(an nvidia-smi stuck on a broken GPU) fails its own check instead of the whole node. Pure: building the
script and splitting its output touch nothing.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from stepdeploy.preflight.model import Section
from stepdeploy.remote import sections

MARK = "@@stepdeploy-preflight@@"
DEFAULT_PYTHONS = ("/opt/stepdeploy/venv/bin/python", "python3")

# What the python section prints: the versions the training stack needs, as one JSON object. A package that is
# not installed is None (a fact, not an error: TransformerEngine is needed only by layouts that use it).
PYTHON_ENV = r"""
import json, platform, sys
from importlib import metadata
out = {"python": platform.python_version(), "executable": sys.executable}
def version(*names):
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None
def importable(module):
    try:
        __import__(module)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["cuda_devices"] = torch.cuda.device_count() if out["cuda_available"] else 0
    try:
        out["torch_nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:
        out["torch_nccl"] = None
except Exception as exc:
    out["torch"] = None
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
out["megatron_core"] = version("megatron-core", "megatron_core")
if out["megatron_core"]:
    out["megatron_core_error"] = importable("megatron.core")
out["flash_attn"] = version("flash-attn", "flash_attn", "flash-attn-3", "flash_attn_3", "flash-attn-4")
if out["flash_attn"]:
    out["flash_attn_error"] = importable("flash_attn") if version("flash-attn", "flash_attn") else None
out["transformer_engine"] = version("transformer-engine", "transformer_engine", "transformer-engine-torch",
                                   "transformer_engine_torch")
if out["transformer_engine"]:
    out["transformer_engine_error"] = importable("transformer_engine.pytorch")
print(json.dumps(out))
"""

IB_PORTS = r"""
for p in /sys/class/infiniband/*/ports/*; do
  [ -d "$p" ] || continue
  dev=$(basename "$(dirname "$(dirname "$p")")")
  nd=$(ls "/sys/class/infiniband/$dev/device/net" 2>/dev/null | head -n1)
  mtu=$( [ -n "$nd" ] && cat "/sys/class/net/$nd/mtu" 2>/dev/null)
  gid=$(cat "$p/gids/3" 2>/dev/null)
  layer=$(cat "$p/link_layer" 2>/dev/null)
  echo "$dev|$(basename "$p")|$(cat "$p/state")|$(cat "$p/rate")|$layer|${nd:--}|${mtu:--}|${gid:--}"
done
"""


@dataclass(frozen=True)
class PreflightProbeSpec:
    """What a node is asked. `pythons`: interpreters tried in order (the first that exists is used)."""

    train_iface: str | None = None
    checkpoint_dir: str = "/"
    pythons: tuple[str, ...] = DEFAULT_PYTHONS
    section_timeout_s: int = 30


def python_command(pythons: tuple[str, ...]) -> str:
    """The python section's command: PYTHON_ENV's JSON from the first of `pythons` that exists (the rollout runs it
    with the rendered run's own interpreter before a launch whose layout needs more than the stock stack)."""
    pick_python = " ".join(shlex.quote(p) for p in pythons)
    return (f"for p in {pick_python}; do if command -v \"$p\" >/dev/null 2>&1; then "
            f"exec \"$p\" -I -c {shlex.quote(PYTHON_ENV)}; fi; done; echo 'no python found'; exit 127")


def commands(spec: PreflightProbeSpec) -> dict[str, str]:
    """Section name -> POSIX shell command."""
    iface = shlex.quote(spec.train_iface or "")
    ckpt = shlex.quote(spec.checkpoint_dir)
    return {
        "uname": "uname -s -r -m",
        "os_release": "cat /etc/os-release",
        "nvidia_smi": "nvidia-smi -q -x",
        "nvidia_topo": "nvidia-smi topo -m",
        "nccl_pkg": "dpkg-query -W -f='${Package} ${Version}\\n' 'libnccl2*' 2>/dev/null || true",
        "python": python_command(spec.pythons),
        "modules": "cat /proc/modules",
        "memlock": "ulimit -l",
        "shm": "df -P -k /dev/shm",
        "disk": f"d={ckpt}; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; echo \"$d\"; df -P -k \"$d\"",
        "ib_ports": IB_PORTS,
        "iface": (f"i={iface}; [ -n \"$i\" ] || exit 0; cat /sys/class/net/$i/mtu && ip -o -4 addr show dev $i"
                  if spec.train_iface else "true"),
        "kernel_log": ("if log=$(dmesg 2>/dev/null); then printf '%s\\n' \"$log\" | grep -E 'NVRM: Xid' "
                       "| tail -n 200; exit 0; fi; echo 'cannot read the kernel log (dmesg)'; exit 3"),
    }


def script(spec: PreflightProbeSpec) -> str:
    """The whole probe: every section framed by markers, each under its own timeout."""
    return sections.script(MARK, commands(spec), spec.section_timeout_s)


def remote_command(spec: PreflightProbeSpec) -> str:
    """A one-line command that runs the probe under sh wherever the login shell is (no quoting issues)."""
    return sections.remote_command(script(spec))


def split(output: str) -> dict[str, Section]:
    """Probe output -> {section: Section}. A section cut off (the node died mid-probe) is absent."""
    return {name: Section(rc=rc, text=text) for name, (rc, text) in sections.split(MARK, output).items()}
