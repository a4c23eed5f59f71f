#!/usr/bin/env bash
# Issue 48, item 4: every GPU number of the issue in one run, baselines in the same processes (docs/benchmarks.md, GPU).
#
#   bash benchmarks/gpu_issue48.sh                          # on a CUDA machine (an H100: budgeted to 9 minutes)
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_issue48.sh     # the same steps at tiny sizes on a CPU: a plumbing
#                                                           # check, whose times mean nothing
#   GPU_CHECK_STEPS="b1 e" bash benchmarks/gpu_issue48.sh   # a rerun of some steps only
#
# Steps, in this order, each under `timeout`, all within GPU_CHECK_BUDGET_S seconds of the script's start (default 540
# on CUDA; the wheel's install and the version probes count): each step has a share of the budget (LIMIT below) and
# may also use what the steps before it left unused. A step that fails, times out or finds no time left is recorded
# as such and the next one runs:
#   a   pytest tests/ops/test_cuda.py and the paged kernel's CUDA test (issue 50): the kernels' correctness on the GPU
#   b1  GPT-2 small from its default config (attention dropout 0.1), vocabulary 50257, batch 4, bf16 autocast, 1024
#       tokens: QANA (h=4) and Neural Attention (h=4, proj_dim=2) on impl=auto against the unpatched SDPA model with
#       the same dropout; peak memory from each configuration's own process, step time from one more process that
#       runs a step of each in turn (interleaved: the targets' ratios then hold whatever the GPU's clocks do)
#   b2  the same at 4096 tokens, step time only (--quick: one process, a step of each configuration in turn)
#   c   the same as b1, every model torch.compile(fullgraph=True), compiled against compiled, step and compile time
#   d   SmolLM-135M's shape (Llama 30 x 576, 9 query heads on 3 kv heads, vocabulary 49152; attention dropout 0, its
#       config's) training step at 1024 tokens, batch 4, bf16 autocast, step time only
#   e   generation at SmolLM-135M's shape in bf16: prefill of a 1024-token prompt and per-token decode, eager
#   targets  b1's ratios against issue 48's targets (QANA <= 1.8x time and <= 1.15x memory, Neural Attention with
#       proj_dim=2 <= 1.4x and <= 1.1x)
# Every patched row names the path impl=auto took ("auto -> triton" is the kernels), recorded from an eager forward
# (a compiled model runs the same paths: the rule reads shapes, dtype, device and mask only).
#
# Output: every step's tables, JSON and log in a new folder, benchmarks/results/gpu_issue48_<UTC time>/ (or
# GPU_CHECK_WORK, new or empty); summary.md (the versions, each step's status, time and tables) and gpu_issue48.log,
# written as the run goes, in $OUT when it is set (the device tool's folder, whose files come back: 3 files, within
# its limit of 8), else in that folder; at the end $OUT also gets results.tar.gz of the folder. Exit status 1 when a
# step failed, timed out or was skipped; 2 when nothing could run (no library, no CUDA).
#
# The library needs transformers >= 5.18; the GPU image had 5.17. Before the run, here (where pip reaches PyPI):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
# and carry .whl: the script installs .whl/*.whl into a temporary folder first when there are any.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
START=$SECONDS  # the budget counts from here: the wheel's install and the version probes take from it too
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
ORDER=(a b1 b2 c d e targets)
STEPS_TO_RUN=${GPU_CHECK_STEPS:-${ORDER[*]}}
# Each step's share of the budget, in seconds on an H100 (estimates: none of it has run on a GPU yet).
declare -A LIMIT=([a]=90 [b1]=110 [b2]=60 [c]=160 [d]=50 [e]=60 [targets]=10)
for id in $STEPS_TO_RUN; do
    if [ -z "${LIMIT[$id]:-}" ]; then
        echo "GPU_CHECK_STEPS: no step $id; the steps are ${ORDER[*]}" >&2
        exit 2
    fi
done
WORK=${GPU_CHECK_WORK:-benchmarks/results/gpu_issue48_$(date -u +%Y%m%dT%H%M%SZ)}
DEST=${OUT:-$WORK}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# Sizes: the issue's on CUDA; on a CPU the same steps at sizes that run in seconds (GPT-2 keeps its real vocabulary,
# Llama its grouped heads, 2 on 1). SCALE multiplies each step's time limit.
if [ "$DEVICE" = cpu ]; then
    GPT2=(--layers 1 --width 64 --heads 2); SHORT=64; LONG=128; BATCH=2; STEPS=2; LONG_STEPS=1
    LLAMA=(--layers 1 --width 64 --heads 2 --kv_heads 1 --vocab 1000)
    GENERATION=(--layers 1 --prompt 32 --decode_steps 2 --rounds 1)
    SCALE=8
