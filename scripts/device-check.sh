#!/usr/bin/env bash
# gpuwarden on a real GPU node, end to end, in one run of a few minutes. From the repository root, on the node:
#
#   scripts/device-check.sh [OUTPUT-DIR]      # OUTPUT-DIR: else $DEVICE_CHECK_OUT, else ./device-check-out
#
# It sets up .venv (torch in the background), records the node, runs preflight quick, nvidia-smi, replays the
# recording, runs the daemon for 30 s (/metrics, status) and the idle benchmark; then, with torch: preflight full,
# record --with-tools and its replay at full level (as far as time allows); last, a table of live vs replayed
# statuses per check. Running it loads the GPUs and the network for minutes: run it on a node that is not serving
# work.
#
# Every step has a timeout and its own exit status; a failing step never stops the ones after it. The whole run
# aims at DEVICE_CHECK_SECONDS (default 480 s, the venv set-up included): a step is cut to the time left, and one
# that cannot get MIN_STEP_S seconds is skipped. OUTPUT-DIR/SUMMARY.txt lists each step's exit status and duration;
# each step's stdout and stderr are in OUTPUT-DIR/logs/<step>.out|.err unless the step names its own output file.
set -uo pipefail

OUT_DIR=${1:-${DEVICE_CHECK_OUT:-$PWD/device-check-out}}
TOTAL_S=${DEVICE_CHECK_SECONDS:-480}
MIN_STEP_S=${MIN_STEP_S:-10}
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
mkdir -p "$OUT_DIR/logs"
SUMMARY=$OUT_DIR/SUMMARY.txt
PY=.venv/bin/python
GW=.venv/bin/gpuwarden
TORCH_INSTALL_S=${TORCH_INSTALL_S:-270}
{
  printf 'device-check %s on %s (budget %ss)\n' "$(date -u +%FT%TZ)" "$(hostname)" "$TOTAL_S"
  echo "RC: 124/137 timed out, - skipped; preflight: 0 pass/warn, 1 fault, 2 undecided"
  printf '%-26s %5s %7s %6s  %s\n' STEP RC SECONDS LIMIT NOTE
} > "$SUMMARY"

left() { echo $((DEADLINE - $(date +%s))); }

note() {  # note STEP RC SECONDS LIMIT TEXT: one SUMMARY line
  printf '%-26s %5s %7s %6s  %s\n' "$1" "$2" "$3" "$4" "${5:-}" >> "$SUMMARY"
}

# step NAME CAP STDOUT-FILE|- CMD...: run CMD with a timeout of min(CAP, time left), in its own process group
# (timeout kills the tools it started too); "-" sends stdout to $OUT_DIR/logs/NAME.out.
step() {
  local name=$1 cap=$2 stdout=$3 limit t0 rc
  shift 3
  limit=$(left)
  ((cap < limit)) && limit=$cap
  if ((limit < MIN_STEP_S)); then
    note "$name" - 0 "$limit" "skipped: no time left"
    return 0
  fi
  [[ $stdout == - ]] && stdout=$OUT_DIR/logs/$name.out
  echo ">>> $name (limit ${limit}s): $*" >&2
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$stdout" 2> "$OUT_DIR/logs/$name.err"
  rc=$?
  local why=""
  ((rc == 124 || rc == 137)) && why="timed out"
  note "$name" "$rc" $(($(date +%s) - t0)) "$limit" "$why"
  echo "<<< $name: exit $rc" >&2
  return 0
}

# ---------------------------------------------------------------- environment
step env-host 20 - bash -c 'uname -a; python3 --version; nvidia-smi -L; df -h .; free -g; nproc'

