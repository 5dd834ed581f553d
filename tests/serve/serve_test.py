#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""`turnstile serve` as a person would use it, against one backend.

  serve_test.py CLI FAMILY [URL-FILE] [--browser] [--screenshot PNG]
  serve_test.py CLI file --scene PNG   (the README's picture: a few jobs, a deploy, a pool)

Starts `turnstile serve` on a free loopback port, takes a hold and queues a waiter with
`turnstile hold`, and checks what /state.json, /metrics (parsed by python3-prometheus-client's
parser) and the page show; the waiter then gets the name when the holder lets go. The names hold
HTML's metacharacters (they must arrive escaped), and a URL with credentials (redis: an ACL user
made for the test; consul: a token) must show them nowhere. With --browser, headless Chromium
loads the page, a waiter queued after it loaded must appear through the live stream, and a
screenshot of the page must show something (decoded here: several colours, dark text). On
redis, the test's user is then removed: the failed looks must show on the page and in /metrics,
without the password, and serving must recover once the user is back.

FAMILY file makes a fresh directory; the others read the fixture server's URL from URL-FILE.
Exits 0 when every check passed, 1 otherwise (saying which).
"""
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib

from prometheus_client.parser import text_string_to_metric_families

WAIT = 90  # seconds any one expected state may take to show, on a loaded machine
SECRET = "s3cret-serve-pw"
MAX_LIVE_PAGES = 3


class Failure(Exception):
    pass


def eventually(what, check, timeout=WAIT):
    """check()'s first true value, asked every 0.1 s; Failure after `timeout` seconds."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError, KeyError) as error:
            last = error
        time.sleep(0.1)
    raise Failure(f"{what}: not within {timeout} s (last error: {last})")


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=20) as response:
        return response.read().decode("utf-8")


