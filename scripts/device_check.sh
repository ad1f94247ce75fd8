#!/usr/bin/env bash
# The one command a session with a lent GPU runs (docs/performance.md, "On a lent GPU", has the exact `run` call):
#   1. installs ddpo_tpu into the machine's own Python from the carried wheels (.whl/ddpo_tpu, scripts/device_wheels.sh)
#      with --no-deps, then `pip install --no-deps -e .`, and checks that its torch is the one it had;
#   2. the smoke on CUDA (tpu_topology=gpu-1: torchrun, nccl, torch.compile), and 4. beside it;
#   3. then, alone on the machine, the side-by-side bench (scripts/bench_accelerator.py --side-by-side): ddpo_tpu vs ddpo-pytorch at SD 1.4's
#      shape, vs flow_grpo at SD 3.5 Medium's, the references from .whl/refs/ with their own packages;
#   4. the fast tier's torch-only tests (`-m "not slow"`; torch_xla's skip themselves), on the CPU beside the smoke.
# Each step has its own time limit inside BUDGET_S (default 560 s, under the 10-minute command limit); what one step
# leaves undone is said in $OUT/summary.txt and the next step still runs. Results: $OUT/summary.txt, smoke.log,
# bench.log, side_by_side.json, RESULTS.md (with the appended table), tests.log, build_sd14.log, build_sd35.log (eight: the
# limit of files back). PAIRS=sd35 CHECKS=0 runs one pair alone (a
# second call, on the same machine while it is warm: the install and the built checkpoint are still there). Locally (a dry run on CPU):
#   PYTHON=.venv-byot/bin/python OUT=/tmp/dc SIZE=tiny TOPOLOGY=eager_cpu bash scripts/device_check.sh
# (on 2 shared cores also BUDGET_S=1500 TESTS_S=900 SMOKE_S=400 TEST_WORKERS=2: docs/performance.md has the timings)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # absolute: checked from /tmp below
BUDGET=${BUDGET_S:-560}
SIZE=${SIZE:-full}
TOPOLOGY=${TOPOLOGY:-gpu-1}
SITES=${SITES:-/tmp/ddpo_tpu_ref_sites}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "[device_check +$(($(date +%s) - START))s] $*" | tee -a "$OUT/summary.txt"; }
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1

# 1. install into the machine's own Python, keeping its torch
torch_version() { "$PY" -c "import torch; print(torch.__version__, torch.version.cuda)"; }
BEFORE=$(torch_version)
if (cd /tmp && "$PY" -c "import ddpo_tpu, diffusers, hydra" 2>/dev/null); then
  say "ddpo_tpu already installed (a second call on the same machine): install skipped"
