#!/usr/bin/env bash
# Checks a stack of library versions in a fresh virtual environment: installs them, then runs the
# quick test tier and every training script's --smoke run (08 on one of their models), offline.
#   bash tools/check_stack.sh minimums      # the lower bounds requirements.txt declares
#   bash tools/check_stack.sh h200          # the H200 machine's stack
#   bash tools/check_stack.sh "torch==2.7.0 torchvision==0.22.0 ..."   # any pins
# VENV=DIR chooses the environment's folder (default: a new temporary one, removed at the end);
# PYTHON=PATH the interpreter that makes it. Exit codes: 0 all passed, 1 a check failed, 2 bad
# input or the install failed. Several GB are downloaded (torch's CUDA build and its libraries).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  minimums) pins=$(sed -n 's/^\([A-Za-z_-]*\)>=\([0-9.]*\).*/\1==\2/p' requirements.txt | tr '\n' ' ') ;;
  h200) pins="torch==2.11.0 torchvision==0.26.0 lightning==2.6.6 torchmetrics==1.9.0" ;;
  "") echo "check_stack.sh: error: name a stack: minimums, h200 or quoted pins" >&2; exit 2 ;;
  *) pins=$1 ;;
esac
venv=${VENV:-$(mktemp -d /tmp/stack.XXXXXX)}
[ -z "${VENV:-}" ] && trap 'rm -rf "$venv"' EXIT
"${PYTHON:-python3}" -m venv "$venv" || exit 2
py="$venv/bin/python"
echo "check_stack.sh: installing $pins" >&2
# shellcheck disable=SC2086
if ! "$py" -m pip install -q $pins -r requirements.txt pytest; then
  echo "check_stack.sh: error: the install failed" >&2
  exit 2
fi
"$py" -m pip list 2>/dev/null |
  grep -i -E "^(torch|torchvision|lightning|torchmetrics|numpy|matplotlib|scikit-learn|watermark) "
failed=0
"$py" -m pytest -q -m "not slow" -p no:cacheprovider || failed=1
work=$(mktemp -d /tmp/stack-runs.XXXXXX)
for script in [0-9][0-9]_*.py; do
  [ "$script" = 08_load-and-evaluate.py ] && continue
  if (cd "$work" && "$py" "$OLDPWD/$script" --smoke > "$work/${script%.py}.log" 2>&1); then
    echo "passed: $script --smoke"
  else
    echo "FAILED: $script --smoke (exit $?): $(tail -n 1 "$work/${script%.py}.log")"; failed=1
  fi
done
(cd "$work" && "$py" "$OLDPWD/08_load-and-evaluate.py" --smoke > "$work/08.log" 2>&1) \
  && echo "passed: 08_load-and-evaluate.py --smoke" || { echo "FAILED: 08_load-and-evaluate.py --smoke"; failed=1; }
rm -rf "$work"
[ $failed = 0 ] && echo "check_stack.sh: every check passed on: $pins"
exit $failed