else
    GPT2=(); SHORT=1024; LONG=4096; BATCH=4; STEPS=10; LONG_STEPS=5
    LLAMA=(--vocab 49152)
    GENERATION=(--prompt 1024 --decode_steps 32 --rounds 3)
    SCALE=1
fi
BUDGET=${GPU_CHECK_BUDGET_S:-$((540 * SCALE))}
# What b1, b2 and c share: GPT-2 small's default config with its real vocabulary, attention dropout 0.1 (config).
GPT2_STEP=(benchmarks/train_step.py --device "$DEVICE" --dtype bf16 --preset gpt2-small "${GPT2[@]}" --vocab 50257
    --batch "$BATCH" --dropouts config --scorers qana neural --proj_dim 2 --impls auto --output_dir "$WORK")

mkdir -p "$WORK" "$DEST"
if [ -n "$(ls -A "$WORK")" ]; then
    echo "GPU_CHECK_WORK=$WORK holds files already: name a new or empty folder" >&2
    exit 2
fi
SUMMARY=$DEST/summary.md
: >"$SUMMARY"
exec > >(tee -a "$DEST/gpu_issue48.log") 2>&1
LOG_PID=${!:-}  # the tee's process (bash 4.4 and later set $! for a process substitution)

# The library from this tree; transformers from carried wheels when there are any.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE:$PYTHONPATH"
fi

{
    echo "# Issue 48 measurements, $(date -u +%Y-%m-%dT%H:%M:%SZ), GPU_CHECK_DEVICE=$DEVICE"
    echo
    echo '```'
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi: not on this machine"; fi
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git here)')"
    "$PYTHON" - "$DEVICE" <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "triton", "transformers", "hf_neural_attn"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:  # the versions are reported, whatever fails
        print(name, "not importable:", f"{type(error).__name__}: {error}")
import torch
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
    echo '```'
    echo
    if [ "$DEVICE" = cpu ]; then
        echo "GPU_CHECK_DEVICE=cpu: tiny sizes, a check that every step runs; its times and ratios mean nothing."
        echo
    fi
} | tee -a "$SUMMARY"

# Nothing runs without the library, or without the GPU the run asks for: stop before spending the budget.
if ! "$PYTHON" -c "import hf_neural_attn" 2>&1; then
    echo "import hf_neural_attn failed (transformers older than 5.18? carry a wheel in .whl/, see the header)" \
        | tee -a "$SUMMARY"
    exit 2
fi
if [ "$DEVICE" != cpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "GPU_CHECK_DEVICE=$DEVICE but torch sees no CUDA device" | tee -a "$SUMMARY"
    exit 2
fi

FAILED=0
STATUSES=()

selected() { case " $STEPS_TO_RUN " in *" $1 "*) return 0 ;; esac; return 1; }

# Seconds from the start by which step $1 is to end: the budget's share of it and of the selected steps before it.
planned_end() {
    local id total=0 until=0
    for id in "${ORDER[@]}"; do
        selected "$id" || continue
        total=$((total + ${LIMIT[$id]}))
        [ "$id" = "$1" ] && until=$total
    done
    echo $((BUDGET * until / total))
}

# run_step ID TITLE -- COMMAND...: COMMAND under timeout (until the step's planned end), its output in $WORK/ID.log;
# summary.md gets its status, its time and every table it wrote.
run_step() {
    local id=$1 title=$2 status rc started limit
    shift 3
    selected "$id" || return 0
    limit=$(($(planned_end "$id") - (SECONDS - START)))
    local marker=$WORK/.before_$id
    touch "$marker"
    echo "=== $id. $title"
    if ((limit < 10)); then
        status="skipped: ${limit} s left of its share of the ${BUDGET} s budget"
        rc=skipped
    else
        echo "+ timeout $limit $*"
        started=$SECONDS
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$id.log"
        rc=${PIPESTATUS[0]}
        case $rc in
            0) status="ok" ;;
            124 | 137) status="timed out (its limit: $limit s)" ;;
            *) status="failed (exit status $rc)" ;;
        esac
        status="$status, $((SECONDS - started)) s"
    fi
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
    STATUSES+=("$id: $status")
    echo "=== $id. $status"
    {
        echo "## $id. $title"
        echo
        echo "$status. Command: \`$*\`"
        echo
        find "$WORK" -maxdepth 1 -name '*.md' -newer "$marker" | sort | while read -r table; do
            echo "$(basename "$table"):"
            echo
            cat "$table"
            echo
        done
        # pytest's outcome is its log's end; a failed step's reason too.
        if [ -f "$WORK/$id.log" ] && { [ "$id" = a ] || [ "$rc" != 0 ]; }; then
            echo '```'
            tail -n 25 "$WORK/$id.log"
            echo '```'
            echo
        fi
    } >>"$SUMMARY"
    rm -f "$marker"
}