else
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check .whl/ddpo_tpu/*.whl \
    && "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . \
    || { say "FAILED: pip install (see above)"; exit 1; }
fi
AFTER=$(torch_version)
say "torch before install: $BEFORE; after: $AFTER; $("$PY" -m pip check 2>&1 | tail -3 | tr '\n' ' ')"
[ "$BEFORE" = "$AFTER" ] || { say "FAILED: the install changed torch"; exit 1; }
say "versions: $("$PY" -m pip list 2>/dev/null | grep -iE '^(torch|diffusers|transformers|accelerate|peft|hydra-core|pydantic) ' \
  | tr -s ' ' | tr '\n' ';')"
for r in ref-common ref-ddpo-pytorch ref-flow-grpo; do  # each reference's own packages, in folders of their own
  [ -d "$SITES/$r" ] && continue
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITES/$r" \
    .whl/$r/*.whl || say "FAILED: installing $r"
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee -a "$OUT/summary.txt"

# 2. beside each other, none of them a timing: the random-weight checkpoints the bench loads are built (SD 3.5
# Medium's: ~16 GB written), the smoke runs on the device, the fast tier's torch-only tests on the CPU (CHECKS=0: a
# second call skips the smoke and the tests)
PAIRS=${PAIRS:-sd14 sd35}
declare -A SPEC=([sd14]=sd14 [sd35]=sd35_medium)
[ "$SIZE" = tiny ] && SPEC=([sd14]=tiny [sd35]=tiny_sd3)
for pair in $PAIRS; do
  timeout -k 10 300 "$PY" -m benchmarks.checkpoints "${SPEC[$pair]}" ~/.cache/ddpo_tpu/models >"$OUT/build_$pair.log" 2>&1 &
done
if [ "${CHECKS:-1}" = 1 ]; then
  # TEST_WORKERS: pytest-xdist workers (6 of the GPU machine's 16 cores; 2 for a dry run on a 2-core machine);
  # loadgroup as CI runs them: tests sharing a module fixture on one worker (tests/conftest.py)
  XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-6} --dist loadgroup")
  # the tests that need what the carried set leaves out by design (scripts/device_wheels.sh, SKIP): the gs:// stack
  # (gcsfs, fake-gcs-server) and PyAV (mp4); deselected by node-id prefix, so a rename here only runs one again
  LEFT_OUT=(test_status_sweep.py::test_a_sweep_in_a_bucket test_storage.py::test_the_mirror_uploads_files
    test_storage.py::test_restore_takes_the_newest test_storage.py::test_sigkill_during_a_checkpoint_upload
    test_storage.py::test_a_missing_bucket_is_refused test_storage_faults.py::test_a_blip_shorter
    test_storage_faults.py::test_a_bucket_that_cannot_be_read test_storage_faults.py::test_an_outage_longer
    test_storage_faults.py::test_an_unreachable_bucket test_storage_faults.py::test_exceptions_are_judged
    test_storage_faults.py::test_the_resume_takes_the_newer_local_copy
    test_machine_checks.py::test_a_video_model_needs_pyav test_video_outputs.py::test_mp4_decodes_back
    test_video_outputs.py::test_run_dir_holds_mp4s test_video_outputs.py::test_wandb_offline_run_gets_the_mp4_files
    test_wan_model.py::test_one_epoch_scores_videos_per_frame_and_writes_mp4s
    "test_wan_nft.py::test_one_nft_epoch_on_the_tiny_wan_moves_the_weights[euler]")
  timeout -k 10 "${TESTS_S:-150}" "$PY" -m pytest -m "not slow" -q -p no:cacheprovider $XDIST \
    "${LEFT_OUT[@]/#/--deselect=tests/}" >"$OUT/tests.log" 2>&1 &
  TESTS_PID=$!
  # in a process group of its own, ended whole past its limit (the front end answers SIGTERM by letting its
  # training processes finish a checkpoint; none may hold the GPU when the bench starts)
  rm -rf /tmp/device_check_runs/smoke  # a run dir left by an earlier call would be resumed, not run
  setsid "$PY" -m ddpo_tpu.train +experiment=smoke tpu_topology="$TOPOLOGY" num_epochs=2 \
    output_root=/tmp/device_check_runs run_name=smoke >"$OUT/smoke.log" 2>&1 &
  SMOKE=$!
  (sleep "${SMOKE_S:-180}"; kill -TERM -- -"$SMOKE"; sleep 20; kill -KILL -- -"$SMOKE") 2>/dev/null &
  WATCH=$!
  wait "$SMOKE"
  SMOKE_RC=$?
  kill "$WATCH" 2>/dev/null
  say "smoke (tpu_topology=$TOPOLOGY): exit $SMOKE_RC ($(grep -c '\] done: ' "$OUT/smoke.log" 2>/dev/null || true) epochs done)"
  wait "$TESTS_PID"
  say "fast tier (torch-only, ${TESTS_S:-150} s limit, ${#LEFT_OUT[@]} node-id prefixes left out): exit $?: $(tail -1 "$OUT/tests.log")"
fi
wait  # the checkpoint builds
say "checkpoints: $(tail -qn1 "$OUT"/build_*.log | tr '\n' ' ')"

# 3. the side-by-side bench on a quiet machine, in what is left; a side gets what remains of --deadline-s, and
# `timeout` is the backstop (the bench ends each side's whole process group itself). Its section is appended to a
# copy of the repo's RESULTS.md in $OUT (--out), never to benchmarks/RESULTS.md: a dry run leaves the tree clean
BENCH_S=$(($(left) - 15))
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
timeout -k 10 $((BENCH_S + 10)) "$PY" scripts/bench_accelerator.py --side-by-side --size "$SIZE" \
  --topology "$TOPOLOGY" --pairs $PAIRS --deadline-s "$BENCH_S" \
  --ddpo-pytorch .whl/refs/ddpo-pytorch --flow-grpo .whl/refs/flow_grpo \
  --ref-site sd14 "$SITES/ref-ddpo-pytorch:$SITES/ref-common" --ref-site sd35 "$SITES/ref-flow-grpo:$SITES/ref-common" \
  --json-out "$OUT/side_by_side.json" --out "$OUT/RESULTS.md" >"$OUT/bench.log" 2>&1
say "side by side: exit $? in a limit of ${BENCH_S} s"
grep -E '^\| (sd14|sd35|pair) ' "$OUT/bench.log" | tee -a "$OUT/summary.txt"