def read_line(process, what, timeout=WAIT):
    """The first line `process` prints on stdout, within `timeout` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise Failure(f"{what} printed nothing within {timeout} s")
    line = process.stdout.readline().decode().strip()
    if not line:
        raise Failure(f"{what} ended without printing (exit {process.wait()})")
    return line


class Scene:
    """The serve process and the holds the test takes, all ended by close()."""

    def __init__(self, cli, url, prefix):
        self.cli, self.url, self.prefix = cli, url, prefix
        self.holds = []
        self.open_page = None  # a live page left open over SIGTERM
        self.closed = False
        self.serve = subprocess.Popen(
            [cli, "serve", "--backend", url, "--listen", "127.0.0.1:0", "--interval", "0.2", "--name-label",
             "--max-live-pages", str(MAX_LIVE_PAGES), prefix],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = read_line(self.serve, "turnstile serve")
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+/)", line)
        if not found:
            raise Failure(f"turnstile serve said {line!r}, not the address it listens on")
        self.base = found.group(1)

    def hold(self, name, label, *options, wait_until_held=True):
        """A `turnstile hold` on `name`; with wait_until_held, once its token is printed."""
        process = subprocess.Popen(
            [self.cli, "hold", "--backend", self.url, "--holder-label", label, *options, name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.holds.append(process)
        if wait_until_held:
            token = read_line(process, f"turnstile hold {name}")
            if not token.isdigit():
                raise Failure(f"turnstile hold {name} printed {token!r}, not a fencing token")
        return process

    def state(self):
        return json.loads(get(self.base, "state.json"))

    def close_quietly(self):
        """close() when something else failed first: its own findings are not reported."""
        try:
            self.close()
        except Failure:
            pass

    def close(self):
        if self.closed:
            return
        self.closed = True
        for process in self.holds:
            if process.poll() is None:
                process.stdin.close()
        for process in self.holds:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
        try:
            status = self.serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.serve.kill()
            self.serve.wait()
            raise Failure("turnstile serve did not end within 30 s of SIGTERM")
        if self.open_page:
            self.open_page.close()
        errors = self.serve.stderr.read().decode(errors="replace")
        if SECRET in errors:
            raise Failure("turnstile serve's stderr shows the password")
        if status != 0:
            raise Failure(f"turnstile serve exited {status} after SIGTERM: {errors}")


def queue_of(state, name):
    for queue in state["names"]:
        if queue["name"] == name:
            return queue
    return None


def labels(entries):
    return [entry["label"] for entry in entries]


def check_metrics(scene, name, holders, waiters):
    text = get(scene.base, "metrics")
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise Failure(f"/metrics repeats the families {sorted(duplicates)}")
    # The serving client's own metrics (Client::metrics()) come after the backend's gauges.
    missing = {"turnstile_acquire_wait_seconds", "turnstile_connections", "turnstile_serve_polls"} - set(names)
    if missing:
        raise Failure(f"/metrics lacks the families {sorted(missing)}")
    values = {}
    for family in families:
        for sample in family.samples:
            values[(sample.name, sample.labels.get("name"))] = sample.value
    expected = {("turnstile_backend_up", None): 1, ("turnstile_backend_holders", None): holders,
                ("turnstile_backend_waiters", None): waiters, ("turnstile_backend_name_holders", name): holders,
                ("turnstile_backend_name_waiters", name): waiters}
    for key, value in expected.items():
        if values.get(key) != value:
            raise Failure(f"/metrics: {key} is {values.get(key)}, expected {value}")
    if values.get(("turnstile_backend_longest_hold_seconds", None), -1) < 0:
        raise Failure("/metrics has no turnstile_backend_longest_hold_seconds")
    return text


def check_page(scene, name, holder_label):
    page = get(scene.base, "")
    escaped = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    escaped = escaped.replace('"', "&quot;").replace("'", "&#39;")
    if escaped not in page:
        raise Failure(f"the page does not show the name escaped ({escaped!r})")
    if "<b>" in page:
        raise Failure("the page shows a name's <b> unescaped")
    if "&lt;i&gt;" not in page or holder_label.split("<")[0] not in page:
        raise Failure("the page does not show the holder's label, escaped")
    return page


def check_state_and_metrics(scene):
    name = scene.prefix + "jobs/<b>&\"q'"
    holder_label = "first <i>&holder"
    scene.hold(name, holder_label)
    scene.hold(name, "second in line", wait_until_held=False)

    def queued():
        queue = queue_of(scene.state(), name)
        return queue and labels(queue["holders"]) == [holder_label] and labels(queue["waiters"]) == ["second in line"]
    eventually("/state.json showing the holder and the waiter", queued)
    state = scene.state()
    if state["error"] is not None or SECRET in json.dumps(state) or SECRET in state["backend"]:
        raise Failure(f"/state.json: error {state['error']!r}, or the password shown")
    holder = queue_of(state, name)["holders"][0]
    if holder["pid"] is None or holder["fencing_token"] <= 0 or holder["since"] is None:
        raise Failure(f"/state.json: the holder lacks its pid, token or start: {holder}")
    shown = [check_metrics(scene, name, 1, 1), check_page(scene, name, holder_label), json.dumps(state),
             first_event(scene.base)]
    if any(SECRET in text for text in shown):
        raise Failure("the password appears in /metrics, the page, /state.json or /events")
    # The holder lets go: the waiter holds, nobody waits.
    scene.holds[0].stdin.close()

    def handed_over():
        queue = queue_of(scene.state(), name)
        return queue and labels(queue["holders"]) == ["second in line"] and not queue["waiters"]
    eventually("/state.json showing the waiter holding once the holder let go", handed_over)
    check_metrics(scene, name, 1, 0)


def check_listen_refusals(cli, url):
    """Addresses that are not loopback are refused without --allow-remote, with exit 64."""
    for address in ("0.0.0.0:0", "[::]:0", "192.168.1.10:0", "example.org:0", "127.0.0.1:70000"):
        done = subprocess.run([cli, "serve", "--backend", url, "--listen", address], capture_output=True,
                              timeout=60, text=True)
        if done.returncode != 64 or "--listen" not in done.stderr and "--allow-remote" not in done.stderr:
            raise Failure(f"serve --listen {address}: exit {done.returncode}, {done.stderr!r}")


def check_port_taken(scene):
    """A second serve on the port in use fails (71) instead of sharing it (SO_REUSEPORT)."""
    address = scene.base[len("http://"):].rstrip("/")
    done = subprocess.run([scene.cli, "serve", "--backend", scene.url, "--listen", address], capture_output=True,
                          timeout=60, text=True)
    if done.returncode != 71 or "cannot listen on" not in done.stderr:
        raise Failure(f"a second serve on {address}: exit {done.returncode}, {done.stderr!r}")


def check_guards(scene):
    """A request for another host name is refused (DNS rebinding); live pages are bounded."""
    # The second passed for 127.0.0.1 while the header was cut at its last colon.
    for host in ["rebound.example:80", "127.0.0.1:1@rebound.example"]:
        request = urllib.request.Request(scene.base + "state.json", headers={"Host": host})
        try:
            urllib.request.urlopen(request, timeout=20)
            raise Failure(f"a request with Host: {host} was answered")
        except urllib.error.HTTPError as error:
            if error.code != 421:
                raise Failure(f"a request with Host: {host} got {error.code}, not 421")
    # Two Host headers, loopback first (rt29 F4: the first one decided): a malformed request.
    address = scene.base[len("http://"):].rstrip("/")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=20) as raw:
        raw.sendall(f"GET /state.json HTTP/1.1\r\nHost: {address}\r\nHost: rebound.example\r\n"
                    "Connection: close\r\n\r\n".encode())
        status_line = raw.makefile("rb").readline().decode(errors="replace")
    if " 421 " not in status_line:
        raise Failure(f"a request with two Host headers got {status_line.strip()!r}, not 421")
    # The browser's pages went away: their places are free once a write finds them gone.
    eventually("the browser's live pages closed", lambda: scene.state()["live_pages"] == 0)
    streams = [urllib.request.urlopen(scene.base + "events", timeout=20) for _ in range(MAX_LIVE_PAGES)]
    try:
        urllib.request.urlopen(scene.base + "events", timeout=20)
        raise Failure(f"a live page beyond --max-live-pages {MAX_LIVE_PAGES} was served")
    except urllib.error.HTTPError as error:
        if error.code != 503:
            raise Failure(f"a live page beyond the bound got {error.code}, not 503")
    for stream in streams[1:]:
        stream.close()
    # One page stays open: SIGTERM must still end serve promptly and cleanly (Scene.close).
    scene.open_page = streams[0]


def check_backend_failure(scene):
    """redis: the test's user removed, looks fail: the page and /metrics say so (without the
    password); the user made again, serving recovers."""
    user, host, port = re.match(r"redis://([^:]+):[^@]+@([^:/]+):(\d+)", scene.url).groups()
    redis_cli = ["redis-cli", "-h", host, "-p", port, "ACL"]
    subprocess.run(redis_cli + ["DELUSER", user], check=True, stdout=subprocess.DEVNULL)
    state = eventually("/state.json showing the failed look", lambda: (s := scene.state())["error"] and s)
    metrics, page = get(scene.base, "metrics"), get(scene.base, "")
    if "turnstile_backend_up 0\n" not in metrics or '<p class="error">' not in page:
        raise Failure("a failed look shows neither in /metrics (turnstile_backend_up 0) nor on the page")
    if any(SECRET in text for text in (metrics, page, json.dumps(state))):
        raise Failure("the password appears with the failed look")
    subprocess.run(redis_cli + ["SETUSER", user, "on", ">" + SECRET, "~*", "&*", "+@all"], check=True,
                   stdout=subprocess.DEVNULL)
    eventually("/state.json recovering once the user is back", lambda: scene.state()["error"] is None)


def first_event(base):
    """The first message of /events (its data lines joined)."""
    with urllib.request.urlopen(base + "events", timeout=20) as response:
        if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
            raise Failure("/events is not an event stream")
        lines = []
        while True:
            line = response.readline().decode("utf-8")
            if line in ("\n", ""):
                return "\n".join(lines)
            if line.startswith("data: "):
                lines.append(line[len("data: "):].rstrip("\n"))


SCRATCH = tempfile.mkdtemp(prefix="serve-test-")  # removed at exit: profiles, pictures, file:// dirs


def chromium(*arguments):
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--user-data-dir=" + tempfile.mkdtemp(prefix="chromium-", dir=SCRATCH), *arguments]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)


def finish(browser, what, timeout=180):
    try:
        out, _ = browser.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait()
        raise Failure(f"chromium ({what}) did not end within {timeout} s")
    if browser.returncode != 0:
        raise Failure(f"chromium ({what}) exited {browser.returncode}")
    return out.decode("utf-8", errors="replace")


def check_in_browser(scene, screenshot):
    """The page in headless Chromium: the state on load, then a waiter queued after it loaded."""
    name = scene.prefix + "deploy/web <prod>"
    scene.hold(name, "deploy 1841 (ci)")
    eventually("/state.json showing the deploy holder", lambda: queue_of(scene.state(), name))
    # ?updates=2: the state when the stream opened, then the change; then the page stops
    # following, the network goes quiet and Chromium's virtual time runs out: it prints the DOM.
    browser = chromium("--dump-dom", "--virtual-time-budget=4000", scene.base + "?updates=2")
    eventually("Chromium following the live stream", lambda: scene.state()["live_pages"] >= 1)
    scene.hold(name, "deploy 1842 (ci)", wait_until_held=False)
    dom = finish(browser, "--dump-dom")
    rows = re.findall(r'<tr class="(holder|waiter)">(.*?)</tr>', dom)
    if not any(kind == "holder" and "deploy 1841 (ci)" in row for kind, row in rows):
        raise Failure("Chromium's DOM does not show the holder")
    if not any(kind == "waiter" and "deploy 1842 (ci)" in row for kind, row in rows):
        raise Failure("Chromium's DOM does not show the waiter queued after the page loaded")
    if "stopped after 2 updates" not in dom or "deploy/web &lt;prod&gt;" not in dom:
        raise Failure("Chromium's DOM lacks the live note or the escaped name")
    eventually("the live page's stream closed", lambda: scene.state()["live_pages"] == 0)
    take_screenshot(scene, screenshot)


def take_screenshot(scene, path):
    browser = chromium("--screenshot=" + path, "--window-size=1000,720", "--hide-scrollbars",
                       "--virtual-time-budget=2000", scene.base + "?updates=1")
    finish(browser, "--screenshot")
    width, height, colours, dark = png_summary(path)
    if width != 1000 or height != 720 or colours < 5 or dark < 500:
        raise Failure(f"the screenshot looks empty: {width}x{height}, {colours} colours, {dark} dark pixels")


def png_summary(path):
    """(width, height, distinct colours, dark pixels) of an 8-bit RGB or RGBA PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise Failure(f"{path} is not a PNG")
    chunks, at = {}, 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        chunks.setdefault(kind, b"")
        chunks[kind] += data[at + 8:at + 8 + length]
        at += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    if depth != 8 or colour_type not in (2, 6):
        raise Failure(f"{path}: a PNG of depth {depth}, colour type {colour_type}: not read here")
    channels = 3 if colour_type == 2 else 4
    rows = unfilter(zlib.decompress(chunks[b"IDAT"]), width, height, channels)
    colours, dark = set(), 0
    for row in rows:
        for x in range(0, width * channels, channels):
            pixel = bytes(row[x:x + 3])
            colours.add(pixel)
            dark += sum(pixel) < 200
    return width, height, len(colours), dark


