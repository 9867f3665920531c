"""`gpuwarden explain --prometheus URL` (agent/jobs/prometheus_evidence.py) against a real Prometheus (Debian package)
scraping the real agent every second on two recorded trays: the tray that runs Slurm job 4242, where an XID 79 is
injected into the kernel log (the agent, in its default dry run, counts the job it would end), scraped by the
shipped scrape job (instance = the host without the port); and the faulty tray, scraped by a job of another name
without that relabelling (as a Kubernetes monitor would), whose agent is stopped once scraped. Then the window after
the XID names it on its GPU with its PCI bus id, the node state's change and the job action; a window before it does
not; a host never scraped and a window before the agents started say they hold nothing; a stopped agent's failed
scrapes are named; and a server that cannot be reached, answers garbage, a 500 or too much, never answers, or wants
TLS and a password gives each node the reason, never a traceback."""
from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
import time

import pytest
import yaml
from conftest import ROOT, append_kmsg, end_processes, wait_for
from gpuwarden.agent.jobs.prometheus_evidence import MAX_POINTS, NO_SERIES, matches, plan_step, query_prometheus
from gpuwarden.agent.jobs.prometheus_series import Target
from test_daemon import XID79, free_port, start
from test_http_endpoint import certs, hashed  # noqa: F401 - certs is a fixture

needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (.ci/run installs the Debian package)")
SCRAPE = ROOT / "packaging" / "prometheus" / "prometheus-scrape.yml"
JOB_TRAY, FAULTY = "gb200-rack07-tray05", "gb200-rack07-tray11"  # node.toml of the two recorded trays
XID_GPU = "0008:01:00.0"  # XID79's PCI:0008:01:00 in tests/test_daemon.py: GPU 0 of the job's tray


