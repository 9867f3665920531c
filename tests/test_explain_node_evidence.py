"""Node evidence for `gpuwarden explain`: the real daemon (`gpuwarden run` on the recorded tray that runs Slurm job
4242, fixtures/nodes/gb200-nvl72-job, in its default dry-run) serves its findings, transitions and job intents over a
window on /api/v1/findings; an XID 79 injected into its kernel log is in a window that holds it and not in one before
it; bad windows are 400s; with a web config the same TLS and basic auth as /metrics guard it. fetch_nodes reads it
back over HTTP and names the nodes it could not read (refused, silent, 404, not JSON, another schema, 401, TLS);
read_dirs reads the daemon's store once it has stopped, a `gpuwarden record` folder, and says which path could not
be read (garbage, a truncated copy)."""
from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import NODES, ROOT, append_kmsg, end_processes, wait_for
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
from gpuwarden.agent.jobs import evidence_window
from gpuwarden.agent.jobs.evidence_saved import read_dirs
from gpuwarden.agent.jobs.node_evidence import DocumentError, fetch_nodes, from_document
from gpuwarden.agent.state.store import Store
from test_daemon import XID79, free_port
from test_http_endpoint import certs, hashed  # noqa: F401 - certs is a fixture used here

SCENARIO = "gb200-nvl72-job"
GPU0_PCI = "0008:01:00.0"  # the GPU of the XID79 line (PCI:0008:01:00), NVML index 0 on this tray
HOSTNAME = "gb200-rack07-tray05"  # node.toml of the tray


