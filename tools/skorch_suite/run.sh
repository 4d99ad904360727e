#!/usr/bin/env bash
# Run skorch's installed tests (test_net.py, test_classifier.py,
# test_regressor.py) with ampnet's nets swapped in for skorch's.
#
#   tools/skorch_suite/run.sh skorch   # baseline: plain skorch
#   tools/skorch_suite/run.sh off      # ampnet.AmpNet* as they are (AMP off)
#   tools/skorch_suite/run.sh on       # ampnet.AmpNet* with amp_enabled=True, amp_dtype='bfloat16'
#   tools/skorch_suite/run.sh on -k lbfgs -x      # extra arguments go to pytest
#   tools/skorch_suite/run.sh off --rev HEAD      # test ampnet as committed at REV
#                                                 # (git archive; the work tree is not touched)
#   tools/skorch_suite/run.sh off --src DIR       # test the ampnet package in DIR/ampnet
#                                                 # (e.g. a copy with a proposed fix)
#   python tools/skorch_suite/compare.py [results/<sha10>]  # ampnet-only failures (default results/worktree)
#
# Environment: SKORCH_SUITE_DATA (skorch's tests folder from a checkout, for the
# data files that the wheel lacks), SKORCH_SUITE_FILES (test files, default the three above),
# SKORCH_SUITE_TIMEOUT (seconds, default 2400), SKORCH_SUITE_RESULTS (folder
# for results, default tools/skorch_suite/results; each run writes <mode>.xml
# and <mode>.log to results/worktree/, results/<sha10>/ (--rev) or
# results/src-<name>/ (--src)).
set -euo pipefail

mode=${1:-}
case "$mode" in
  skorch|off|on) shift ;;
  *) echo "usage: $0 skorch|off|on [--rev REV | --src DIR] [pytest args...]" >&2; exit 2 ;;
esac

rev="" src=""
case "${1:-}" in
  --rev) rev=${2:?--rev needs a git revision}; shift 2 ;;
  --src) src="$(cd "${2:?--src needs a folder holding ampnet/}" && pwd)"; shift 2
         [ -f "$src/ampnet/__init__.py" ] || { echo "run.sh: no $src/ampnet/__init__.py" >&2; exit 2; } ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
base="${SKORCH_SUITE_RESULTS:-$here/results}"

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$rev" ]; then
  sha="$(git -C "$root" rev-parse --verify "$rev^{commit}")"
  results="$base/${sha:0:10}"
  src="$base/src-$sha"
  if [ ! -d "$src/ampnet" ]; then
    rm -rf "$src.tmp" && mkdir -p "$src.tmp"
    git -C "$root" archive "$sha" ampnet | tar -x -C "$src.tmp"
    mv "$src.tmp" "$src"
  fi
  export PYTHONPATH="$src:$PYTHONPATH"   # ampnet from the snapshot, the plugin from the repo
  echo "run.sh: ampnet at $rev = $sha ($src)"
elif [ -n "$src" ]; then
  results="$base/src-$(basename "$src")"
  export PYTHONPATH="$src:$PYTHONPATH"
  echo "run.sh: ampnet from $src"
else
  results="$base/worktree"
fi
mkdir -p "$results"
export AMPNET_SKORCH_MODE="$mode"
export PYTHONDONTWRITEBYTECODE=1  # leave site-packages as it was

skorch_dir="$(python -c 'import os, skorch; print(os.path.dirname(skorch.__file__))')"
files=()
for f in ${SKORCH_SUITE_FILES:-test_net.py test_classifier.py test_regressor.py}; do
  files+=("$skorch_dir/tests/$f")
done

# Run from a scratch folder: some skorch tests read or write paths relative
# to the working directory (skorch/tests/net_cuda.pt, ...).
mkdir -p "$results/cwd"
# The data files of those tests (net_cuda.pt, optimizer_cuda.pt: legacy-format
# torch files; net_cuda.pkl, model_0.5.0.pkl) are not in skorch's wheel; with
# SKORCH_SUITE_DATA=<skorch checkout>/skorch/tests they are copied in.
if [ -n "${SKORCH_SUITE_DATA:-}" ]; then
  mkdir -p "$results/cwd/skorch/tests"
  for f in net_cuda.pt optimizer_cuda.pt net_cuda.pkl model_0.5.0.pkl; do
    [ -f "$SKORCH_SUITE_DATA/$f" ] && cp "$SKORCH_SUITE_DATA/$f" "$results/cwd/skorch/tests/"
  done
fi
cd "$results/cwd"
set +e
timeout "${SKORCH_SUITE_TIMEOUT:-2400}" python -m pytest \
  -c "$here/pytest.ini" --rootdir "$skorch_dir" \
  -q -p no:cacheprovider -p tools.skorch_suite.plugin --ampnet-mode "$mode" \
  -rfE --junitxml "$results/$mode.xml" \
  "${files[@]}" "$@" 2>&1 | tee "$results/$mode.log"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 124 ] && echo "run.sh: timed out after ${SKORCH_SUITE_TIMEOUT:-2400}s" >&2
exit "$rc"