def prometheus_config(targets: dict[str, list[str]]) -> dict:
    """The shipped scrape job for `targets["gpuwarden"]`, at 1 s; any other key a job of that name without the
    shipped relabelling (its instance keeps the port)."""
    cfg = yaml.safe_load(SCRAPE.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg.pop("rule_files", None)
    (job,) = cfg["scrape_configs"]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["static_configs"][0]["targets"] = targets.pop("gpuwarden")
    for name, addresses in targets.items():
        cfg["scrape_configs"].append({"job_name": name, "scrape_interval": "1s", "scrape_timeout": "1s",
                                      "static_configs": [{"targets": addresses}]})
    return cfg


def start_prometheus(tmp, cfg: dict, web_config=None) -> tuple[subprocess.Popen, int]:
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    args = ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    if web_config is not None:
        args.append(f"--web.config.file={web_config}")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def copy_node(tmp, name: str):
    root = tmp / name
    shutil.copytree(ROOT / "fixtures" / "nodes" / name, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    return root


class Scraped:
    """What the module's Prometheus saw, and when."""

    url: str
    started: float  # before either agent started
    before_xid: float  # after Prometheus had the job's tray healthy, before the XID was written
    xid_written: float  # just before the XID was written
    stopped: float  # the faulty tray's agent had exited
    seen: float  # Prometheus had the XID's finding and the faulty tray's failed scrapes by then


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    pytest.importorskip("yaml")
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (.ci/run installs the Debian package)")
    tmp = tmp_path_factory.mktemp("explain-prometheus")
    s = Scraped()
    s.started = time.time()
    tray, faulty = copy_node(tmp, "gb200-nvl72-job"), copy_node(tmp, "gb200-nvl72-faulty")
    ports = {JOB_TRAY: free_port(), FAULTY: free_port()}
    agents = {JOB_TRAY: start(tray, tmp / "state-tray", ports[JOB_TRAY]),
              FAULTY: start(faulty, tmp / "state-faulty", ports[FAULTY])}
    prom = None
    try:
        prom, port = start_prometheus(tmp, prometheus_config({"gpuwarden": [f"127.0.0.1:{ports[JOB_TRAY]}"],
                                                              "gpuwarden-pods": [f"127.0.0.1:{ports[FAULTY]}"]}))
        s.url = f"http://127.0.0.1:{port}"

        def both_scraped() -> bool:
            a, b = query_prometheus(s.url, [JOB_TRAY, FAULTY], s.started, time.time())
            return bool(a.state and a.state["state"] == "healthy" and b.findings)

        wait_for(both_scraped, timeout_s=90, what="Prometheus to scrape both agents")
        end_processes(agents.pop(FAULTY))  # the faulty tray's agent goes: its scrapes fail from now on
        s.stopped = time.time()
        s.before_xid = time.time()
        time.sleep(0.5)
        s.xid_written = time.time()  # taken before the line: the agent reads it within milliseconds
        append_kmsg(tray, XID79)

        def xid_and_failed_scrapes() -> bool:
            a, b = query_prometheus(s.url, [JOB_TRAY, FAULTY], s.started, time.time())
            return (any(f["code"] == "79" for f in a.findings) and a.jobs
                    and any(u["check"] == "scrape" for u in b.unknown))

        wait_for(xid_and_failed_scrapes, timeout_s=60, what="the XID and the failed scrapes in Prometheus")
        s.seen = time.time()
        yield s
    finally:
        end_processes(prom, *agents.values())


# -- against the real Prometheus -------------------------------------------------------------------------------------
def test_explain_prometheus_names_the_xid_79_on_its_gpu_with_its_bus_id(scraped):
    (node,) = query_prometheus(scraped.url, [JOB_TRAY], scraped.started, scraped.seen)
    assert node.reachable and node.error is None and node.host == JOB_TRAY
    assert "job=gpuwarden instance=127.0.0.1" in node.source  # the shipped relabelling: the host, no port
    (xid,) = node.findings
    assert (xid["check"], xid["code"], xid["status"], xid["action"]) == ("xid", "79", "FAIL", "REBOOT")
    assert xid["entity"] == {"kind": "gpu", "id": "GPU-f1f125ab-e3b5-c66a-ab3f-9862557b394e", "index": 0,
                             "pci": XID_GPU, "link": None}  # index through gpuwarden_gpu_info's UUID
    assert xid["evidence"]["events_this_boot"] == 1 and xid["evidence"]["prometheus"] == scraped.url
    # first / last are samples Prometheus took after the line was written, inside the window.
    assert scraped.xid_written <= xid["first_at"] <= xid["last_at"] <= scraped.seen
    assert "XID 79 on GPU 0 (0008:01:00.0)" in xid["message"]
    # The node went healthy -> quarantined at the time the agent gives, after the XID.
    (change,) = [t for t in node.transitions if t["from"] == "healthy"]
    assert change["to"] == "quarantined" and scraped.xid_written <= change["at"] <= xid["first_at"]
    assert node.state["state"] == "quarantined" and node.state["since"] == change["at"]
    assert node.unknown == ()
    # The agent's dry run counted the job it would have ended for the XID; which job is not exported, the jobs it
    # saw on the node are.
    (job,) = node.jobs
    assert job["detail"] == {"action": "dry_run", "rule": "xid", "count": 1.0, "jobs_on_node": ["slurm:4242.0"],
                             "series": "gpuwarden_job_actions_total", "resolution_s": 1.0}
    assert job["key"] is None and change["at"] <= job["created"] <= scraped.seen


def test_explain_prometheus_a_window_before_the_xid_does_not_hold_it(scraped):
    (node,) = query_prometheus(scraped.url, [JOB_TRAY], scraped.started, scraped.before_xid)
    assert node.reachable and node.findings == ()
    assert node.state["state"] == "healthy"
    assert not [t for t in node.transitions if t["to"] == "quarantined"] and node.jobs == ()


def test_explain_prometheus_names_a_node_by_its_scheduler_name_its_instance_or_its_full_name(scraped):
    by_name, by_address, by_fqdn = query_prometheus(
        scraped.url, [JOB_TRAY, "127.0.0.1:9456", f"{JOB_TRAY}.cluster.example"], scraped.started, scraped.seen)
    assert [n.host for n in (by_name, by_address, by_fqdn)] == [JOB_TRAY, "127.0.0.1", f"{JOB_TRAY}.cluster.example"]
    assert by_name.findings == by_address.findings == by_fqdn.findings and by_name.findings


def test_explain_prometheus_a_job_of_another_name_and_its_failed_scrapes(scraped):
    (node,) = query_prometheus(scraped.url, [FAULTY], scraped.started, scraped.seen)
    assert node.reachable and "job=gpuwarden-pods instance=127.0.0.1:" in node.source
    found = {(f["check"], f["code"], f["entity"]["id"]): f for f in node.findings}
    port = found[("ib_port", "ib-port-down", "mlx5_2/1")]
    assert port["entity"]["kind"] == "ib_port" and port["entity"]["pci"] == "0010:03:00.0"  # the HCA's
    lost = found[("xid", "79", "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957")]
    # A GPU off the bus is not in gpuwarden_gpu_info (the checks cannot read it): its bus id is all there is.
    assert lost["entity"]["pci"] == "0018:01:00.0" and lost["entity"]["index"] is None
    ecc = found[("ecc", "ecc-uncorrectable", "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32")]
    assert ecc["entity"]["index"] == 1 and ecc["entity"]["pci"] == "0009:01:00.0" and ecc["action"] == "RESET_GPU"
    assert found[("nvswitch_sxid", "sxid-20034", "0000:05:00.0")]["evidence"]["events_this_boot"] == 2
    # Its agent was stopped: the findings end there, and the scrapes that failed after are said, not taken for
    # health.
    (scrape,) = [u for u in node.unknown if u["check"] == "scrape"]
    assert "could not scrape the agent" in scrape["error"] and "job gpuwarden-pods" in scrape["error"]
    assert max(f["last_at"] for f in node.findings) <= scrape["recorded_at"]


def test_explain_prometheus_an_agent_gone_before_the_window_is_named_as_not_scraped(scraped):
    # The stopped agent's series end at its last scrape; a window after it holds only the failed scrapes (`up`),
    # which name its target though it is asked for by its scheduler name.
    def gone():
        (n,) = query_prometheus(scraped.url, [FAULTY], scraped.stopped + 2, time.time())
        return n if n.error and "could not scrape its agent" in n.error else None

    node = wait_for(gone, timeout_s=30, what="a window of failed scrapes only")
    assert not node.reachable and node.error.startswith(NO_SERIES)
    assert "(127.0.0.1:" in node.error and "job gpuwarden-pods: up == 0 throughout" in node.error


def test_explain_prometheus_a_host_never_scraped_is_unreachable_and_the_rest_goes_on(scraped):
    a, missing, b = query_prometheus(scraped.url, [JOB_TRAY, "gb200-rack07-tray99", FAULTY], scraped.started,
                                     scraped.seen)
    assert a.reachable and b.reachable
    assert not missing.reachable and missing.error == NO_SERIES and missing.host == "gb200-rack07-tray99"
    assert missing.source == scraped.url


def test_explain_prometheus_a_window_before_the_agents_started_holds_nothing(scraped):
    nodes = query_prometheus(scraped.url, [JOB_TRAY, FAULTY], scraped.started - 7200, scraped.started - 3600)
    assert [n.reachable for n in nodes] == [False, False]
    assert all(n.error.startswith(NO_SERIES) for n in nodes), [n.error for n in nodes]


def test_explain_prometheus_a_window_of_a_month_costs_a_bounded_number_of_points(scraped):
    # Prometheus itself refuses a range query of more than 11,000 points per series: it answers.
    (node,) = query_prometheus(scraped.url, [JOB_TRAY], scraped.seen - 30 * 86400, scraped.seen, step_s=0.001)
    assert node.reachable, node.error
    assert [f["code"] for f in node.findings] == ["79"]


def test_explain_prometheus_an_answer_over_the_cap_is_named(scraped):
    (node,) = query_prometheus(scraped.url, [JOB_TRAY], scraped.started, scraped.seen, max_bytes=64)
    assert not node.reachable and "over the 64 bytes allowed" in node.error


@needs_prometheus
def test_explain_prometheus_over_tls_with_basic_auth(certs, tmp_path):  # noqa: F811 - the fixture
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(certs / "server.crt"),
                                                         "key_file": str(certs / "server.key")},
                                   "basic_auth_users": {"explain": hashed("s3cret")}}))
    agent_port = free_port()
    agent = start(copy_node(tmp_path, "gb200-nvl72-healthy"), tmp_path / "state", agent_port)
    healthy = "gb200-rack07-tray03"
    prom, port = start_prometheus(tmp_path, prometheus_config({"gpuwarden": [f"127.0.0.1:{agent_port}"]}), web)
    url, since = f"https://127.0.0.1:{port}", time.time() - 60
    try:
        ok = wait_for(lambda: (n := query_prometheus(url, [healthy], since, time.time(), auth=("explain", "s3cret"),
                                                     ca_file=certs / "server.crt")[0]).reachable and n,
                      timeout_s=90, what="Prometheus over TLS to scrape the agent")
        assert ok.findings == () and ok.state["state"] == "healthy"
        (anonymous,) = query_prometheus(url, [healthy], since, time.time(), ca_file=certs / "server.crt")
        assert not anonymous.reachable and "HTTP 401" in anonymous.error and "basic auth" in anonymous.error
        (wrong,) = query_prometheus(url, [healthy], since, time.time(), auth=("explain", "nope"),
                                    ca_file=certs / "server.crt")
        assert not wrong.reachable and "refused" in wrong.error
        (untrusted,) = query_prometheus(url, [healthy], since, time.time(), auth=("explain", "s3cret"))
        assert not untrusted.reachable and "TLS failed" in untrusted.error
    finally:
        end_processes(prom, agent)


