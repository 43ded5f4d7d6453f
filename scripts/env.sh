# Sourced by the project's scripts: makes NVRTC 13.0 (from PyPI) loadable, installing it into
# .tools/nvrtc on first use. A system CUDA 13 toolkit on the loader path works as well. NCCL too,
# when the machine has it (scripts/nccl-path.sh; nothing is installed for it).
_te_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_te_nvrtc="$_te_root/.tools/nvrtc"
if [ ! -e "$_te_nvrtc/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  echo "installing NVRTC 13.0 (nvidia-cuda-nvrtc==13.0.88) into $_te_nvrtc" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$_te_nvrtc" \
    nvidia-cuda-nvrtc==13.0.88 >&2
fi
export LD_LIBRARY_PATH="$_te_nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL (te_runtime::dist) where this machine has it, e.g. PyTorch's: see scripts/nccl-path.sh.
TE_NCCL_QUIET=${TE_NCCL_QUIET:-1} source "$_te_root/scripts/nccl-path.sh"
unset _te_root _te_nvrtc
