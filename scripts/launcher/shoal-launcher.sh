#!/bin/sh
# shoal's double-click launcher, copied by scripts/make-launchers.sh into Shoal.app (macOS),
# Shoal.command (macOS Terminal) and beside shoal.desktop (Linux). If no node answers on the
# port it starts `shoal serve` (in the background, logging to a file; or, as Shoal.command or
# with --foreground, in this terminal), waits for /health, then opens the browser on the UI.
# `--stop` stops the node this launcher started. It installs nothing and never asks for root.
# Environment: SHOAL_PORT (52415), SHOAL_BIN (the binary), SHOAL_ARGS (more `shoal serve`
# arguments, split on spaces), SHOAL_HEALTH_TIMEOUT (seconds, 120), SHOAL_STATE_DIR (pid and
# log), BROWSER (Linux).
set -u

PORT="${SHOAL_PORT:-52415}"
URL="http://127.0.0.1:$PORT/"
HEALTH_TIMEOUT="${SHOAL_HEALTH_TIMEOUT:-120}"
HERE="$(cd "$(dirname "$0")" && pwd)"
OS="$(uname -s)"
# The repository's release build; make-launchers.sh writes the real path here.
REPO_BIN="@REPO_BIN@"

if [ "$OS" = Darwin ]; then
    STATE="${SHOAL_STATE_DIR:-$HOME/Library/Logs/Shoal}"
else
    STATE="${SHOAL_STATE_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/shoal}"
fi
LOG="$STATE/shoal.log"
PIDFILE="$STATE/shoal-$PORT.pid"
# Apps started from Finder or a desktop menu get a short PATH; add the usual install places.
PATH="$PATH:$HOME/.cargo/bin:$HOME/.local/bin:/usr/local/bin:/opt/homebrew/bin"
export PATH

MODE=background
case "$(basename "$0")" in *.command) MODE=foreground ;; esac
case "${1:-}" in
    --foreground) MODE=foreground ;;
    --stop) MODE=stop ;;
    "") ;;
    *) echo "usage: $(basename "$0") [--foreground | --stop]" >&2; exit 2 ;;
esac

# Text made safe inside an AppleScript string literal (no quotes or backslashes).
as_text() { printf '%s' "$1" | tr -d '\042\134'; }

say() {
    echo "shoal launcher: $1" >&2
    if [ "$OS" = Darwin ]; then
        command -v osascript >/dev/null 2>&1 &&
            osascript -e "display notification \"$(as_text "$1")\" with title \"Shoal\"" >/dev/null 2>&1
    elif command -v notify-send >/dev/null 2>&1; then
        notify-send Shoal "$1" >/dev/null 2>&1
    fi
    return 0
}

fail() {
    say "$1"
    if [ "$OS" = Darwin ] && [ "$MODE" = background ] && command -v osascript >/dev/null 2>&1; then
        osascript -e "display alert \"Shoal could not start\" message \"$(as_text "$1")\"" >/dev/null 2>&1
    fi
    exit 1
}

# True when a shoal node answers /health on the port with {"status": "ok"}.
healthy() {
    if command -v curl >/dev/null 2>&1; then
        body="$(curl -fsS -m 2 "${URL}health" 2>/dev/null)" || return 1
    elif command -v wget >/dev/null 2>&1; then
        body="$(wget -q -T 2 -O - "${URL}health" 2>/dev/null)" || return 1
    elif command -v python3 >/dev/null 2>&1; then
        body="$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())' "${URL}health" 2>/dev/null)" || return 1
    else
        return 1
    fi
    case "$body" in *'"ok"'*) return 0 ;; *) return 1 ;; esac
}

open_url() {
    if [ "$OS" = Darwin ]; then
        open "$1"
    elif [ -n "${BROWSER:-}" ]; then
        # BROWSER may list several commands separated by colons; use the first.
        ${BROWSER%%:*} "$1"
    elif command -v xdg-open >/dev/null 2>&1; then
        xdg-open "$1"
    elif command -v gio >/dev/null 2>&1; then
        gio open "$1"
    else
        say "shoal is running: open $1 in your browser"
    fi
}

find_shoal() {
    for c in "${SHOAL_BIN:-}" "$HERE/shoal" "$HERE/Shoal.app/Contents/MacOS/shoal"; do
        if [ -n "$c" ] && [ -f "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
    done
    if command -v shoal >/dev/null 2>&1; then command -v shoal; return 0; fi
    for c in "$REPO_BIN" "$HERE/../../target/release/shoal"; do
        if [ -f "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
    done
    return 1
}

# Waits for /health; with a pid, gives up early if that process dies.
wait_healthy() {
    waited=0
    while [ "$waited" -lt "$((HEALTH_TIMEOUT * 5))" ]; do
        healthy && return 0
        if [ -n "${1:-}" ] && ! kill -0 "$1" 2>/dev/null; then return 1; fi
        sleep 0.2 2>/dev/null || sleep 1
        waited=$((waited + 1))
    done
    return 1
}

if [ "$MODE" = stop ]; then
    [ -f "$PIDFILE" ] || { echo "shoal launcher: no node started by the launcher on port $PORT" >&2; exit 0; }
    pid="$(cat "$PIDFILE")"
    case "$pid" in ''|*[!0-9]*) rm -f "$PIDFILE"; exit 0 ;; esac
    # The pid may have been reused since: only stop a process that is shoal.
    case "$(ps -p "$pid" -o comm= 2>/dev/null)" in *shoal*) ;; *) rm -f "$PIDFILE"; exit 0 ;; esac
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        i=0
        while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 50 ]; do sleep 0.2 2>/dev/null || sleep 1; i=$((i + 1)); done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$PIDFILE"
    exit 0
fi

if healthy; then
    open_url "$URL"
    exit 0
fi

SHOAL="$(find_shoal)" || fail "the shoal binary was not found: install it on the PATH, set SHOAL_BIN, or build it with cargo build --release"
mkdir -p "$STATE" || fail "cannot create $STATE"

if [ "$MODE" = foreground ]; then
    echo "Starting $SHOAL serve on port $PORT; the UI opens at $URL when it is up. Ctrl+C stops it."
    # $$ is this shell's pid, which shoal keeps after the exec: the waiter ends if shoal does.
    ( wait_healthy "$$" && open_url "$URL" ) &
    # shellcheck disable=SC2086 # SHOAL_ARGS is split on purpose
    exec "$SHOAL" serve --api-port "$PORT" ${SHOAL_ARGS:-}
fi

# shellcheck disable=SC2086 # SHOAL_ARGS is split on purpose
nohup "$SHOAL" serve --api-port "$PORT" ${SHOAL_ARGS:-} >>"$LOG" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$PIDFILE"
if ! wait_healthy "$pid"; then
    tail_of_log="$(tail -n 5 "$LOG" 2>/dev/null | tr '\n' ' ')"
    rm -f "$PIDFILE"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null
        fail "shoal did not answer on $URL within ${HEALTH_TIMEOUT}s (log: $LOG): $tail_of_log"
    fi
    fail "shoal stopped at start (log: $LOG): $tail_of_log"
fi
open_url "$URL"
exit 0