# -- servers that are not a working Prometheus ---------------------------------------------------------------------
def test_explain_prometheus_nothing_listening_makes_every_node_unreachable_with_the_reason():
    url = f"http://127.0.0.1:{free_port()}"
    nodes = query_prometheus(url, ["n1", "n2:9456"], time.time() - 600, time.time())
    assert [n.host for n in nodes] == ["n1", "n2"]
    for n in nodes:
        assert not n.reachable and n.source == url and "connection refused" in n.error and url in n.error


class _Stub(http.server.BaseHTTPRequestHandler):
    """A server in Prometheus' place that answers what the test sets: anything but Prometheus' API."""

    answer: tuple[int, str, bytes] = (200, "text/plain", b"")
    hang = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.answer[0] == 0:
            self.hang.wait(30)  # never answers (the test's timeout cuts it off first)
            return
        code, kind, body = self.answer
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def answer(code: int, kind: str = "text/plain", body: bytes = b"") -> str:
        _Stub.answer = (code, kind, body)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield answer
    _Stub.hang.set()
    server.shutdown()
    server.server_close()
    _Stub.hang.clear()


@pytest.mark.parametrize("code, kind, body, reason", [
    (500, "text/html", b"<html><body>Internal Server Error</body></html>", "HTTP 500 Internal Server Error: <html>"),
    (200, "text/html", b"<html>a login page</html>", "not Prometheus' JSON API (it begins '<html>a login page"),
    (200, "application/json", b"", "not Prometheus' JSON API (it is empty)"),
    (200, "application/json", b'{"status": "success", "data": {"resultType": "matrix", "result": []}}',
     "not a vector of Prometheus' query API"),
    (200, "application/json", b'{"status": "success", "data": {"resultType": "vector", "result": [{"metric": 1}]}}',
     "not a series with its value"),
    (200, "application/json", b"\x00\xff" * 50, "not Prometheus' JSON API"),
    (404, "text/plain", b"404 page not found", "HTTP 404: no /api/v1/query there"),
    (422, "application/json", b'{"status":"error","errorType":"execution","error":"query timed out"}',
     "HTTP 422: the query was refused (execution): query timed out"),
    (401, "text/plain", b"Unauthorized", "HTTP 401: it asks for a user and password"),
])
def test_explain_prometheus_a_server_that_answers_anything_else_gives_the_reason(stub, code, kind, body, reason):
    url = stub(code, kind, body)
    nodes = query_prometheus(url, ["n1", "n2"], time.time() - 600, time.time())
    for n in nodes:
        assert not n.reachable and reason in n.error, n.error
        assert n.error.startswith(f"Prometheus at {url}: ")


