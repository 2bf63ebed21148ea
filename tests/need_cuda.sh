# need_cuda.sh: sourced by the GPU shell tests once src and bin are set: exits 77 (skip) when
# lowbit has no CUDA backend or no device is visible.
ndev=$("$bin" info "$src/examples/tiny-moe.cfg" 2>/dev/null | awk '/^CUDA/ {print $2}')
case "$ndev" in
    ''|*[!0-9]*|0) echo "SKIP: no CUDA backend or no visible device (lowbit info: CUDA ${ndev:-?})"; exit 77 ;;
esac
