#!/usr/bin/env bash
# Makes the H200 machine (a bare GPU box: no sshd, no stepdeploy, nothing reachable outside it) look like a node
# that `stepdeploy provision` has set up, reachable over SSH on 127.0.0.1, so that `stepdeploy rollout run`
# drives it exactly as it drives a cluster node. Until stepdeploy has a local executor this is the only way to
# run the product itself there (shared/FACTS.md).
#
#   bash bench/gpu_node.sh DEBS WHEELS STATE      # then: source STATE/env.sh; stepdeploy ... -i STATE/inventory.ini
#   SSHD_ONLY=1 bash bench/gpu_node.sh DEBS - STATE   # only the sshd, known_hosts and inventory (tried on Debian 12)
#
# DEBS:   Debian bookworm's openssh-server and the libraries it needs there (apt-get download, see
#         docs/benchmarks-log.md), unpacked with dpkg -x into STATE/root -- nothing is installed into the system.
# WHEELS: stepdeploy's controller dependencies for the machine's Python (pip download --python-version 3.12)
#         and megatron-core.
# STATE:  a new private directory (0700): the sshd tree, its host key, our client key, known_hosts, the inventory.
#
# What it sets up, as the provisioning roles would on a node:
# - /opt/stepdeploy/venv: the machine's own Python venv (torch is there), with megatron-core (python_env role);
# - /var/lib/stepdeploy/runs, the rendered runs' remote directory, as a link to /dev/shm/stepdeploy-runs: the
#   box's 64 GB disk writes ~1.5 GB/s (FACTS) and would hold one checkpoint of the 3.4B-parameter slice (48 GB with
#   its optimizer state) at most; in memory a save takes seconds (the runs record where their checkpoints were);
# - sshd on 127.0.0.1:2222 with its own host key, key authentication only, PAM off, an sftp subsystem, and the
#   NVLink-multicast switches (NCCL_NVLS_ENABLE=0 ...) in every session's environment.
set -euo pipefail
debs=$1 wheels=$2 state=$3
port=${STEPDEPLOY_NODE_PORT:-2222}
umask 077
mkdir -p "$state" && chmod 700 "$state"
state=$(cd "$state" && pwd)

if [ -z "${SSHD_ONLY:-}" ]; then
# controller: stepdeploy's dependencies (the repository itself is the package: PYTHONPATH)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$state/site" \
    "$wheels"/*.whl
# node: the python_env role's venv is the machine's own one (it holds torch; a --system-site-packages venv on top of
# it would see the base interpreter's packages, not torch)
mkdir -p /opt/stepdeploy
[ -e /opt/stepdeploy/venv ] || ln -s "$(python3 -c 'import sys; print(sys.prefix)')" /opt/stepdeploy/venv
/opt/stepdeploy/venv/bin/python -m pip install -q --no-index --no-deps --no-cache-dir "$wheels"/megatron_core-*.whl
mkdir -p /dev/shm/stepdeploy-runs /var/lib/stepdeploy
[ -e /var/lib/stepdeploy/runs ] || ln -s /dev/shm/stepdeploy-runs /var/lib/stepdeploy/runs
fi

# sshd from the unpacked packages
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$state/root"; done
libs="$state/root/usr/lib/x86_64-linux-gnu:$state/root/lib/x86_64-linux-gnu"
id sshd >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /run/sshd --shell /usr/sbin/nologin sshd
mkdir -p /run/sshd && chmod 755 /run/sshd
# ed25519 keys in OpenSSH format (the box has no ssh-keygen: the python cryptography package writes them)
PYTHONPATH=$state/site${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python3}" - "$state" <<'PY'
import os, sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
for name in ("host_key", "client_key"):
    key = Ed25519PrivateKey.generate()
    path = os.path.join(sys.argv[1], name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                  serialization.NoEncryption()))
    with open(path + ".pub", "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                + b" " + name.encode() + b"\n")
PY
mkdir -p /root/.ssh && chmod 700 /root/.ssh
grep -qxF "$(cat "$state/client_key.pub")" /root/.ssh/authorized_keys 2>/dev/null || cat "$state/client_key.pub" >> /root/.ssh/authorized_keys; chmod 600 /root/.ssh/authorized_keys
cat > "$state/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $state/host_key
PidFile $state/sshd.pid
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AuthorizedKeysFile /root/.ssh/authorized_keys
Subsystem sftp internal-sftp
SetEnv NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF
LD_LIBRARY_PATH=$libs "$state/root/usr/sbin/sshd" -t -f "$state/sshd_config"
LD_LIBRARY_PATH=$libs "$state/root/usr/sbin/sshd" -f "$state/sshd_config" -E "$state/sshd.log"
echo "[127.0.0.1]:$port $(cut -d' ' -f1,2 "$state/host_key.pub")" > "$state/known_hosts"

# shellcheck source=bench/gpu_box.sh
source "$(dirname "$0")/gpu_box.sh"
model=$(gpu_box_model)
cat > "$state/inventory.ini" <<EOF
[gpu]
h200 ansible_host=127.0.0.1 ansible_port=$port

[gpu:vars]
ansible_user=root
ansible_ssh_private_key_file=$state/client_key
stepdeploy_ssh_known_hosts=$state/known_hosts
stepdeploy_gpus_per_node=1
stepdeploy_gpu_model=$model
stepdeploy_fabric=ethernet
EOF
cat > "$state/env.sh" <<EOF
export PYTHONPATH=$state/site:$(pwd) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stepdeploy() { python3 -m stepdeploy "\$@"; }
EOF
# the node answers, its host key checked (paramiko, as stepdeploy connects)
PYTHONPATH=$state/site${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python3}" - "$state" "$port" <<'PY'
import sys
import paramiko
state, port = sys.argv[1], int(sys.argv[2])
client = paramiko.SSHClient()
client.set_missing_host_key_policy(paramiko.RejectPolicy())
client.load_host_keys(f"{state}/known_hosts")
client.connect("127.0.0.1", port=port, username="root", key_filename=f"{state}/client_key", look_for_keys=False,
               allow_agent=False)
_, out, err = client.exec_command("echo node up: $(hostname) NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE")
print(out.read().decode().strip(), err.read().decode().strip())
client.open_sftp().listdir("/")
client.close()
PY