def start(root: Path, state: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(state), "--listen", f"127.0.0.1:{port}", "--log-format", "json", *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def get(url: str, method: str = "GET", headers: dict | None = None, context: ssl.SSLContext | None = None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _answers(url: str, code: int, context: ssl.SSLContext | None = None) -> bool:
    """Whether the endpoint is up and answers `code` (False while nothing listens yet)."""
    try:
        return get(url, context=context)[0] == code
    except OSError:
        return False


class Daemon:
    """The daemon run by the module, and what the tests need of it."""

    def __init__(self, root: Path, state: Path, port: int, proc: subprocess.Popen):
        self.root, self.state, self.port, self.proc = root, state, port, proc
        self.url = f"http://127.0.0.1:{port}"
        self.before_xid = self.xid_at = 0.0

    def window(self, since: float, until: float | None = None) -> dict:
        query = f"since={since!r}" + (f"&until={until!r}" if until is not None else "")
        code, headers, body = get(f"{self.url}/api/v1/findings?{query}")
        assert code == 200 and headers["Content-Type"] == "application/json", body[:300]
        return json.loads(body)

    def stop(self) -> None:
        end_processes(self.proc)


def xid79(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if f["check"] == "xid" and f["code"] == "79"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The real daemon on a copy of the job's tray: started, its kernel log read, then an XID 79 on GPU 0 (the job's)
    appended and judged (the node quarantined, the job intent made and ended in dry-run)."""
    tmp = tmp_path_factory.mktemp("explain-daemon")
    root, state, port = tmp / SCENARIO, tmp / "state", free_port()
    shutil.copytree(NODES / SCENARIO, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    d = Daemon(root, state, port, start(root, state, port))
    try:
        wait_for(lambda: _answers(f"{d.url}/", 200), timeout_s=60, what="the endpoint")

        def read(what: str):
            store = Store(state / "state.db", readonly=True)
            try:
                return store.check("xid") if what == "xid" else store.intents()
            finally:
                store.close()

        wait_for(lambda: (state / "state.db").exists() and read("xid"), timeout_s=60, what="the kernel log read")
        d.before_xid = time.time()
        time.sleep(0.05)  # the XID's time is its judgement's: after this on any clock resolution
        append_kmsg(root, XID79)
        wait_for(lambda: any(i["action"] == "job" and i["done"] for i in read("intents")), timeout_s=60,
                 what="the job intent ended")
        d.xid_at = xid79(d.window(d.before_xid))[0]["first_at"]
        yield d
    finally:
        d.stop()


# -- the endpoint ------------------------------------------------------------------------------------------------
def test_explain_window_holds_the_xid_79_with_the_gpus_pci_and_index(daemon):
    doc = daemon.window(daemon.before_xid)
    assert doc["schema"] == 1 and doc["node"] == HOSTNAME and doc["truncated"] is False
    assert doc["until"] >= doc["since"] == daemon.before_xid  # until: now
    (f,) = xid79(doc)
    assert f["status"] == "FAIL" and f["action"] == "REBOOT"
    assert f["entity"]["kind"] == "gpu" and f["entity"]["pci"] == GPU0_PCI and f["entity"]["index"] == 0
    assert f["entity"]["id"].startswith("GPU-")
    # The incident's own wall-clock times, as the xid check's state keeps them.
    assert daemon.before_xid <= f["first_at"] <= f["last_at"] <= doc["generated_at"]
    assert f["evidence"]["count"] == 1 and "fallen off the bus" in f["evidence"]["first_message"]
    # The node's transition in the window, and the state it is in.
    (t,) = doc["transitions"]
    assert (t["from"], t["to"]) == ("healthy", "quarantined") and "xid/79" in t["reason"]
    assert t["actions"][:2] == ["cordon", "drain"] and t["at"] >= daemon.before_xid
    assert doc["state"]["state"] == "quarantined" and doc["state"]["since"] == t["at"]
    # The doomed job's intent (dry-run: logged, not carried out).
    (job,) = doc["jobs"]
    assert job["action"] == "job" and job["detail"]["job"]["id"] == "4242" and job["detail"]["rule"] == "xid"
    assert job["outcome"] == "dry-run: logged, not carried out" and job["created"] == t["at"]


def test_explain_window_before_the_xid_holds_none_of_it(daemon):
    doc = daemon.window(daemon.before_xid - 300, daemon.before_xid)
    assert not xid79(doc) and not doc["transitions"] and not doc["jobs"]
    assert doc["state"]["state"] == "quarantined"  # the node's state now, whatever the window
    # A window after the XID began still holds it: the incident stands (XID 79 asks for a reboot: for the boot).
    # RFC 3339 with a zone reads as the Unix time it names.
    start = int(daemon.xid_at) + 1
    wait_for(lambda: time.time() > start + 0.05, what="the window's start past")  # a future window is not watched
    iso = datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    until = datetime.fromtimestamp(start + 60, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    code, _, body = get(f"{daemon.url}/api/v1/findings?since={iso}&until={until.replace('+', '%2B')}")
    assert code == 200, body
    later = json.loads(body)
    assert (later["since"], later["until"]) == (start, start + 60) and xid79(later)
    assert not later["transitions"] and not later["jobs"]  # both were made before it
    # A window that ends before the XID's first event but starts before it: still out (began after `until`).
    assert not xid79(daemon.window(daemon.before_xid - 60, daemon.xid_at - 0.001))
    assert xid79(daemon.window(daemon.before_xid - 60, daemon.xid_at))


@pytest.mark.parametrize("query,reason", [
    ("", "since is required"),
    ("until=1", "since is required"),
    ("since=", "empty time"),
    ("since=yesterday", "neither a Unix time nor an RFC 3339 time"),
    ("since=2026-12-06T11:00:00", "has no zone"),
    ("since=nan", "is not a time"),
    ("since=20&until=10", "since is after until"),
    ("since=0&until=2700000", "longer than 31 days"),
    ("since=1&since=2", "once"),
    ("since=1&limit=5", "unknown parameter 'limit'"),
    ("since", "malformed query"),
])
def test_explain_endpoint_refuses_a_bad_window_with_400(daemon, query, reason):
    code, headers, body = get(f"{daemon.url}/api/v1/findings?{query}")
    assert code == 400 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    assert reason in text and text.count("\n") == 1, text


def test_explain_endpoint_get_and_head_only_and_listed_on_the_landing_page(daemon):
    since = daemon.before_xid
    code, headers, _ = get(f"{daemon.url}/api/v1/findings?since={since}", method="POST")
    assert code == 405 and headers["Allow"] == "GET, HEAD"
    _, got, body = get(f"{daemon.url}/api/v1/findings?since={since}&until={since + 1}")
    code, headers, head_body = get(f"{daemon.url}/api/v1/findings?since={since}&until={since + 1}", method="HEAD")
    # HEAD: the head alone; its length is a GET's (but for the digits of generated_at, which moves on).
    assert code == 200 and head_body == b"" and abs(int(headers["Content-Length"]) - len(body)) < 30
    code, _, page = get(f"{daemon.url}/")
    assert code == 200 and b'<a href="metrics">' in page and b"api/v1/findings?since=T" in page


def test_explain_endpoint_is_404_where_no_store_is_served():
    from prometheus_client import CollectorRegistry

    ep = MetricsEndpoint("127.0.0.1", 0, CollectorRegistry())
    ep.start()
    try:
        assert get(f"http://127.0.0.1:{ep.port}/api/v1/findings?since=1")[0] == 404
        assert b"findings" not in get(f"http://127.0.0.1:{ep.port}/")[2]
        (e,) = fetch_nodes([f"127.0.0.1:{ep.port}"], 1.0, 2.0, timeout_s=10)
        assert not e.reachable and "HTTP 404" in e.error and f"127.0.0.1:{ep.port}/api/v1/findings" in e.source
    finally:
        ep.stop()


# -- fetch_nodes -------------------------------------------------------------------------------------------------
class Answering:
    """A server that is not gpuwarden on 127.0.0.1 (a wrong port, another service): answers every GET with `body`,
    or accepts connections and never answers (`silent`)."""

    def __init__(self, body: bytes | None = None, content_type: str = "application/json"):
        self.silent = body is None
        if self.silent:
            self.sock = socket.create_server(("127.0.0.1", 0))
            self.port = self.sock.getsockname()[1]
            self.held: list[socket.socket] = []
            self.stop_event = threading.Event()
            threading.Thread(target=self._hold, daemon=True).start()
            return

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _hold(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop_event.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.held.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        if self.silent:
            self.stop_event.set()
            for c in self.held:
                c.close()
            self.sock.close()
        else:
            self.server.shutdown()
            self.server.server_close()


def test_explain_fetch_nodes_reads_the_daemon_and_names_the_nodes_it_could_not_read(daemon):
    silent = Answering()
    garbage = Answering(b"<html>not json</html>", "text/html")
    other_schema = Answering(json.dumps({"schema": 2, "node": "x"}).encode())
    bad_type = Answering(json.dumps({**daemon.window(daemon.before_xid), "findings": [{"check": 1}]}).encode())
    nobody = free_port()
    try:
        started = time.monotonic()
        got = fetch_nodes([f"127.0.0.1:{daemon.port}", f"127.0.0.1:{nobody}", f"127.0.0.1:{silent.port}",
                           f"127.0.0.1:{garbage.port}", f"127.0.0.1:{other_schema.port}",
                           f"127.0.0.1:{bad_type.port}", "127.0.0.1:notaport"],
                          daemon.before_xid, time.time(), timeout_s=2.0)
        took = time.monotonic() - started
    finally:
        for s in (silent, garbage, other_schema, bad_type):
            s.close()
    ok, refused, quiet, html, schema, typed, badport = got
    assert ok.reachable and ok.host == "127.0.0.1" and ok.error is None and not ok.truncated
    (f,) = [f for f in ok.findings if f["code"] == "79"]
    assert f["entity"]["pci"] == GPU0_PCI and f["entity"]["index"] == 0 and f["status"] == "FAIL"
    assert ok.transitions[0]["to"] == "quarantined" and ok.jobs[0]["detail"]["job"]["id"] == "4242"
    assert ok.state["state"] == "quarantined" and ok.source.startswith(f"http://127.0.0.1:{daemon.port}/api/v1/")
    assert not refused.reachable and "connection refused" in refused.error and str(nobody) in refused.source
    assert not quiet.reachable and "within 2 s" in quiet.error
    assert not html.reachable and "not JSON" in html.error
    assert not schema.reachable and "schema 2" in schema.error
    assert not typed.reachable and "findings[0].check: want a string, got 1" in typed.error
    assert not badport.reachable and "not a port" in badport.error
    assert took < 60  # bounded: the silent node is cut off at its timeout, not waited for


def test_explain_from_document_checks_types_and_ignores_unknown_keys(daemon):
    doc = daemon.window(daemon.before_xid)
    doc["something_new"] = {"a": 1}
    doc["findings"][0]["also_new"] = 1
    e = from_document(doc, "test")
    assert e.reachable and e.host == HOSTNAME and "also_new" not in e.findings[0]
    doc["findings"][0]["entity"]["index"] = "0"
    with pytest.raises(DocumentError, match=r"findings\[0\]\.entity\.index: want an integer, got \"0\""):
        from_document(doc, "test")
    with pytest.raises(DocumentError, match="want a JSON object"):
        from_document([], "test")  # type: ignore[arg-type]
    # A record that ends before the window says nothing of it: kept, not reachable, saying so.
    old = {**daemon.window(daemon.before_xid), "watched_until": 1000.0}
    e = from_document(old, "saved")
    assert not e.reachable and "before the window" in e.error


# -- TLS and basic auth: the same web config as /metrics -----------------------------------------------------------
def test_explain_endpoint_behind_tls_and_basic_auth(certs, tmp_path):  # noqa: F811 - the fixture
    cfg = certs / "web.yml"
    cfg.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"basic_auth_users:\n  explain: {hashed('s3cret')}\n")
    root, state, port = tmp_path / SCENARIO, tmp_path / "state", free_port()
    shutil.copytree(NODES / SCENARIO, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    proc = start(root, state, port, "--web.config.file", str(cfg))
    ca = certs / "server.crt"
    ctx = ssl.create_default_context(cafile=str(ca))
    url = f"https://127.0.0.1:{port}/api/v1/findings?since={time.time() - 60}"
    token = {"Authorization": "Basic " + base64.b64encode(b"explain:s3cret").decode()}
    try:
        wait_for(lambda: _answers(url, 401, ctx), timeout_s=60, what="the TLS endpoint")
        code, headers, body = get(url, context=ctx)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Basic") and b"findings" not in body
        code, headers, body = get(url, headers=token, context=ctx)
        assert code == 200 and headers["Content-Type"] == "application/json" and json.loads(body)["schema"] == 1
        # A bad window is told only to who may ask.
        assert get(url.replace("since=", "since=x"), context=ctx)[0] == 401
        assert get(url.replace("since=", "since=x"), headers=token, context=ctx)[0] == 400
        now = time.time()
        host = f"127.0.0.1:{port}"
        good, no_auth, wrong, no_ca, plain = (
            fetch_nodes([host], now - 60, now, tls=True, ca_file=ca, auth=("explain", "s3cret"))[0],
            fetch_nodes([host], now - 60, now, tls=True, ca_file=ca)[0],
            fetch_nodes([host], now - 60, now, tls=True, ca_file=ca, auth=("explain", "wrong"))[0],
            fetch_nodes([host], now - 60, now, tls=True, auth=("explain", "s3cret"))[0],
            fetch_nodes([host], now - 60, now, timeout_s=3.0)[0])
        assert good.reachable and good.source.startswith("https://") and good.host == "127.0.0.1"
        assert not no_auth.reachable and "HTTP 401" in no_auth.error and "asks for a user and password" in no_auth.error
        assert not wrong.reachable and "refused" in wrong.error
        assert not no_ca.reachable and "TLS failed" in no_ca.error and "CERTIFICATE_VERIFY_FAILED" in no_ca.error
        assert not plain.reachable  # plain HTTP to the TLS port gets no window
    finally:
        end_processes(proc)




# -- read_dirs: a recording, the stopped daemon's store, what cannot be read ---------------------------------------
def test_explain_read_dirs_on_a_gpuwarden_record_folder(scenario_copy, tmp_path):
    root = scenario_copy(SCENARIO, with_tools=True)
    append_kmsg(root, XID79)
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "record", "--root", str(root), "--out",
                           str(out), "--log-format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "state.db").exists()  # a recording holds no store: its kernel log and hardware are judged
    import tomllib

    at = evidence_window.parse_time(tomllib.loads((out / "node.toml").read_text())["recorded_at"])
    (e,) = read_dirs([out], at - 600, at + 60)
    assert e.reachable and e.host == HOSTNAME and e.source == str(out) and e.state is None
    (f,) = [f for f in e.findings if f["check"] == "xid" and f["code"] == "79"]
    # The newest record stands for the recording's time (a recording keeps no uptime).
    assert f["entity"]["pci"] == GPU0_PCI and f["entity"]["index"] == 0 and f["first_at"] == at
    assert not e.transitions and not e.jobs
    (before,) = read_dirs([out], at - 3600, at - 1)
    assert before.reachable and not [f for f in before.findings if f["code"] == "79"]
    (after,) = read_dirs([out], at + 60, at + 120)
    assert not after.reachable and "before the window" in after.error  # the recording says nothing of later


def test_explain_read_dirs_says_which_path_cannot_be_read(tmp_path):
    garbage = tmp_path / "n1.db"
    garbage.write_bytes(b"\0garbage\xff" * 1000)
    empty = tmp_path / "empty"
    empty.mkdir()
    got = read_dirs([garbage, empty, tmp_path / "missing"], 0.0, 1.0)
    assert [e.reachable for e in got] == [False, False, False]
    assert str(garbage) in got[0].error and "not an SQLite database" in got[0].error and got[0].host == "n1"
    assert str(empty) in got[1].error and "no gpuwarden store or recording" in got[1].error
    assert str(tmp_path / "missing") in got[2].error and "no such file" in got[2].error


def test_explain_read_dirs_on_the_stopped_daemons_store(daemon, tmp_path):
    daemon.stop()
    assert daemon.proc.returncode == 0
    since, until = daemon.before_xid, time.time()
    # The state folder, the store file itself, and a folder of several nodes (the store's copy and a truncated one).
    (folder,) = read_dirs([daemon.state], since, until)
    (file,) = read_dirs([daemon.state / "state.db"], since, until)
    for e in (folder, file):
        assert e.reachable and e.host == HOSTNAME, e.error
        (f,) = [f for f in e.findings if f["code"] == "79"]
        assert f["entity"]["pci"] == GPU0_PCI and f["first_at"] == daemon.xid_at
        assert e.transitions[0]["to"] == "quarantined" and e.jobs[0]["detail"]["job"]["id"] == "4242"
    (before,) = read_dirs([daemon.state], since - 300, since)
    assert before.reachable and not [f for f in before.findings if f["code"] == "79"] and not before.jobs
    nodes = tmp_path / "nodes"
    (nodes / "n1").mkdir(parents=True)
    shutil.copy(daemon.state / "state.db", nodes / "n1" / "state.db")
    data = (daemon.state / "state.db").read_bytes()
    (nodes / "n2.db").write_bytes(data[:len(data) // 2])
    got = read_dirs([nodes], since, until)
    assert [(e.host, e.reachable) for e in got] == [(HOSTNAME, True), ("n2", False)]
    assert str(nodes / "n2.db") in got[1].error, got[1].error
    # Read only: reading changed nothing of the store.
    assert (nodes / "n1" / "state.db").read_bytes() == data


def test_explain_window_is_bounded_newest_kept(tmp_path):
    """A store written by the store's own commit: more transitions in the window than the limit keeps the newest,
    in time order, and says it cut."""
    from gpuwarden.agent.state.transitions import NodeState, Transition

    store = Store(tmp_path / "state.db")
    try:
        store.commit(transition=[Transition(NodeState.HEALTHY, NodeState.SUSPECT, f"flap {i}", (), 1000.0 + i)
                                 for i in range(10)])
        doc = evidence_window.window(store, 1000.0, 2000.0, limit=3, node="n1", now=2000.0)
        assert doc["truncated"] is True and [t["reason"] for t in doc["transitions"]] == ["flap 7", "flap 8", "flap 9"]
        whole = evidence_window.window(store, 1000.0, 2000.0, node="n1", now=2000.0)
        assert whole["truncated"] is False and len(whole["transitions"]) == 10
        assert evidence_window.window(store, 1004.5, 1006.0, now=2000.0)["transitions"][0]["reason"] == "flap 5"
    finally:
        store.close()


def test_explain_an_ib_port_outage_is_timed_by_the_ports_own_history(scenario_copy):
    """The ib_port check's real judgement on the tray, a port down from T0 + 10: its finding spans the outage (the
    port's down_since to its last look), so a window before the outage does not hold it and one across it does."""
    from conftest import PassiveClock
    from gpuwarden.agent.core.model import fold_status
    from gpuwarden.agent.state.check_record import CheckRecord
    from gpuwarden.checks import ib_downtime

    root = scenario_copy(SCENARIO)
    t0 = 1_796_000_000.0
    clock = PassiveClock(ib_downtime.SPEC, root, {**ib_downtime.SPEC.defaults, "down_fail_s": 5.0}, t0, 1.0)
    clock.run(10)
    (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    j = clock.run(20)
    (f,) = [f for f in j.findings if f.code == "ib-port-down"]
    rec = CheckRecord("ib_port", j.state, fold_status(j.findings), None, j.findings, clock.t)
    snap = evidence_window.Snapshot("n1", None, (rec,), (), (), clock.t)

    def found(since: float, until: float) -> list[dict]:
        return [x for x in evidence_window.document(snap, since, until, now=clock.t)["findings"]
                if x["code"] == "ib-port-down"]

    (x,) = found(t0, clock.t)
    assert x["entity"]["id"] == "mlx5_1/1" and x["first_at"] == t0 + 11 and x["last_at"] == clock.t
    assert x["status"] == "FAIL" and x["action"] == "DRAIN" and f.entity.id == "mlx5_1/1"
    assert not found(t0, t0 + 10.5) and found(t0 + 11, t0 + 12)
