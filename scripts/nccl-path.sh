# Sourced (by scripts/env.sh, or by hand: `source scripts/nccl-path.sh`): makes NCCL loadable by
# te_runtime::dist (cudarc loads it as `libnccl.so`). PyTorch's NCCL (the nvidia-nccl-cu13 wheel,
# site-packages/nvidia/nccl/lib) ships only `libnccl.so.2`: this links .tools/nccl/lib/libnccl.so
# to it and puts that folder first on LD_LIBRARY_PATH. Looks in $TE_NCCL_LIB_DIR, then python3's
# nvidia.nccl package, then LD_LIBRARY_PATH and the loader's cache. Never fails: without NCCL it
# changes nothing (and says so on stderr unless TE_NCCL_QUIET=1).
_te_nccl_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_te_nccl_dir=""
_te_nccl_has() { [ -n "$1" ] && { [ -e "$1/libnccl.so" ] || [ -e "$1/libnccl.so.2" ]; }; }
if [ -n "${TE_NCCL_LIB_DIR:-}" ] && _te_nccl_has "$TE_NCCL_LIB_DIR"; then
  _te_nccl_dir=$TE_NCCL_LIB_DIR
fi
if [ -z "$_te_nccl_dir" ] && command -v python3 >/dev/null 2>&1; then
  # A namespace package in recent wheels (no __file__): __path__ works for both kinds.
  _te_nccl_py=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib")' 2>/dev/null || true)
  if _te_nccl_has "$_te_nccl_py"; then _te_nccl_dir=$_te_nccl_py; fi
fi
if [ -z "$_te_nccl_dir" ]; then
  IFS=: read -r -a _te_nccl_paths <<<"${LD_LIBRARY_PATH:-}" || true
  for _te_nccl_p in ${_te_nccl_paths[@]+"${_te_nccl_paths[@]}"}; do
    if _te_nccl_has "$_te_nccl_p"; then _te_nccl_dir=$_te_nccl_p; break; fi
  done
fi
if [ -z "$_te_nccl_dir" ] && command -v ldconfig >/dev/null 2>&1; then
  _te_nccl_so=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so(\.2)? /{print $NF; exit}' || true)
  if [ -n "$_te_nccl_so" ]; then _te_nccl_dir=$(dirname "$_te_nccl_so"); fi
fi
if [ -z "$_te_nccl_dir" ]; then
  [ "${TE_NCCL_QUIET:-0}" = 1 ] || echo "nccl-path: no NCCL found (python3's nvidia.nccl, LD_LIBRARY_PATH, ldconfig); set TE_NCCL_LIB_DIR to the folder holding libnccl.so.2" >&2
elif [ -e "$_te_nccl_dir/libnccl.so" ]; then
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$_te_nccl_dir:"*) ;;
    *) export LD_LIBRARY_PATH="$_te_nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
else
  # Only libnccl.so.2: link the unversioned name to it in a folder of our own.
  _te_nccl_link="$_te_nccl_root/.tools/nccl/lib"
  if ! { mkdir -p "$_te_nccl_link" 2>/dev/null && [ -w "$_te_nccl_link" ]; }; then
    _te_nccl_link="${TMPDIR:-/tmp}/te-nccl-$(id -u)/lib"
    mkdir -p "$_te_nccl_link" 2>/dev/null || true
  fi
  if ln -sfn "$_te_nccl_dir/libnccl.so.2" "$_te_nccl_link/libnccl.so" 2>/dev/null; then
    case ":${LD_LIBRARY_PATH:-}:" in
      *":$_te_nccl_link:"*) ;;
      *) export LD_LIBRARY_PATH="$_te_nccl_link:$_te_nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
  else
    [ "${TE_NCCL_QUIET:-0}" = 1 ] || echo "nccl-path: could not link $_te_nccl_link/libnccl.so to $_te_nccl_dir/libnccl.so.2" >&2
  fi
fi
unset -f _te_nccl_has
unset _te_nccl_root _te_nccl_dir _te_nccl_py _te_nccl_paths _te_nccl_p _te_nccl_so _te_nccl_link
