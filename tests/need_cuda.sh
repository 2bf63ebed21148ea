# need_cuda.sh: sourced by the GPU shell tests after tests/lib.sh (src, bin): exits 77 (skip) when
# lowbit has no CUDA backend or fewer than need_gpus (default 1) devices are visible.
ndev=$("$bin" info "$src/examples/tiny-moe.cfg" 2>/dev/null | awk '/^CUDA/ {print $2}' || true)
case "$ndev" in ''|*[!0-9]*) ndev=0 ;; esac
if [ "$ndev" -lt "${need_gpus:-1}" ]; then
    echo "SKIP: $ndev CUDA device(s) visible (lowbit info), this test needs ${need_gpus:-1}"
    exit 77
fi
