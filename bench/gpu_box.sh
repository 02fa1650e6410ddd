# shellcheck shell=bash
# Sourced (from the checkout's root) by the scripts that drive one H200 box without sshd through the local executor
# (bench/gpu_local.sh, bench/gpu_optim.sh): the node side as the python_env role would make it, the controller as
# this checkout on PYTHONPATH, and the box as a one-node inventory.

gpu_box_setup() {  # WHEELS: megatron-core into the node's venv, the runs directory in memory, the controller's deps
    local wheels=$1
    mkdir -p /opt/stepdeploy
    # the python_env role's venv is the machine's own one (it holds torch)
    [ -e /opt/stepdeploy/venv ] || ln -s "$(python3 -c 'import sys; print(sys.prefix)')" /opt/stepdeploy/venv
    /opt/stepdeploy/venv/bin/python -m pip install -q --no-index --no-deps --no-cache-dir "$wheels"/megatron_core-*.whl
    # the rendered runs' remote directory in memory: the box's 64 GB disk is slow (bench/gpu_node.sh)
    mkdir -p /dev/shm/stepdeploy-runs /var/lib/stepdeploy
    [ -e /var/lib/stepdeploy/runs ] || ln -s /dev/shm/stepdeploy-runs /var/lib/stepdeploy/runs
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl
    export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

gpu_box_model() {  # the box's GPU model for an inventory, as nvidia-smi names its first GPU (an nvidia-h200 call can
                   # get an H100: an inventory saying H200 there plans the H200's layout, which does not fit 80 GB)
    local name model=H200
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
    case $name in *H100*) model=H100 ;; *H200*) model=H200 ;; *) echo "gpu_box_model: unknown GPU '$name'" >&2 ;; esac
    echo "the box's GPU: $name (inventory: $model)" >&2
    echo "$model"
}

gpu_box_inventory() {  # PATH: the box, reached without SSH (ansible_connection=local), its one GPU's model
    local model
    model=$(gpu_box_model)
    printf '%s\n' '[gpu]' 'h200 ansible_host=127.0.0.1 ansible_connection=local' '' '[gpu:vars]' \
        'stepdeploy_gpus_per_node=1' "stepdeploy_gpu_model=$model" 'stepdeploy_fabric=ethernet' > "$1"
}
