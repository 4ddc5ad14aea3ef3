#!/usr/bin/env bash
# The declared versions, tested: build throw-away venvs for torch/Lightning pairs and run the fast loop plus the
# equivalence, checkpoint-resume and fault-tolerance files in each. Usage:
#
#   bash scripts/version_matrix.sh                      # the floor (torch 2.11.0 + lightning 2.5.3) and the newest
#   bash scripts/version_matrix.sh 2.13.0:2.5.3 2.13.0:2.6.6   # torch:lightning pairs
#
# Each pair's last lines go to stdout and the whole log to $OUT (default: /tmp/version_matrix). A torch other
# than the one served locally (2.13.0 here) is a multi-GB download. Exit status: the number of failed pairs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/version_matrix}
mkdir -p "$OUT"
PAIRS=("$@")
[ ${#PAIRS[@]} -gt 0 ] || PAIRS=("2.11.0:2.5.3" "2.13.0:2.6.6")
FILES=(tests/test_equivalence.py tests/test_checkpoint_resume.py tests/test_fault_tolerance.py
       tests/test_fault_tolerance_bad_days.py tests/test_fault_tolerance_fabric.py)
failed=0
for pair in "${PAIRS[@]}"; do
    torch_version=${pair%%:*}; lightning_version=${pair##*:}
    venv="$OUT/venv-torch$torch_version-lightning$lightning_version"
    log="$OUT/torch$torch_version-lightning$lightning_version.log"
    echo "== torch $torch_version, lightning $lightning_version ($log)"
    {
        python3 -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip &&
        "$venv/bin/pip" install -q "torch==$torch_version" &&
        "$venv/bin/pip" install -q "lightning==$lightning_version" -e ".[dev]" &&
        "$venv/bin/python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" &&
        "$venv/bin/python" -m pytest tests -q -p no:cacheprovider -m "not distributed" &&
        "$venv/bin/python" -m pytest "${FILES[@]}" -q -p no:cacheprovider
    } > "$log" 2>&1
    status=$?
    grep -E "^torch |passed|failed|error" "$log" | tail -4
    if [ $status -ne 0 ]; then
        echo "   FAILED (exit $status)"; failed=$((failed + 1))
    fi
done
exit $failed
