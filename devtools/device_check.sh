#!/usr/bin/env bash
# The device check (docs/BENCHMARKS.md, "On an accelerator"): one prepared run of about 8 minutes
# on an accelerator machine that writes OUT/device_check.json and OUT/device_check.log.
#
#   devtools/device_check.sh OUT            # the gpu plan (one H200, 16 cores)
#   devtools/device_check.sh --cpu OUT      # the same parts at tiny sizes (tests/test_bench_device.py)
#
# It runs the project from source (PYTHONPATH=.:plugins, no install), after installing the wheels
# of .whl/ (devtools/device_wheels.sh downloads them here; the device machine has no registry)
# into a temporary site directory. The parts come from `python -m training.bench.device plan`,
# in priority order; each runs as `python -m training.cli ...` under its own timeout, capped by
# what is left of the budget (a part with under 10 s left is skipped), and is recorded in the
# JSON as ok, failed, timed_out or skipped; a part that fails does not stop the next.
#
# Environment: PYTHON (python3), DEVICE_CHECK_BUDGET_S (480; --cpu: 420) for all the parts,
# DEVICE_CHECK_WHEELS (.whl; --cpu: none), DEVICE_CHECK_TMP (the work directory's parent: the stores of the
# island and merge parts, up to ~50 GB for gemma-1b; default: $TMPDIR or /tmp),
# DEVICE_CHECK_QUALITY_TOKENS (the quality pair's token budget), DEVICE_CHECK_ONLY (part names,
# space-separated: run only these, e.g. to redo one). Exit status: 0 when every part was ok,
# 1 when one was not, 2 when no JSON could be written.
set -u

profile=gpu
if [ "${1:-}" = "--cpu" ]; then
    profile=cpu
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: $0 [--cpu] OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2
PY=${PYTHON:-python3}
if [ "$profile" = gpu ]; then default_budget=480; else default_budget=420; fi
budget=${DEVICE_CHECK_BUDGET_S:-$default_budget}
if [ "$profile" = gpu ]; then default_wheels=.whl; else default_wheels=; fi
wheels=${DEVICE_CHECK_WHEELS:-$default_wheels}
log="$out/device_check.log"

say() { echo "[device-check +$(($(date +%s) - start))s] $*"; }

record() { # name status rc seconds timeout command
    printf '{"name": "%s", "status": "%s", "rc": %s, "seconds": %s, "timeout_s": %s, "command": "%s"}\n' \
        "$1" "$2" "$3" "$4" "$5" "$6" >>"$work/parts.jsonl"
}

check() {
    work=$(mktemp -d "${DEVICE_CHECK_TMP:-${TMPDIR:-/tmp}}/device-check.XXXXXX") || return 2
    trap 'rm -rf "$work"' EXIT
    start=$(date +%s)
    deadline=$((start + budget))
    say "profile $profile, budget ${budget}s, output $out, work $work"
    say "host $(uname -srm), $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}') memory"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader |
            tee "$work/nvidia-smi.txt"
    fi

    # preflight: the wheels, then the project's imports (a failure here is recorded; parts still run)
    t0=$(date +%s)
    pre_status=ok
    export PYTHONPATH="$repo:$repo/plugins"
    if [ -n "$wheels" ] && compgen -G "$wheels/*.whl" >/dev/null; then
        site="$work/site"
        say "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
        if PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl; then
            export PYTHONPATH="$PYTHONPATH:$site"
        else
            say "wheel install failed"
            pre_status=failed
        fi
    fi
    "$PY" --version
    if ! "$PY" -c "import training.cli, training.island.process, training.merge.merger, jax; print('jax', jax.__version__, jax.devices())"; then
        say "the project's imports fail"
        pre_status=failed
    fi
    record preflight "$pre_status" "$([ $pre_status = ok ] && echo 0 || echo 1)" $(($(date +%s) - t0)) 0 ""

    plan_args=("$profile" --work "$work")
    if [ -n "${DEVICE_CHECK_QUALITY_TOKENS:-}" ]; then
        plan_args+=(--quality-tokens "$DEVICE_CHECK_QUALITY_TOKENS")
    fi
    if ! "$PY" -m training.bench.device plan "${plan_args[@]}" >"$work/plan.tsv"; then
        say "no plan"
    fi

    while IFS=$'\t' read -r name want args <&3; do
        if [ -n "${DEVICE_CHECK_ONLY:-}" ] && [[ " $DEVICE_CHECK_ONLY " != *" $name "* ]]; then
            continue
        fi
        left=$((deadline - $(date +%s)))
        t=$((want < left ? want : left))
        if [ "$t" -lt 10 ]; then
            say "$name: skipped (${left}s of the budget left)"
            record "$name" skipped null 0 "$want" "$args"
            continue
        fi
        say "$name: start (timeout ${t}s): training.cli $args"
        mkdir -p "$work/tmp-$name"
        t0=$(date +%s.%N)
        # shellcheck disable=SC2086  # the arguments are split on spaces (plan lines hold none inside)
        TMPDIR="$work/tmp-$name" PYTHONUNBUFFERED=1 timeout --kill-after=15 "$t" \
            "$PY" -m training.cli $args </dev/null
        rc=$?
        seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
        rm -rf "$work/tmp-$name"
        case $rc in
        0) status=ok ;;
        124 | 137) status=timed_out ;;
        *) status=failed ;;
        esac
        say "$name: $status (exit $rc, ${seconds}s)"
        record "$name" "$status" "$rc" "$seconds" "$t" "$args"
    done 3<"$work/plan.tsv"

    say "assembling $out/device_check.json"
    if ! timeout 120 "$PY" -m training.bench.device assemble --work "$work" --profile "$profile" \
        --budget-s "$budget" --json "$out/device_check.json"; then
        say "assemble failed: writing the parts' record alone"
        printf '{"schema": 1, "profile": "%s", "assembled": false, "ok": false, "parts": [%s]}\n' \
            "$profile" "$(paste -sd, "$work/parts.jsonl")" >"$out/device_check.json" || return 2
    fi
    say "done in $(($(date +%s) - start))s"
    if grep -qv '"status": "ok"' "$work/parts.jsonl"; then
        return 1
    fi
    return 0
}

# progress on stdout and in the log; the pipeline waits for tee, so the log is whole on exit
check 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
