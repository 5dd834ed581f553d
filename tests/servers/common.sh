# Sourced by the test-server scripts beside it (POSIX sh).

# Stops the process whose pid is in PIDFILE, if any: SIGTERM, up to 5 s to exit, then SIGKILL;
# removes PIDFILE.
stop_process() {
  if [ -f "$1" ]; then
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
  fi
}