def unfilter(raw, width, height, channels):
    """The PNG scanlines with their filters undone (PNG spec, section 9)."""
    stride = width * channels
    rows, previous, at = [], bytearray(stride), 0
    for _ in range(height):
        kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
        at += 1 + stride
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, up_left = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else up_left)) & 255
        rows.append(line)
        previous = line
    return rows


def take_scene(cli, path):
    """A screenshot of the page over a day's holds and waiters: the README's picture."""
    scene = Scene(cli, "file://" + tempfile.mkdtemp(prefix="scene-", dir=SCRATCH), "")
    try:
        scene.hold("jobs/nightly-backup", "backup db1 (cron)")
        scene.hold("deploy/web-prod", "deploy #1841 by ci")
        for worker in range(1, 4):
            scene.hold("pool/db-connections", f"importer {worker}", "--limit", "3", "--semaphore")
        time.sleep(2)  # the waiters' ages then differ from the holders' (for the picture only)
        scene.hold("jobs/nightly-backup", "report app2 (cron)", wait_until_held=False)
        scene.hold("jobs/nightly-backup", "vacuum db1 (cron)", wait_until_held=False)
        scene.hold("deploy/web-prod", "deploy #1842 by ci", wait_until_held=False)
        scene.hold("pool/db-connections", "importer 4", "--limit", "3", "--semaphore", wait_until_held=False)
        eventually("the scene's four waiters queued",
                   lambda: sum(len(q["waiters"]) for q in scene.state()["names"]) == 4)
        browser = chromium("--screenshot=" + path, "--window-size=900,1130", "--hide-scrollbars",
                           "--virtual-time-budget=2000", scene.base + "?updates=1")
        finish(browser, "--screenshot")
    finally:
        scene.close()