# The README's test set-up (pip install -e '.[test]' torch==2.13.0), in two parts: gpuwarden first, then torch in
# the background while the steps that do not load torch run (only burnin and peer_p2p import it, and the
# full-level steps wait for it). The venv sees the system's packages, so a torch or NVML binding the machine
# already has serves. A .venv copied from another machine is used only when it imports gpuwarden, else rebuilt.
# Without a route to PyPI, pip installs from $WHEELHOUSE when it exists (prepare it where there is network:
# `pip download -d wheelhouse setuptools wheel nvidia-ml-py psutil prometheus-client pyudev`, and copy
# it to the node); with neither, nothing is installed, the steps that need gpuwarden fail, and nvidia-smi still runs.
WHEELHOUSE=${WHEELHOUSE:-$PWD/wheelhouse}
venv_ok() { "$PY" -c 'import gpuwarden.agent.cli.main' > /dev/null 2>&1; }
torch_ok() { "$PY" -c 'import torch' > /dev/null 2>&1; }
pip_from=(--retries 1 --timeout 15)
if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "${PYPI_PROBE_URL:-https://pypi.org/simple/pip/}" > /dev/null 2>&1; then
  note pypi 0 0 - "PyPI reachable"
elif [[ -d $WHEELHOUSE ]]; then
  pip_from=(--no-index --find-links "$WHEELHOUSE")
  note pypi 1 0 - "PyPI not reachable: installing from $WHEELHOUSE"
else
  pip_from=()
  note pypi 1 0 - "PyPI not reachable and no $WHEELHOUSE: nothing can be installed"
fi
if venv_ok; then
  note venv 0 0 - "reused the existing .venv"
