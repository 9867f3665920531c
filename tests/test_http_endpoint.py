"""The /metrics endpoint on loopback: what it serves and where (404 off /metrics and /), keep-alive, gzip,
`name[]` as prometheus-client filters, bounded and timed-out connections, and TLS with basic auth from an
exporter-toolkit web config (a real self-signed certificate, real bcrypt hashes)."""
from __future__ import annotations

import datetime
import gzip
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from conftest import ROOT, wait_for
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.daemon.http_conn import Limits
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily

FAST = Limits(max_connections=4, head_timeout_s=0.5, idle_timeout_s=0.5, write_timeout_s=2.0, max_head_bytes=1024)


def registry_with_one_gauge() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("gpuwarden_test_value", "A value for the endpoint test.", registry=reg).set(42)
    return reg


@pytest.fixture
def endpoint():
    started = []

    def make(registry=None, **kwargs) -> MetricsEndpoint:
        ep = MetricsEndpoint("127.0.0.1", 0, registry or registry_with_one_gauge(), **kwargs)
        ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        ep.stop(timeout_s=5)


def get(ep: MetricsEndpoint, path: str, headers: dict | None = None):
    """(status, headers, body) of one request over urllib (its own connection)."""
    req = urllib.request.Request(f"http://127.0.0.1:{ep.port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


class Raw:
    """A raw client connection: requests written as given, responses read by their Content-Length (bytes of a
    next pipelined response are kept for the next read)."""

    def __init__(self, ep: MetricsEndpoint, sock: socket.socket | None = None):
        self.sock = sock or socket.create_connection(("127.0.0.1", ep.port), timeout=10)
        self.buf = b""

    def __enter__(self) -> "Raw":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            data = self.sock.recv(65536)
            assert data, f"connection closed before a full response head: {self.buf!r}"
            self.buf += data
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if head_only else int(headers["content-length"])
        while len(self.buf) < length:
            data = self.sock.recv(65536)
            assert data, "connection closed inside a response body"
            self.buf += data
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split(" ")[1]), headers, body

    def closed_by_server(self, timeout_s: float = 20.0) -> bool:
        """Whether the server closes the connection (EOF or reset) within a generous deadline."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


# ---------------------------------------------------------------- what is served, where
def test_serves_metrics_and_stops():
    ep = MetricsEndpoint("127.0.0.1", 0, registry_with_one_gauge())
    ep.start()
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=5).read().decode()
        assert "gpuwarden_test_value 42.0" in body
    finally:
        ep.stop(timeout_s=5)
    assert not ep._thread.is_alive()


def test_stops_when_never_scraped():
    ep = MetricsEndpoint("127.0.0.1", 0, registry_with_one_gauge())
    ep.start()
    ep.stop(timeout_s=5)
    assert not ep._thread.is_alive()


@pytest.mark.parametrize("path", ["/../../etc/passwd", "/metricsx", "/metrics/", "//metrics", "/favicon.ico",
                                  "/index.html", "*", "http://127.0.0.1/metrics", "/%2e%2e/etc/passwd"])
def test_unknown_paths_are_404(endpoint, path):
    ep = endpoint()
    with Raw(ep) as s:
        s.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        code, _, body = s.response()
    assert code == 404 and b"gpuwarden_test_value" not in body and b"root:" not in body


def test_root_is_a_page_that_links_to_the_metrics(endpoint):
    code, headers, body = get(endpoint(), "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<a href="metrics">' in body and b"gpuwarden_test_value" not in body


def test_only_get_and_head(endpoint):
    ep = endpoint()
    _, _, get_body = get(ep, "/metrics")
    with Raw(ep) as s:
        s.send(b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
               b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        code, headers, _ = s.response()
        assert code == 405 and headers["allow"] == "GET, HEAD"
        code, headers, _ = s.response(head_only=True)  # HEAD: the head alone, with the length a GET would get
        assert code == 200 and int(headers["content-length"]) == len(get_body)
        assert s.response()[2].startswith(b"<!DOCTYPE html>")  # nothing of a body came between


# ---------------------------------------------------------------- keep-alive, gzip, OpenMetrics
def test_keep_alive_serves_requests_in_turn_on_one_connection(endpoint):
    ep = endpoint()
    with Raw(ep) as s:
        for _ in range(3):
            s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            code, headers, body = s.response()
            assert code == 200 and headers["connection"] == "keep-alive" and b"gpuwarden_test_value 42.0" in body
        # Pipelined: two requests in one write, answered in order.
        s.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.response()[2].startswith(b"<!DOCTYPE html>")
        code, headers, _ = s.response()
        assert code == 200 and headers["connection"] == "close"
        assert s.closed_by_server()


def test_http_1_0_closes_unless_asked_to_keep_alive(endpoint):
    ep = endpoint()
    with Raw(ep) as s:
        s.send(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert s.response()[1]["connection"] == "close" and s.closed_by_server()
    with Raw(ep) as s:
        s.send(b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert s.response()[1]["connection"] == "keep-alive"
        s.send(b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert s.response()[0] == 200


def test_gzip_when_the_client_accepts_it(endpoint):
    ep = endpoint()
    _, plain_headers, plain = get(ep, "/metrics")
    code, headers, body = get(ep, "/metrics", {"Accept-Encoding": "deflate, gzip;q=0.9"})
    assert code == 200 and headers["Content-Encoding"] == "gzip" and "Content-Encoding" not in plain_headers
    assert gzip.decompress(body) == plain


def test_openmetrics_when_the_scraper_asks(endpoint):
    accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
    code, headers, body = get(endpoint(), "/metrics", {"Accept": accept})  # what Prometheus sends
    assert code == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


# ---------------------------------------------------------------- name[] as prometheus-client filters
class StaticCollector:
    def collect(self):
        a = GaugeMetricFamily("gpuwarden_a", "A.", labels=["x"])
        a.add_metric(["1"], 1.0)
        yield a
        b = GaugeMetricFamily("gpuwarden_b", "B.")
        b.add_metric([], 2.0)
        yield b

    def describe(self):
        return self.collect()


@pytest.mark.parametrize("names", [["gpuwarden_a"], ["gpuwarden_a", "gpuwarden_b"], ["gpuwarden_c_total"],
                                   ["gpuwarden_c"], ["nothing"]])
def test_name_filter_answers_as_prometheus_client_does(endpoint, names):
    def registry(auto_describe: bool) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=auto_describe)
        reg.register(StaticCollector())
        Counter("gpuwarden_c", "C.", registry=reg).inc(3)
        return reg

    # prometheus-client filters correctly where it knows each collector's names beforehand ...
    expected = generate_latest(registry(True).restricted_registry(names))
    # ... the daemon's collector cannot describe them (the checks' series come and go): the endpoint must still.
    ep = endpoint(registry(False))
    query = "&".join(f"name[]={n}" for n in names)
    code, _, body = get(ep, f"/metrics?{query}")
    assert code == 200 and _without_created(body) == _without_created(expected)
    if names != ["nothing"] and names != ["gpuwarden_c"]:
        assert body


def _without_created(text: bytes) -> list[bytes]:
    return [line for line in text.splitlines() if b"_created" not in line]


def test_name_filter_on_the_daemons_collector(endpoint):
    ep = endpoint(registry_for(DaemonCollector()))
    code, _, body = get(ep, "/metrics?name[]=gpuwarden_node_state&name[]=gpuwarden_kmsg_records_total")
    lines = [line for line in body.decode().splitlines() if not line.startswith("#")]
    assert code == 200 and len(lines) == 6  # five states and one counter
    assert {line.split("{")[0].split(" ")[0] for line in lines} == {"gpuwarden_node_state",
                                                                   "gpuwarden_kmsg_records_total"}


# ---------------------------------------------------------------- bad requests
def test_a_huge_head_is_refused_and_the_connection_closed(endpoint):
    ep = endpoint(limits=FAST)
    with Raw(ep) as s:
        s.send(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
        assert s.response()[0] == 431 and s.closed_by_server()
    with Raw(ep) as s:  # no end of head at all
        try:
            s.send(b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 1000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            assert s.response()[0] == 431
        assert s.closed_by_server()


@pytest.mark.parametrize("request_bytes,code", [
    (b"GET /metrics\r\n\r\n", 400),
    (b"GET  /metrics HTTP/1.1\r\n\r\n", 400),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
    (b"GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\n folded: header\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # TLS to a plain-HTTP port
])
def test_malformed_requests_get_an_error_and_a_close(endpoint, request_bytes, code):
    ep = endpoint()
    with Raw(ep) as s:
        s.send(request_bytes)
        assert s.response()[0] == code and s.closed_by_server()


def test_a_request_with_a_body_is_answered_then_closed(endpoint):
    ep = endpoint()
    with Raw(ep) as s:
        s.send(b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
        code, headers, _ = s.response()
        assert code == 200 and headers["connection"] == "close" and s.closed_by_server()


# ---------------------------------------------------------------- bounded and timed out
def test_idle_connections_are_closed(endpoint):
    ep = endpoint(limits=FAST)
    with Raw(ep) as never_asks, Raw(ep) as asked_once:
        asked_once.send(b"GET /metrics HTTP/1.1\r\n\r\n")
        assert asked_once.response()[0] == 200
        assert never_asks.closed_by_server() and asked_once.closed_by_server()


def test_a_slow_client_gains_nothing_by_trickling(endpoint):
    ep = endpoint(limits=FAST)  # the head must be complete within 0.5 s of its first byte
    with Raw(ep) as s:
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"z" * 400:  # bounded: 400 bytes, 0.05 s apart
            try:
                s.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
        assert closed or s.closed_by_server()


def test_at_the_cap_the_longest_idle_connection_makes_room(endpoint):
    ep = endpoint(limits=Limits(max_connections=4, idle_timeout_s=60, head_timeout_s=60))
    idle = [Raw(ep) for _ in range(4)]
    try:
        wait_for(lambda: len(ep._conns) == 4, what="4 connections accepted")
        with Raw(ep) as s:  # a fifth: the oldest idle one goes
            s.send(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert s.response()[0] == 200
        assert idle[0].closed_by_server()
        assert len(ep._conns) <= 4
    finally:
        for s in idle:
            s.sock.close()


def test_at_the_cap_a_head_still_being_sent_gives_way_to_a_new_connection(endpoint):
    """A complete head is answered at once, so one still being sent at the cap is a slow client's: the oldest gives
    way to the new connection (a scrape is answered whatever other clients do); the others are not disturbed."""
    ep = endpoint(limits=Limits(max_connections=4, idle_timeout_s=60, head_timeout_s=60))
    slow = [Raw(ep) for _ in range(4)]
    try:
        for s in slow:
            s.send(b"GET /metrics HTTP/1.1\r\n")  # a head begun, never ended
            wait_for(lambda: any(c.inbuf for c in ep._conns if c.sock.fileno() != -1), what="the head begun")
        wait_for(lambda: len(ep._conns) == 4 and not any(c.idle for c in ep._conns), what="4 heads begun")
        with Raw(ep) as s:
            s.send(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert s.response()[0] == 200
        assert slow[0].closed_by_server()
        for s in slow[1:]:
            s.send(b"\r\n")
            assert s.response()[0] == 200
    finally:
        for s in slow:
            s.sock.close()


# ---------------------------------------------------------------- TLS and basic auth (web config)
@pytest.fixture
def certs(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost, made with the cryptography package."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuwarden-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    return tmp_path


def hashed(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()  # cost 4: a test needs no strength


def https_get(ep: MetricsEndpoint, cafile: Path, path: str = "/metrics", auth: tuple[str, str] | None = None):
    ctx = ssl.create_default_context(cafile=str(cafile))
    req = urllib.request.Request(f"https://127.0.0.1:{ep.port}{path}")
    if auth:
        import base64

        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_tls_and_basic_auth_from_a_web_config(endpoint, certs):
    cfg = certs / "web.yml"
    cfg.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"basic_auth_users:\n  prometheus: {hashed('s3cret')}\n")
    ep = endpoint(web_config_file=cfg)
    assert ep.tls
    ca = certs / "server.crt"
    code, headers, _ = https_get(ep, ca)
    assert code == 401 and headers["WWW-Authenticate"].startswith("Basic")
    assert https_get(ep, ca, auth=("prometheus", "wrong"))[0] == 401
    assert https_get(ep, ca, auth=("nobody", "s3cret"))[0] == 401
    code, _, body = https_get(ep, ca, auth=("prometheus", "s3cret"))
    assert code == 200 and b"gpuwarden_test_value 42.0" in body
    assert https_get(ep, ca, "/../../etc/passwd", auth=("prometheus", "s3cret"))[0] == 404
    assert https_get(ep, ca, "/../../etc/passwd")[0] == 401  # nothing, not even a 404, without the password
    # Plain HTTP to the TLS port gets no metrics.
    with Raw(ep) as s:
        s.send(b"GET /metrics HTTP/1.1\r\n\r\n")
        try:
            data = s.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        assert b"gpuwarden_test_value" not in data
    # Keep-alive over TLS: several requests on one connection.
    ctx = ssl.create_default_context(cafile=str(ca))
    import base64

    token = base64.b64encode(b"prometheus:s3cret")
    plain = socket.create_connection(("127.0.0.1", ep.port), timeout=10)
    with Raw(ep, ctx.wrap_socket(plain, server_hostname="127.0.0.1")) as s:
        for _ in range(3):
            s.send(b"GET /metrics HTTP/1.1\r\nAuthorization: Basic " + token + b"\r\n\r\n")
            assert s.response()[0] == 200


def test_basic_auth_without_tls_and_a_changed_password_is_taken_without_a_restart(endpoint, tmp_path):
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"basic_auth_users:\n  prometheus: {hashed('old')}\n")
    ep = endpoint(web_config_file=cfg)
    assert not ep.tls
    import base64

    def code(password: str) -> int:
        token = base64.b64encode(f"prometheus:{password}".encode()).decode()
        return get(ep, "/metrics", {"Authorization": f"Basic {token}"})[0]

    assert code("old") == 200 and code("new") == 401
    cfg.write_text(f"basic_auth_users:\n  prometheus: {hashed('new')}\n")
    wait_for(lambda: code("new") == 200, what="the new password (the file is looked at once a second)")
    assert code("old") == 401
    cfg.write_text("basic_auth_users: [not, a, mapping]\n")  # broken: the last good config stays
    time.sleep(1.1)
    assert code("new") == 200


@pytest.mark.parametrize("text,error", [
    ("tls_server_config:\n  cert_file: server.crt\n", "needs both cert_file and key_file"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: missing.key\n", "cannot load"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  cipher_suites: [x]\n", "cipher_suites"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n  min_version: SSL3\n", "min_version"),
    ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
     "  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
    ("http_server_config:\n  http2: false\n", "http_server_config"),
    ("basic_auth_users:\n  prometheus: plaintext\n", "not a bcrypt hash"),
    ("basic_auth_users: [a]\n", "must be a mapping"),
    ("tls_server_config: {cert_file: [\n", "invalid YAML"),
    ("- just\n- a list\n", "must be a mapping"),
])
def test_a_bad_web_config_is_an_error_naming_what(certs, text, error):
    cfg = certs / "web.yml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as exc:
        MetricsEndpoint("127.0.0.1", 0, registry_with_one_gauge(), web_config_file=cfg)
    assert error in str(exc.value) and str(cfg) in str(exc.value)


def test_run_refuses_a_bad_web_config_with_exit_2(tmp_path):
    cfg = tmp_path / "web.yml"
    cfg.write_text("basic_auth_users:\n  prometheus: plaintext\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root",
                           str(ROOT / "fixtures/nodes/gb200-nvl72-healthy"), "--state-dir", str(tmp_path / "state"),
                           "--listen", f"127.0.0.1:{port}", "--web.config.file", str(cfg), "--log-format", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a bcrypt hash" in proc.stderr and "Traceback" not in proc.stderr