def test_explain_prometheus_a_server_that_never_answers_is_cut_off_at_the_timeout(stub):
    url = stub(0)
    (n,) = query_prometheus(url + "/prometheus", ["n1"], time.time() - 600, time.time(), timeout_s=0.5)
    # the socket's timeout and the cutoff are both the time left: "no answer" or "no complete answer", whichever fires
    # first (as the endpoints' test of test_explain_node_evidence.py)
    assert not n.reachable and "answer within 0.5 s" in n.error


@pytest.mark.parametrize("url, since, until, reason", [
    ("prometheus:9090", 0.0, 1.0, "not an http:// or https:// URL"),
    ("ftp://prom", 0.0, 1.0, "not an http:// or https:// URL"),
    ("http://prom:port", 0.0, 1.0, "is not a URL"),
    ("http://127.0.0.1:1", 10.0, 1.0, "the window ends"),
    ("http://127.0.0.1:1", float("nan"), 1.0, "not two times"),
])
def test_explain_prometheus_bad_input_is_named_for_every_node(url, since, until, reason):
    (n,) = query_prometheus(url, ["n1"], since, until)
    assert not n.reachable and reason in n.error


# -- pure ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window_s", [0.0, 1.0, 3600.0, 86400.0, 365 * 86400.0, 50 * 365 * 86400.0])
def test_the_step_keeps_every_series_under_prometheus_points_cap(window_s):
    for asked in (None, 0.001, 1.0, 15.0, -1.0, float("nan")):
        step = plan_step(1e9, 1e9 + window_s, asked)
        assert window_s / step + 1 <= MAX_POINTS and step >= 0.001
        assert step == max(asked if asked and asked > 0 else 1.0, step)  # never coarser than needed


