#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Issue 24 item 2: one namespace per host, as flock users expect. With the host-wide directory
# the Debian package makes (/run/lock/turnstile: root's, setgid, mode 2770, group turnstile),
# root and a member of its group exclude each other on the same name through the default
# backend; a user outside the group keeps a private default, and is refused clearly when naming
# the shared directory; -v says which directory is used, and under sudo a notice says so when
# the default is private. Runs in a mount namespace of its own, on a tmpfs over /run/lock: the
# machine's own /run/lock is never touched.
#   host_namespace_test.sh CLI      (as root; exits 77, skipped, otherwise)
set -eu
cli=$1
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (setpriv, a mount namespace)"; exit 77; }
if [ -z "${TURNSTILE_TEST_NAMESPACED:-}" ]; then
  TURNSTILE_TEST_NAMESPACED=1 exec unshare -m "$0" "$@"
fi
mount --make-rprivate /
mount -t tmpfs -o mode=1777,size=4m turnstile-test /run/lock
unset TURNSTILE_BACKEND SUDO_UID
work=$(mktemp -d /tmp/turnstile-namespace-XXXXXX)
chmod 0777 "$work"
holder=""
cleanup() {
  [ -z "$holder" ] || kill "$holder" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
gid=64123  # any group: the directory's properties make it shared, not the group's name
nobody=65534
# Commands, not functions: `$who "$cli" ... &` must make $! the turnstile process itself.
as_member="setpriv --reuid=$nobody --regid=$nobody --groups=$gid"
as_outsider="setpriv --reuid=$nobody --regid=$nobody --clear-groups"

# hold_as WHO NAME: WHO holds NAME on the default backend, in the background until `release`.
hold_as() {
  rm -f "$work/held"
  $1 "$cli" run --lock "$2" -- sh -c "touch $work/held; exec sleep 60" &
  holder=$!
  for _ in $(seq 100); do [ -e "$work/held" ] && return 0; sleep 0.05; done
  fail "$1 did not get $2"
}
release() {
  kill "$holder"
  wait "$holder" || true
  holder=""
}
# status WHO ARGS...: the exit status of the command run as WHO (env [VAR=...], $as_member,
# $as_outsider), its stderr in $work/err.
status() {
  who=$1
  shift
  code=0
  $who "$cli" "$@" 2>"$work/err" || code=$?
  echo "$code"
}

# No host-wide directory: the private defaults, as before; under sudo, a notice.
SUDO_UID=1000 "$cli" run -v --lock plain -- true 2>"$work/err"
grep -q "note: under sudo this is uid 0's private namespace (file:///run/lock/turnstile-0)" "$work/err" ||
  fail "no sudo notice with a private default: $(cat "$work/err")"
grep -q "using file:///run/lock/turnstile-0 (uid 0's private namespace" "$work/err" ||
  fail "-v does not name the private directory: $(cat "$work/err")"

install -d -o root -g $gid -m 2770 /run/lock/turnstile

# Root holds: a member of the group is kept out, through the default and through file://.
hold_as env shared/job
[ "$(status "$as_member" run --timeout 0 --lock shared/job -- true)" = 75 ] ||
  fail "a member got shared/job while root held it: $(cat "$work/err")"
[ "$(status "$as_member" run --timeout 0 --backend file:// --lock shared/job -- true)" = 75 ] ||
  fail "a member got shared/job through file:// while root held it: $(cat "$work/err")"
# A user outside the group: the private default (not kept out), and a clear refusal by name.
[ "$(status "$as_outsider" run -v --timeout 0 --lock shared/job -- true)" = 0 ] ||
  fail "an outsider could not use its private default: $(cat "$work/err")"
grep -q "using file:///run/lock/turnstile-$nobody (uid $nobody's private namespace" "$work/err" ||
  fail "-v does not name the outsider's directory: $(cat "$work/err")"
[ "$(status "$as_outsider" run --timeout 0 --backend file:///run/lock/turnstile --lock shared/job -- true)" = 77 ] ||
  fail "an outsider naming the shared directory was not refused with 77: $(cat "$work/err")"
grep -q "refusing /run/lock/turnstile: it is shared by group gid $gid, and this user (uid $nobody) is not in it" \
  "$work/err" || fail "the outsider's refusal does not say why: $(cat "$work/err")"
release

# A member holds: root is kept out; root's -v names the host-wide directory; no sudo notice.
hold_as "$as_member" shared/job
[ "$(status "env SUDO_UID=1000" run -v --timeout 0 --lock shared/job -- true)" = 75 ] ||
  fail "root got shared/job while a member held it: $(cat "$work/err")"
grep -q "using file:///run/lock/turnstile (the host-wide namespace" "$work/err" ||
  fail "-v does not name the host-wide directory: $(cat "$work/err")"
! grep -q "note: under sudo" "$work/err" || fail "a sudo notice with the host-wide default: $(cat "$work/err")"
# Every state file there belongs to the group, writable by it, not by others: looked at while
# held (a name's file is removed once nobody uses it).
files=$(find /run/lock/turnstile -maxdepth 1 -type f -name 'n.*')
[ -n "$files" ] || fail "no state file in /run/lock/turnstile while shared/job is held"
for file in $files; do
  [ "$(stat -c %g "$file")" = $gid ] || fail "$file is not the group's"
  case "$(stat -c %a "$file")" in 660) ;; *) fail "$file is mode $(stat -c %a "$file"), not 660" ;; esac
done
release
[ "$(status env run --timeout 0 --lock shared/job -- true)" = 0 ] || fail "root could not take shared/job after: $(cat "$work/err")"

# Misconfigured by hand (red team: 2777, 0770 without setgid, 2750, a member's): root and the
# members are refused (77, saying what is wrong) rather than split into private namespaces; an
# outsider keeps its private default.
for change in 2777:2777 g-s:0770 2750:2750; do  # CHMOD-ARGUMENT:THE-MODE-IT-MAKES
  mode=${change#*:}
  chmod 2770 /run/lock/turnstile
  chmod "${change%%:*}" /run/lock/turnstile  # a numeric mode keeps a directory's setgid: g-s
  [ "$(status env run --timeout 0 --lock split/job -- true)" = 77 ] ||
    fail "root used a host-wide directory of mode $mode: $(cat "$work/err")"
  grep -q "the host-wide directory /run/lock/turnstile is owned by uid 0 with mode $mode" "$work/err" ||
    fail "root's refusal (mode $mode) does not say why: $(cat "$work/err")"
  [ "$(status "$as_member" run --timeout 0 --lock split/job -- true)" = 77 ] ||
    fail "a member used a host-wide directory of mode $mode: $(cat "$work/err")"
done
[ "$(status "$as_outsider" run --timeout 0 --lock split/job -- true)" = 0 ] ||
  fail "an outsider lost its private default to a misconfigured host-wide directory: $(cat "$work/err")"
chmod 2770 /run/lock/turnstile
chown $nobody /run/lock/turnstile
[ "$(status "$as_member" run --timeout 0 --lock split/job -- true)" = 77 ] ||
  fail "a member used a host-wide directory a member owns: $(cat "$work/err")"
chown root /run/lock/turnstile
chmod 2770 /run/lock/turnstile

echo "root and the group's members share the host-wide namespace; outsiders keep a private one"
