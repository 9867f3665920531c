"""Integration with a real Prometheus (Debian package): it scrapes `gpuwarden run` on 127.0.0.1 and the
gpuwarden_* series come back through its HTTP API; `promtool check metrics` finds nothing to lint."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest
from conftest import append_kmsg, wait_for
from test_daemon import XID79, free_port, start

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="prometheus/promtool not installed (.ci/run installs the Debian package)")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_promtool_finds_the_exposition_clean(scenario_copy, tmp_path):
    root, port = scenario_copy("gb200-nvl72-faulty"), free_port()
    proc = start(root, tmp_path / "state", port)
    try:
        text = wait_for(lambda: _try(f"http://127.0.0.1:{port}/metrics", "gpuwarden_xid_events"), what="/metrics")
    finally:
        proc.terminate()
        proc.wait(10)
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "gpuwarden_node_state{" in text


def test_prometheus_scrapes_the_daemon(scenario_copy, tmp_path):
    root, port, prom_port = scenario_copy("gb200-nvl72-healthy"), free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: gpuwarden
    static_configs:
      - targets: ["127.0.0.1:{port}"]
""")
    daemon = start(root, tmp_path / "state", port)
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1/query?query="
    try:
        healthy = wait_for(lambda: _value(api + 'gpuwarden_node_state{state="healthy"}'), timeout_s=60,
                           what="Prometheus to scrape the daemon")
        assert healthy == "1"
        append_kmsg(root, XID79)
        wait_for(lambda: _value(api + 'gpuwarden_node_state{state="quarantined"}') == "1", timeout_s=60,
                 what="the quarantined state in Prometheus")
        assert _value(api + 'gpuwarden_xid_events{xid="79"}') == "1"
        up = json.loads(get(api + 'up{job="gpuwarden"}'))["data"]["result"]
        assert up and up[0]["value"][1] == "1"
    finally:
        for p in (prom, daemon):
            p.terminate()
        for p in (prom, daemon):
            p.wait(20)


def _try(url: str, needle: str) -> str | None:
    try:
        text = get(url)
    except OSError:
        return None
    return text if needle in text else None


def _value(url: str) -> str | None:
    try:
        result = json.loads(get(url))["data"]["result"]
    except (OSError, ValueError, KeyError):
        return None
    return result[0]["value"][1] if result else None
