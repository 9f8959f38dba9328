# Sourced by launch/serve_sglang.sh and launch/serve_vllm.sh: their one command line,
#   SCRIPT TARGET DRAFT [K] [-- extra engine flags]
# into TARGET, DRAFT and K (default 3), leaving the extra flags in "$@". Source it without
# arguments: it reads and shifts the caller's own positional parameters (`source FILE ARGS`
# would give it a copy, restored afterwards). With fewer than two arguments: the caller's header
# comment (its usage) on stdout, exit 2.
if [[ $# -lt 2 ]]; then
    # the header: the comment lines after the shebang, up to the first line of code
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
TARGET=$1
DRAFT=$2
shift 2
K=3
if [[ $# -gt 0 && $1 != "--" ]]; then
    K=$1
    shift
fi
if [[ $# -gt 0 && $1 == "--" ]]; then
    shift
fi
