"""The Grafana fleet dashboard (packaging/grafana/gpuwarden-fleet.json): valid for a current Grafana, with a
Prometheus datasource variable and domain / node variables over labels the agent exports; every panel query asks
only for metric names and labels the agent really exports on recorded nodes, or that the shipped rules record;
and, against a real Prometheus that scraped the real agent on two recorded nodes with the shipped scrape config
and rules, every query answers with data (those that read only series a job action makes, which the recorded nodes
never give, answer without error) and every rule evaluates without error."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from conftest import ROOT, end_processes, wait_for
from exported_series import TARGET_LABELS, references
from test_alert_rules import ENUM_LABELS, RULES, after_job_actions, known, labels_of, recorded, values_of

DASHBOARD = ROOT / "packaging" / "grafana" / "gpuwarden-fleet.json"
SCRAPE = ROOT / "packaging" / "prometheus" / "prometheus-scrape.yml"
# What Grafana puts in place of its variables; the query then reads every domain and node.
SUBSTITUTE = {"${datasource}": "", "$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
              "$domain": ".*", "$node": ".*"}
LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\)$")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    """(panel title and refId, the query as Prometheus gets it)."""
    out = []
    for p in panels():
        for t in p["targets"]:
            expr = t["expr"]
            for k, v in SUBSTITUTE.items():
                expr = expr.replace(k, v)
            assert "$" not in expr, f"{p['title']}: unknown variable in {t['expr']!r}"
            out.append((f"{p['title']} {t['refId']}", expr))
    return out


def test_the_dashboard_is_valid_for_a_current_grafana():
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "gpuwarden-fleet" and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"domain", "node"} <= set(variables)


def test_the_variables_are_labels_the_agent_exports():
    for v in dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = LABEL_VALUES.match(v["query"]["query"])
        assert m and v["definition"] == v["query"]["query"], v["name"]
        selector, label = m.groups()
        refs = references(selector.replace("$domain", ".*"))
        (metric,) = refs.metrics
        assert label in labels_of(metric), (v["name"], metric, label)
        assert all(lab in labels_of(metric) for _, lab, _, _ in refs.matchers), v["name"]


def test_every_query_reads_what_the_agent_exports_or_the_rules_record():
    own = recorded()
    assert len(queries()) >= 25
    for where, expr in queries():
        refs = references(expr)
        assert refs.metrics, where
        available = set(TARGET_LABELS)
        for m in refs.metrics:
            assert m in own or m in known() or m == "up", f"{where}: {m} is neither exported nor recorded"
            available |= labels_of(m, own)
        for metric, label, op, value in refs.matchers:
            assert label in labels_of(metric, own), f"{where}: {metric} has no label {label}"
            if label in ENUM_LABELS and metric in known():
                wanted = set(value.split("|")) if op in ("=~", "!~") else {value}
                assert wanted <= values_of(metric, label), f"{where}: {label}{op}{value!r} matches no value"
            if label in ENUM_LABELS and metric in own:  # the recorded series keep the agent's values
                assert value in values_of("gpuwarden_node_state", label), f"{where}: {label}={value!r} matches no value"
        assert set(refs.grouping) <= available, (where, set(refs.grouping) - available)
        # Legends and table columns name labels the series carry.
        for t in (t for p in panels() for t in p["targets"] if where == f"{p['title']} {t['refId']}"):
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                assert label in available, (where, label)


def test_each_node_state_and_the_spares_have_their_place():
    from gpuwarden.agent.state.transitions import NodeState

    titles = {p["title"].lower() for p in panels()}
    table = next(p for p in panels() if p["title"] == "Per NVLink domain")
    columns = set(next(t for t in table["transformations"] if t["id"] == "organize")["options"]["renameByName"]
                  .values())
    for s in NodeState:
        assert s.value in titles and s.value in columns, s
    assert "spares" in titles and "spares" in columns
    assert {"findings", "checks not ok", "ib port downtime in the window", "xid events this boot",
            "circuit breaker"} <= titles


# -- against a real Prometheus ---------------------------------------------------------------------------------------
def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def query(api: str, expr: str) -> tuple[str, list]:
    try:
        out = get(f"{api}/api/v1/query?query={urllib.parse.quote(expr)}")
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode()[:300]}", []
    return out["status"], out["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """The real agent on two recorded nodes (the faulty tray and the healthy one, whose domain is known), scraped
    every second by a real Prometheus with the shipped scrape job (its relabelling: the two targets are
    127.0.0.1 and localhost, so their instances differ) and rules."""
    from test_daemon import free_port, start

    tmp = tmp_path_factory.mktemp("prometheus")
    ports = {}
    procs = []
    try:
        for name in ("gb200-nvl72-faulty", "gb200-nvl72-healthy"):
            root = tmp / name
            shutil.copytree(ROOT / "fixtures" / "nodes" / name, root, symlinks=True,
                            ignore=shutil.ignore_patterns("tools"))
            ports[name] = free_port()
            procs.append(start(root, tmp / f"state-{name}", ports[name]))
        cfg = yaml.safe_load(SCRAPE.read_text())
        cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
        cfg["rule_files"] = [str(RULES)]
        (job,) = cfg["scrape_configs"]
        job.update(scrape_interval="1s", scrape_timeout="1s")
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{ports['gb200-nvl72-faulty']}",
                                               f"localhost:{ports['gb200-nvl72-healthy']}"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        prom_port = free_port()
        procs.append(subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{prom_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        api = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: has_data(api, 'count(gpuwarden_node_info{node=~"gb200-rack07-tray(03|11)"}) == 2'),
                 timeout_s=90, what="Prometheus to scrape both agents")
        yield api
    finally:
        end_processes(*reversed(procs))


def has_data(api: str, expr: str) -> bool:
    try:
        return bool(query(api, expr)[1])
    except OSError:
        return False


def needs_a_job_action(expr: str) -> bool:
    """The query reads a series that exists only once an agent has acted on a doomed job (and answers with nothing
    where none has, unless it says `or vector(0)`)."""
    return bool(set(references(expr).metrics) & set(after_job_actions()))


def test_every_query_returns_data_from_prometheus_scraping_the_agent(prometheus):
    # A rate needs two samples of a series in its range and a recording rule one evaluation: each query is
    # asked until it answers with data (or the deadline says which never did). The recorded nodes run no job, so
    # no job is acted on: a query of the job metrics must be valid, and has data only with its `or vector(0)`.
    jobs = {where: expr for where, expr in queries() if needs_a_job_action(expr)}
    assert len(jobs) >= 3
    for where, expr in jobs.items():
        status, result = query(prometheus, expr)
        assert status == "success", f"{where}: {expr}: {status}"
        assert [r["value"][1] for r in result] == (["0"] if expr.endswith(" or vector(0)") else []), (where, result)
    missing = {where: expr for where, expr in queries() if where not in jobs}
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        for where, expr in list(missing.items()):
            status, result = query(prometheus, expr)
            assert status == "success", f"{where}: {expr}: {status}"
            if result:
                del missing[where]
        time.sleep(0.5)
    assert not missing, f"queries without data: {missing}"
    # The table per domain has both nodes: the healthy tray's domain, and the faulty one's (not known) empty.
    status, result = query(prometheus, 'sum by (domain) (domain:gpuwarden_node_info:count)')
    assert sorted(r["metric"].get("domain", "") for r in result) == ["", "62c4efc6-d460-488d-b7d7-69de49edd641.32766"]


def test_the_variables_list_the_domains_and_nodes(prometheus):
    base = f"{prometheus}/api/v1/label/%s/values?match[]=" + urllib.parse.quote("gpuwarden_node_info")
    assert get(base % "domain")["data"] == ["62c4efc6-d460-488d-b7d7-69de49edd641.32766"]
    assert get(base % "node")["data"] == ["gb200-rack07-tray03", "gb200-rack07-tray11"]


def test_the_rules_evaluate_and_the_faulty_nodes_alerts_come(prometheus):
    def alerts() -> dict | None:
        groups = get(f"{prometheus}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if not rules or any(r.get("lastEvaluation", "").startswith("0001") for r in rules):
            return None  # not every rule evaluated yet
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad
        found = {(a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("port"))
                 for r in rules if r["type"] == "alerting" for a in r.get("alerts", [])}
        return found if {("GpuwardenNodeQuarantined", "gb200-rack07-tray11", None),
                         ("GpuwardenIbPortDown", "gb200-rack07-tray11", "mlx5_2/1"),
                         ("GpuwardenXidEvents", "gb200-rack07-tray11", None)} <= found else None

    found = wait_for(alerts, timeout_s=90, what="the faulty tray's alerts pending or firing")
    assert not [a for a in found if a[1] == "gb200-rack07-tray03"], found  # the healthy tray raises none
