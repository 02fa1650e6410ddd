#!/usr/bin/env bash
# Downloads, here (where PyPI is reachable), the wheels the H200 box lacks, for its Python 3.12 on x86-64, into
# DIR (default .whl, git-ignored): stepdeploy's controller dependencies that the box's image does not hold
# (typer, rich, jinja2, pyyaml and matplotlib are there) and megatron-core for the node side. bench/gpu_box.sh
# and bench/gpu_node.sh install them on the box; name DIR in the device call's carry.
#
#   bash bench/box_wheels.sh [DIR]
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_34_x86_64 manylinux_2_24_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$dir" \
    'ansible-core>=2.19,<2.21' 'ansible-runner>=2.4,<3' 'fabric>=3.2,<4' 'invoke>=2,<3' decorator deprecated \
    'paramiko>=3.4,<6' bcrypt cryptography cffi pycparser pynacl \
    'pydantic==2.14.4' 'pydantic-core==2.50.5' annotated-types typing-inspection 'typing-extensions>=4.16' \
    resolvelib pexpect ptyprocess python-daemon lockfile \
    megatron-core==0.19.2
du -sh "$dir"
