"""The upload of a rendered run directory to a node (NodeExecutor.prepare runs it on every node in parallel).

check    one command: does the node's run directory hold this rendering already (its manifest.json, which names
         every rendered file with its sha256, equal to ours, under a parent no other user can write)? A soak's
         restart finds it there and uploads nothing: the tarball (the dataset and the fetched logs included) is
         not packed, sent, unpacked and checked again for the same files on every restart.
upload   the run directory as one tarball, unpacked beside the target, every file's sha256 checked, renamed into
         place: a node has the whole run directory or none of it. A run directory already there is kept when its
         manifest is the same and refused when it is another rendering.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from collections.abc import Callable
from pathlib import Path

from stepdeploy.remote.executor import NodeResult, Target
from stepdeploy.remote.transport import Ran
from stepdeploy.render.manifest import MANIFEST_FILE

q = shlex.quote
THERE = "this rendering is there already"
Shell = Callable[[str], Ran]  # runs one command on the node


def manifest_digest(local_run: Path) -> str:
    return hashlib.sha256((local_run / MANIFEST_FILE).read_bytes()).hexdigest()


def _shared(parent: str) -> str:
    """A test that holds when `parent` is writable by every user. -H: a parent that is a link
    (/var/lib/stepdeploy/runs -> /dev/shm/...) is judged by the directory it names."""
    return f"test -n \"$(find -H {q(parent)} -maxdepth 0 -perm -0002)\""


def check(sh: Shell, node: str, run_dir: str, digest: str) -> NodeResult:
    """The node answers (ok), saying THERE when its run directory holds the rendering whose manifest has `digest`."""
    parent, manifest = str(Path(run_dir).parent), f"{run_dir}/{MANIFEST_FILE}"
    ran = sh(f"if [ -d {q(parent)} ] && ! {_shared(parent)} && [ -f {q(manifest)} ]; then "
             f"sha256sum < {q(manifest)}; fi")
    if not ran.ok:
        return NodeResult(node, False, f"exited {ran.rc}: {ran.stderr.strip()[:200]}")
    there = ran.stdout.split()[:1] == [digest]
    return NodeResult(node, True, THERE if there else "")


def upload(sh: Shell, target: Target, run_dir: str, payload: bytes, tag: str) -> NodeResult:
    parent = str(Path(run_dir).parent)
    staging, tarball = f"{run_dir}.staging-{tag}", f"{run_dir}.upload-{tag}.tar.gz"
    # The names below are predictable: only a parent no other user can write keeps them ours (a shared
    # /tmp would let anyone plant a link the upload follows, or files the ranks import as root).
    made = sh(f"mkdir -p -- {q(parent)} && ! {_shared(parent)}")
    if not made.ok:
        return NodeResult(target.name, False, f"{parent} is missing or writable by every user; render with a "
                                              "--remote-dir only root can write (default /var/lib/stepdeploy/runs)")
    target.channel.put(payload, tarball)
    run, stage = q(run_dir), q(staging)
    script = (
        f"set -e; rm -rf -- {stage}; mkdir -p -- {stage}; tar -xzf {q(tarball)} -C {stage}; "
        f"rm -f -- {q(tarball)}; (cd -- {stage} && sha256sum --quiet -c .sha256sums); "
        f"if [ -e {run} ]; then same=0; cmp -s {run}/manifest.json {stage}/manifest.json || same=17; "
        f"rm -rf -- {stage}; exit $same; fi; "
        f"mv -T -- {stage} {run}"
    )
    res = sh(script)
    if res.rc == 17:
        return NodeResult(target.name, False, f"{run_dir} already holds another rendering; use a new run id")
    return NodeResult(target.name, res.ok, "uploaded" if res.ok else res.stderr.strip()[-500:])


def tarball(local_run: Path) -> bytes:
    """The run directory as a .tar.gz, with .sha256sums of every file for the node to check."""
    sums, buffer = [], io.BytesIO()
    files = sorted(p for p in local_run.rglob("*") if p.is_file())
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in files:
            rel = path.relative_to(local_run).as_posix()
            sums.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}")
            archive.add(path, rel)
        data = ("\n".join(sums) + "\n").encode()
        info = tarfile.TarInfo(".sha256sums")
        info.size, info.mode = len(data), 0o644
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
