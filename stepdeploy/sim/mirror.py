"""Real Debian packages the provisioning roles install on simulated nodes, with their dependency closure.

Nodes reach nothing but the local repository, so every package a role installs (chrony, rdma-core, ...) and
every dependency the node base image lacks must be in it. `apt-get install --download-only` resolves that
closure against the base image's own dpkg status, with a private apt configuration (sources, lists, cache)
pointed at the Debian mirror and suite the base was bootstrapped from: nothing of the host's apt state is
read or changed, and the result is exactly what a node would fetch. Cached under
/var/cache/stepdeploy/debs-<hash> (built in a temporary directory, renamed into place when complete).
The same directory is an air-gapped mirror's worth of these packages for real nodes of that suite.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from stepdeploy.sim import base, host

# What the roles install from the distribution (common, infiniband, slurm). Debian and Ubuntu use these names.
ROLE_PACKAGES: tuple[str, ...] = (
    "chrony", "pciutils", "numactl",                                  # common
    "rdma-core", "ibverbs-utils", "infiniband-diags", "perftest",     # infiniband
    "munge", "slurmctld", "slurmd", "slurm-client",                   # slurm
)
_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
_DONE = ".stepdeploy-debs.json"


def debs_dir(base_path: Path, packages: tuple[str, ...], suite: str) -> Path:
    """The cache directory for this package set resolved against this base image."""
    blob = json.dumps({"base": base_path.name, "packages": sorted(packages), "suite": suite}).encode()
    return base.cache_root() / f"debs-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure_debs(base_path: Path, packages: tuple[str, ...] = ROLE_PACKAGES, *, suite: str = "bookworm",
                mirror: str | None = None) -> list[Path]:
    """The .deb files of `packages` plus every dependency `base_path`'s dpkg status lacks (downloaded once)."""
    target = debs_dir(base_path, packages, suite)
    if (target / _DONE).exists():
        return sorted(target.glob("*.deb"))
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        archives = work / "debs"
        _download(base_path, packages, suite, mirror or host.apt_mirror(), work, archives)
        (archives / _DONE).write_text(json.dumps({"packages": list(packages), "suite": suite}) + "\n")
        if not target.exists():
            archives.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(target.glob("*.deb"))


def apt_options(base_path: Path, work: Path, archives: Path) -> list[str]:
    """A private apt configuration: our sources and lists, the base image's dpkg status, our archive dir."""
    opts = {
        "Dir::Etc::SourceList": work / "sources.list",
        "Dir::Etc::SourceParts": work / "empty",
        "Dir::Etc::Preferences": work / "empty/preferences",
        "Dir::Etc::PreferencesParts": work / "empty",
        "Dir::State": work / "state",
        "Dir::State::status": base_path / "var/lib/dpkg/status",
        "Dir::Cache": work / "cache",
        "Dir::Cache::archives": archives,
        "APT::Install-Recommends": "false",
        "APT::Install-Suggests": "false",
        "APT::Sandbox::User": "root",  # the private directories are root's; _apt could not write them
        "Debug::NoLocking": "true",
    }
    return [a for key, value in opts.items() for a in ("-o", f"{key}={value}")]


def _download(base_path: Path, packages: tuple[str, ...], suite: str, mirror: str, work: Path,
              archives: Path) -> None:
    for sub in ("empty", "state/lists/partial", "cache", "debs/partial"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    signed = f"[signed-by={_KEYRING}] " if _KEYRING.exists() else ""
    (work / "sources.list").write_text(f"deb {signed}{mirror} {suite} main\n")
    opts = apt_options(base_path, work, archives)
    env = {**host.NODE_ENV, "DEBIAN_FRONTEND": "noninteractive"}
    host.run(["apt-get", *opts, "update"], env=env, timeout=600)
    host.run(["apt-get", *opts, "install", "--download-only", "--yes", *packages], env=env, timeout=1200)
    shutil.rmtree(archives / "partial", ignore_errors=True)
    (archives / "lock").unlink(missing_ok=True)