elif ((${#pip_from[@]})); then
  step venv-create 60 - python3 -m venv --clear --system-site-packages .venv
  # Where python3 is itself a virtual environment (a CUDA image's Python often is), --system-site-packages
  # reaches only the base interpreter: a .pth file lets .venv see that environment's packages (torch, NVML).
  step venv-see-outer 20 - bash -c 'outer=$(python3 -c "import site, sys; print(site.getsitepackages()[0] if sys.prefix != sys.base_prefix else \"\")")
    [[ -z $outer ]] && { echo "python3 is not a virtual environment"; exit 0; }
    inner=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
    echo "$outer" > "$inner/outer-environment.pth"; echo "$inner/outer-environment.pth -> $outer"'
  step venv-install 150 - .venv/bin/pip install -q "${pip_from[@]}" -e '.[test]'
  venv_ok || step venv-install-no-test 120 - .venv/bin/pip install -q "${pip_from[@]}" -e .
fi
venv_ok || note venv-check 1 0 - "gpuwarden is not importable: see logs/venv-*.err"
torch_pid=
if torch_ok; then
  note venv-torch 0 0 - "torch already installed"
elif venv_ok && ((${#pip_from[@]})); then
  torch_t0=$(date +%s)
  (timeout -k 10 "$TORCH_INSTALL_S" .venv/bin/pip install -q "${pip_from[@]}" torch==2.13.0 \
     > "$OUT_DIR/logs/venv-torch.out" 2> "$OUT_DIR/logs/venv-torch.err"
   echo $? > "$OUT_DIR/logs/venv-torch.rc") &
  torch_pid=$!
fi
wait_torch() {
  [[ -n $torch_pid ]] || return 0
  wait "$torch_pid"
  note venv-torch "$(cat "$OUT_DIR/logs/venv-torch.rc" 2> /dev/null || echo '?')" $(($(date +%s) - torch_t0)) "$TORCH_INSTALL_S" \
    "in the background since the start"
  torch_pid=
}

# ---------------------------------------------------------------- one-shot, and the daemon: no torch needed
step gpuwarden-version 20 - "$GW" --version
step record 120 - "$GW" record --out "$OUT_DIR/recorded-node"
step preflight-quick 120 "$OUT_DIR/preflight-quick.json" "$GW" preflight --json
step nvidia-smi-q 60 "$OUT_DIR/nvidia-smi-q.txt" nvidia-smi -q
step nvidia-smi-topo-m 60 "$OUT_DIR/nvidia-smi-topo-m.txt" nvidia-smi topo -m
step replay-quick 60 "$OUT_DIR/replay-quick.json" "$GW" preflight --json --root "$OUT_DIR/recorded-node"

# ---------------------------------------------------------------- the daemon for ~30 s
daemon_check() {
  local port pid rc=0 i
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  timeout -k 5 90 "$GW" run --state-dir "$OUT_DIR/state" --listen "127.0.0.1:$port" \
    > "$OUT_DIR/logs/daemon.out" 2> "$OUT_DIR/logs/daemon.err" &
  pid=$!
  for i in $(seq 30); do
    sleep 1
    fetch "http://127.0.0.1:$port/metrics" > "$OUT_DIR/metrics-first.txt" 2> /dev/null && break
    kill -0 "$pid" 2> /dev/null || break
  done
  echo "first /metrics answer after ${i}s" >&2
  sleep $((30 - i > 0 ? 30 - i : 0))
  fetch "http://127.0.0.1:$port/metrics" > "$OUT_DIR/metrics.txt" || rc=1
  "$GW" status --state-dir "$OUT_DIR/state" --json > "$OUT_DIR/status.json" || rc=1
  kill -TERM "$pid" 2> /dev/null
  wait "$pid"
  echo "daemon exit status $?" >&2
  return "$rc"
}
fetch() {
  if command -v curl > /dev/null; then
    curl -sSf --max-time 10 "$1"
  else
    "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"
  fi
}
export -f daemon_check fetch
export OUT_DIR PY GW
step daemon-30s 75 - bash -c daemon_check

step bench-idle-live 100 "$OUT_DIR/bench-idle-live.txt" "$PY" bench/daemon.py idle --live --seconds 60

# ---------------------------------------------------------------- full level: GPUs loaded, torch needed
wait_torch
step env-python 30 - "$PY" -c 'import sys, torch, pynvml
print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.device_count()); pynvml.nvmlInit(); print("driver", pynvml.nvmlSystemGetDriverVersion())'
full_budget=$(($(left) - 90))  # leave time for record --with-tools
((full_budget > 240)) && full_budget=240
((full_budget < 30)) && full_budget=$(($(left) - 30))  # not enough for both: preflight full comes first
if ((full_budget >= 30)); then
  step preflight-full $((full_budget + 30)) "$OUT_DIR/preflight-full.json" \
    "$GW" preflight --json --level full --budget "$full_budget"
else
  note preflight-full - 0 "$full_budget" "skipped: no time left"
fi

# the full tools, recorded and replayed
tools_budget=$(($(left) - 45))
if ((tools_budget >= 30)); then
  step record-with-tools $((tools_budget + 20)) - \
    "$GW" record --out "$OUT_DIR/recorded-node-full" --with-tools --budget "$tools_budget"
  step replay-full 60 "$OUT_DIR/replay-full.json" "$GW" preflight --json --level full --check-timeout 20 \
    --root "$OUT_DIR/recorded-node-full"
else
  note record-with-tools - 0 "$tools_budget" "skipped: no time left"
fi

# ---------------------------------------------------------------- live vs replayed, per check
compare() {  # compare LIVE.json REPLAY.json: one line per check
  "$PY" - "$1" "$2" <<'EOF'
import json, sys
def statuses(path):
    try:
        return {r["check"]: r["status"] for r in json.load(open(path))["results"]}
    except (OSError, ValueError, KeyError) as exc:
        return {"(unreadable)": f"{path}: {exc}"}
live, replay = statuses(sys.argv[1]), statuses(sys.argv[2])
for check in dict.fromkeys([*live, *replay]):
    a, b = live.get(check, "-"), replay.get(check, "-")
    print(f"  {check:<16} live {a:<8} replay {b:<8} {'' if a == b else 'DIFFERS'}")
EOF
}
{
  echo
  echo "quick: live preflight vs the replayed recording"
  compare "$OUT_DIR/preflight-quick.json" "$OUT_DIR/replay-quick.json"
  echo "full: live preflight vs the replayed --with-tools recording (separate runs: figures may differ)"
  compare "$OUT_DIR/preflight-full.json" "$OUT_DIR/replay-full.json"
  echo
  echo "total $(($(date +%s) - START)) s"
} >> "$SUMMARY" 2>&1
cat "$SUMMARY"
