#!/bin/bash
# Quick start: installs what lowbit needs (Debian 12, as root), builds it, writes the arithmetic
# corpus, pretrains the tiny MoE on the CPU and runs the RL demo from the pretrained model.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# Another apt-get (an unattended upgrade on a fresh machine) may hold the dpkg lock: wait for it.
apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
if ! dpkg -s $(cat .ci/packages) >/dev/null 2>&1; then
    apt_get update -qq
    apt_get install -y -qq --no-install-recommends $(cat .ci/packages) >/dev/null
fi
[ -x configure ] || ./bootstrap > /dev/null 2>&1 || ./bootstrap   # quiet unless it fails
# CUDA only where a GPU can run it (CI still compiles it): with nvcc and no GPU, compiling the
# kernels would be most of the quick start's time.
if [ ! -f Makefile ]; then
    if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
        ./configure -q
    else
        echo "quickstart: no GPU visible: building without CUDA (a plain ./configure builds it)"
        ./configure -q --without-cuda
    fi
fi
make -s -j"$(nproc)"
./lowbit data examples/tiny-moe.cfg
# run.overwrite: a second quick start starts the runs over (a run directory holds one run)
./lowbit train examples/tiny-moe.cfg --set run.overwrite=true   # (cost: ./lowbit info examples/tiny-moe.cfg)
# GRPO from that checkpoint with the sampler inside the trainer (doc/rl.md)
./lowbit rl examples/rl-arith.cfg --set run.overwrite=true