@pytest.mark.parametrize("host, target, same", [
    ("gpu01", Target("gpuwarden", "10.0.0.1", "gpu01"), True),
    ("gpu01:9456", Target("gpuwarden", "gpu01", None), True),
    ("gpu01", Target("gpuwarden", "gpu01:9456", None), True),
    ("gpu01", Target("gpuwarden", "gpu01.cluster.example", None), True),
    ("gpu01.cluster.example", Target("gpuwarden", "10.0.0.1", "gpu01"), True),
    ("GPU01", Target("gpuwarden", "gpu01", None), True),
    ("gpu01.a.example", Target("gpuwarden", "gpu01.b.example", None), False),
    ("gpu0", Target("gpuwarden", "gpu01", None), False),
    ("10.0.0.1", Target("gpuwarden", "10.0.0.12:9456", None), False),
    ("10.0.0.1", Target("gpuwarden", "10.0.0.2", None), False),
    ("[fe80::1]:9456", Target("gpuwarden", "[fe80::1]:9456", None), True),
    ("127.0.0.1:9456", Target("gpuwarden", "127.0.0.1", None), True),
    ("127.0.0.1:9456", Target("gpuwarden", "127.0.0.1:9457", None), False),
    ("127.0.0.1", Target("gpuwarden", "127.0.0.1:9457", None), True),
])
def test_a_host_is_the_target_its_name_or_address_gives(host, target, same):
    assert matches(host, target) is same


def test_an_nvlink_finding_names_its_gpu_and_link():
    # The rows as Prometheus answers the queries (the live tests above read the same shapes); the entity's id is
    # the one checks/nvlink_lanes.py gives an NVLink: "<GPU UUID>/link<n>".
    from gpuwarden.agent.jobs.prometheus_series import Rows, node_evidence

    uuid, target = "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32", {"job": "gpuwarden", "instance": "gpu01"}
    finding = {**target, "check": "nvlink_lanes", "code": "nvlink-down", "entity_kind": "nvlink",
               "entity": f"{uuid}/link3", "pci": "0009:01:00.0", "status": "fail", "action": "RESET_GPU"}
    rows = Rows(findings=({"metric": {**finding, "edge": "first"}, "value": [1000.0, "990.5"]},
                          {"metric": {**finding, "edge": "last"}, "value": [1000.0, "999.5"]}),
                gpus=({"metric": {**target, "gpu": "1", "uuid": uuid}, "value": [1000.0, "1"]},),
                events=(), before=(), rises=(), after=(), down=(), blind=(), jobs=())
    node = node_evidence("gpu01", "http://127.0.0.1:9090", "http://127.0.0.1:9090",
                         [Target("gpuwarden", "gpu01", None)], rows, 900.0, 1000.0, 1.0)
    (f,) = node.findings
    assert f["entity"] == {"kind": "nvlink", "id": f"{uuid}/link3", "index": 1, "pci": "0009:01:00.0", "link": 3}
    assert (f["first_at"], f["last_at"], f["status"]) == (990.5, 999.5, "FAIL")
    assert f["message"] == ("nvlink-down on GPU 1 NVLink 3 (0009:01:00.0); in Prometheus from 1970-01-01T00:16:30Z "
                            "to 1970-01-01T00:16:39Z")
    assert node.state is None and node.transitions == ()  # nothing said of the state: not known, not healthy