run_step a "correctness on the GPU: pytest tests/ops/test_cuda.py, the paged kernel" -- \
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=10 tests/ops/test_cuda.py \
    tests/ops/test_paged_attention.py::test_paged_kernel_on_cuda
run_step b1 "GPT-2 small, vocabulary 50257, dropout 0.1, bf16, $SHORT tokens: step time and peak memory" -- \
    "$PYTHON" "${GPT2_STEP[@]}" --seq "$SHORT" --steps "$STEPS" --interleave --name "b1_gpt2_$SHORT"
run_step b2 "GPT-2 small, vocabulary 50257, dropout 0.1, bf16, $LONG tokens: step time" -- \
    "$PYTHON" "${GPT2_STEP[@]}" --seq "$LONG" --steps "$LONG_STEPS" --quick --name "b2_gpt2_$LONG"
run_step c "GPT-2 small as b1, compiled against compiled: step and compile time" -- \
    "$PYTHON" "${GPT2_STEP[@]}" --seq "$SHORT" --steps "$STEPS" --quick --compiled --name "c_gpt2_${SHORT}_compiled"
run_step d "SmolLM-135M's shape (Llama), attention dropout 0, bf16, $SHORT tokens: step time" -- \
    "$PYTHON" benchmarks/train_step.py --family llama --preset smollm-135m "${LLAMA[@]}" --device "$DEVICE" \
    --dtype bf16 --batch "$BATCH" --seq "$SHORT" --dropouts config --scorers qana neural --proj_dim 2 --impls auto \
    --steps "$STEPS" --quick --output_dir "$WORK" --name "d_llama_$SHORT"
run_step e "generation at SmolLM-135M's shape, bf16 weights: prefill and per-token decode, eager" -- \
    "$PYTHON" benchmarks/inference.py --preset smollm-135m "${GENERATION[@]}" --device "$DEVICE" --dtype bf16 \
    --proj_dim 2 --output_dir "$WORK"
run_step targets "b1 against issue 48's targets at $SHORT tokens, dropout 0.1" -- \
    "$PYTHON" - "$WORK/b1_gpt2_$SHORT.json" <<'EOF'
import json, sys
# Issue 48: QANA <= 1.8x the SDPA step time and <= 1.15x its memory; Neural Attention (proj_dim=2) <= 1.4x, <= 1.1x.
TARGETS = {"qana": (1.8, 1.15), "neural": (1.4, 1.1)}
rows = json.load(open(sys.argv[1]))["results"]
base = next(r for r in rows if r["scorer"] == "none")
lines = ["| scorer | path | time x SDPA | target | memory x SDPA | target | both met |", "|---" * 7 + "|"]
for row in rows:
    if row["scorer"] not in TARGETS:
        continue
    if "error" in row:
        lines.append(f"| {row['scorer']} | {row['impl']} | {row['error']} | | | | no |")
        continue
    time_target, memory_target = TARGETS[row["scorer"]]
    time, memory = row["time_s"] / base["time_s"], row["peak_bytes"] / base["peak_bytes"]
    met = "yes" if time <= time_target and memory <= memory_target else "no"
    lines.append(
        f"| {row['scorer']} | {row['impl']} -> {row.get('resolved_impl')} | {time:.2f} | {time_target} | {memory:.2f} "
        f"| {memory_target} | {met} |"
    )
open(sys.argv[1].replace(".json", "_targets.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

{
    echo "## Steps"
    echo
    printf -- '- %s\n' "${STATUSES[@]}"
    echo
    echo "Total: $((SECONDS - START)) s of the $BUDGET s budget."
} | tee -a "$SUMMARY"
if [ "$DEST" != "$WORK" ]; then
    tar -czf "$DEST/results.tar.gz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
fi
# The log's tee ends once the output is closed: wait for it, so the log is whole when the script returns.
exec >&- 2>&-
[ -z "$LOG_PID" ] || wait "$LOG_PID" 2>/dev/null
((FAILED == 0))