def backend_url(family, url_file, cli):
    """The URL to serve, with credentials where the fixture can check them."""
    if family == "file":
        return "file://" + tempfile.mkdtemp(prefix="backend-", dir=SCRATCH)
    url = open(url_file).read().strip()
    if family == "redis":
        host, port = re.match(r"redis://([^:/]+):(\d+)", url).groups()
        user = f"serve_test_{os.getpid()}"
        subprocess.run(["redis-cli", "-h", host, "-p", port, "ACL", "SETUSER", user, "on", ">" + SECRET, "~*", "&*",
                        "+@all"], check=True, stdout=subprocess.DEVNULL)
        return url.replace("redis://", f"redis://{user}:{SECRET}@", 1)
    if family == "consul":  # the test server is open: any token passes
        return url.replace("consul://", f"consul://{SECRET}@", 1)
    return url


def main():
    args = sys.argv[1:]
    browser = "--browser" in args
    screenshot = None
    if "--screenshot" in args:
        screenshot = args[args.index("--screenshot") + 1]
        args = [a for a in args if a not in ("--screenshot", screenshot)]
    args = [a for a in args if a != "--browser"]
    cli, family = args[0], args[1]
    if "--scene" in args:
        take_scene(cli, args[args.index("--scene") + 1])
        return 0
    url = backend_url(family, args[2] if len(args) > 2 else None, cli)
    prefix = f"serve-test-{os.getpid()}-{int(time.time())}/"
    scene = Scene(cli, url, prefix)
    try:
        run_checks(scene, family, cli, url, browser, screenshot)
        scene.close()
        print(f"ok ({family})")
        return 0
    except Failure as failure:
        print(f"FAIL ({family}): {failure}")
        return 1
    finally:
        scene.close_quietly()  # no serve or hold left behind, whatever went wrong
        if family == "redis":  # the fixture's server is shared: the test's user goes, after its holds
            user, host, port = re.match(r"redis://([^:]+):[^@]+@([^:/]+):(\d+)", url).groups()
            subprocess.run(["redis-cli", "-h", host, "-p", port, "ACL", "DELUSER", user], stdout=subprocess.DEVNULL)


def run_checks(scene, family, cli, url, browser, screenshot):
    check_state_and_metrics(scene)
    if browser:
        check_in_browser(scene, screenshot or os.path.join(SCRATCH, "page.png"))
    check_guards(scene)
    if family == "redis":
        check_backend_failure(scene)
    if family == "file":
        check_listen_refusals(cli, url)
        check_port_taken(scene)


if __name__ == "__main__":
    try:
        status = main()
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
    sys.exit(status)
