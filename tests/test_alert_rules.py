"""The shipped Prometheus rules (packaging/prometheus/): promtool accepts them and their unit tests pass; every
alert has a unit test that fires it and one where it stays quiet; the rules and the unit tests' input series ask
only for metric names, labels and label values the agent really exports on recorded nodes; each alert names the
node (and the GPU, port or check) and says what to do; the scrape example is valid and names the instance after
the node. Also the series added for them (node_info, node_spare, loops_stalled, start_time, build_info).

The job metrics (gpuwarden_job_*) exist only once the agent has acted on a doomed job, which the recorded nodes never
give it: their names, labels and label values come from the real remediation engine carrying job intents out through
the local scheduler, rendered by the daemon's own collector (`after_job_actions()`)."""
from __future__ import annotations

import re
import subprocess
import tempfile
import time
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from exported_series import PROMETHEUS_OWN, TARGET_LABELS, exported, references
from exported_series import exposition as node_exposition

PROM = ROOT / "packaging" / "prometheus"
RULES = PROM / "gpuwarden-rules.yml"
UNIT_TESTS = sorted((PROM / "tests").glob("*.yml"))
# Labels whose values are a closed set the agent enumerates (a typo in a matcher would match nothing, silently).
# reason: a clock event's NVML reason, a job action's doom rule (agent/jobs/doom_rules.toml).
ENUM_LABELS = {"state", "status", "step", "outcome", "check", "entity_kind", "action", "reason"}
SEVERITIES = {"critical", "warning", "info"}
SERIES = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}$")


_after_jobs: dict[str, list[frozenset]] = {}
_after_jobs_texts: list[str] = []


def after_job_actions() -> dict[str, list[frozenset]]:
    """The series that appear only once the agent has acted on a doomed job, as `exported()` gives series: the real
    engine (agent/act/remediation.py) quarantines a node and carries out one job intent per [jobs] on_doomed policy
    and doom rule through the local scheduler, then one more engine does the same in dry-run; the daemon's
    collector renders what they export. Kept: the series it did not export before the job intents."""
    if not _after_jobs:
        from gpuwarden.agent.act.adapters.local import LocalAdapter
        from gpuwarden.agent.act.remediation import Engine, Hooks, Settings
        from gpuwarden.agent.core.job import JobRef
        from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
        from gpuwarden.agent.jobs import doom, respond
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        node = "gb200-rack07-tray11"
        with tempfile.TemporaryDirectory(prefix="gpuwarden-jobs-") as tmp:
            for mode in ("act", "dry-run"):
                log = Path(tmp) / mode / "actions.jsonl"
                log.parent.mkdir()
                adapter = LocalAdapter(log, node_name=node)
                for i in range(8):  # the rest of its domain, in service: the breaker lets the quarantine through
                    adapter.node(f"gb200-rack07-tray{i:02d}")
                meta: dict = {}
                engine = Engine(adapter, Settings(mode=mode, node_name=node, actions_path=log),
                                Hooks(done=lambda key, at, outcome: None, set_meta=meta.__setitem__,
                                      read_meta=meta.get))
                now = time.time()
                intents = [(f"{now:.6f}:healthy->quarantined:drain", "drain",
                            {"at": now, "to": "quarantined", "reason": "xid 79 GPU2 0018:01:00.0"})]
                for p, policy in enumerate(respond.POLICIES):
                    for r, rule in enumerate(doom.rules()):
                        ref = JobRef("slurm", str(4000 + 10 * p + r), 0, "environ")
                        intents.append((f"job:{ref.key}:{rule.name}:{now:.6f}", "job", {
                            "at": now, "job": ref.to_dict(), "policy": policy, "rule": rule.name,
                            "reason": f"{rule.name} on GPU2", "fault_at": now - 1.0, "watchdog_s": 600.0,
                            "gpus_total": 16}))
                collector = DaemonCollector()
                collector.live(engine.samples)
                before = {s.name for f in text_string_to_metric_families(generate_latest(registry_for(collector))
                                                                         .decode()) for s in f.samples}
                engine.enqueue(intents)
                for _ in range(len(intents) + 5):
                    engine.step()
                assert not engine.pending(), engine.pending()
                text = generate_latest(registry_for(collector)).decode()
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name in before:
                            continue
                        labels = frozenset((k, v) for k, v in s.labels.items() if v != "")
                        if labels not in _after_jobs.setdefault(s.name, []):
                            _after_jobs[s.name].append(labels)
                _after_jobs_texts.append(text)
        assert _after_jobs, "no job action exported a series"
    return _after_jobs


def known() -> dict[str, list[frozenset]]:
    """Every series the agent exports: on the recorded nodes, and those that need a job action first."""
    out = {name: list(sets) for name, sets in exported().items()}
    for name, sets in after_job_actions().items():
        out.setdefault(name, []).extend(s for s in sets if s not in out[name])
    return out


def labels_of(metric: str, recorded: dict[str, set[str]] | None = None) -> set[str]:
    """Every label a metric's series carry in Prometheus: the agent's own plus the target's."""
    if recorded and metric in recorded:
        return set(recorded[metric])
    sets = known().get(metric) or PROMETHEUS_OWN.get(metric)
    assert sets is not None, f"{metric} is not exported by the agent"
    return {k for s in sets for k, _ in s} | TARGET_LABELS


def values_of(metric: str, label: str) -> set[str]:
    return {v for s in known().get(metric, []) for k, v in s if k == label}


def promtool(*args: str) -> subprocess.CompletedProcess:
    # Not skipped where promtool is missing: CI installs Debian's prometheus package, and a rule file nobody
    # checked must not pass as tested.
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=PROM)


def rules() -> list[dict]:
    data = yaml.safe_load(RULES.read_text())
    assert list(data) == ["groups"]
    return [r for g in data["groups"] for r in g["rules"]]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def recorded() -> dict[str, set[str]]:
    """Recording rules: name -> the labels their series carry (the by (...) clause of the outermost aggregation)."""
    out = {}
    for r in rules():
        if "record" in r:
            m = re.match(r"\s*\w+\s+by\s*\(([^)]*)\)", r["expr"])
            out[r["record"]] = {w.strip() for w in m.group(1).split(",")} if m else set()
    return out


def unit_tests() -> list[dict]:
    return [t for f in UNIT_TESTS for t in yaml.safe_load(f.read_text())["tests"]]


def test_promtool_checks_the_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    assert not out.stderr.strip(), out.stderr


def test_the_unit_tests_pass():
    assert len(UNIT_TESTS) >= 4
    out = promtool("test", "rules", *[str(f) for f in UNIT_TESTS])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(UNIT_TESTS), out.stdout


def test_every_alert_is_tested_firing_and_quiet():
    fired, quiet = set(), set()
    for t in unit_tests():
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert len(alerts()) >= 18
    assert set(alerts()) - fired == set(), "alerts no unit test fires"
    assert set(alerts()) - quiet == set(), "alerts no unit test shows quiet"
    assert fired | quiet <= set(alerts()), "unit tests of alerts that do not exist"


def test_every_recording_rule_is_tested():
    tested = {c["expr"].strip() for t in unit_tests() for c in t.get("promql_expr_test", [])}
    assert set(recorded()) and set(recorded()) <= tested


def test_the_rules_read_only_what_the_agent_exports():
    own = recorded()
    for r in rules():
        refs = references(r["expr"])
        assert refs.metrics, r
        available: set[str] = set(TARGET_LABELS)
        for m in refs.metrics:
            assert m in own or m in known() or m == "up", f"{r.get('alert') or r.get('record')}: {m} is not exported"
            available |= labels_of(m, own)
        for metric, label, op, value in refs.matchers:
            assert label in labels_of(metric, own), f"{metric} has no label {label}"
            if label in ENUM_LABELS:
                wanted = set(value.split("|")) if op in ("=~", "!~") else {value}
                assert wanted <= values_of(metric, label), f"{metric}{{{label}{op}{value!r}}}: no such value"
        assert set(refs.grouping) <= available, (r.get("alert") or r.get("record"), set(refs.grouping) - available)


def test_the_unit_tests_feed_the_series_the_agent_exports():
    """Each input series is one the agent exports: its name, and its labels (less the target's) those of a real
    series as Prometheus stores it; enumerated labels carry values the agent uses."""
    seen = 0
    for t in unit_tests():
        for s in t["input_series"]:
            m = SERIES.match(s["series"].strip())
            assert m, s
            name = m.group(1)
            labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', m.group(2)))
            assert {"instance", "job"} <= set(labels), s
            if name == "up":
                assert set(labels) == {"instance", "job"}
                continue
            assert name in known(), f"{name} is not exported by the agent"
            own = set(labels) - TARGET_LABELS
            assert own in [{k for k, _ in real} for real in known()[name]], \
                f"{s['series']}: the agent exports {name} with {known()[name][:3]}"
            assert labels["job"] == "gpuwarden"
            if name == "gpuwarden_finding":  # a finding the recorded nodes really raise, label for label
                assert frozenset((k, v) for k, v in labels.items() if k not in TARGET_LABELS) in exported()[name], s
            for k in own & ENUM_LABELS:
                assert labels[k] in values_of(name, k), f"{s['series']}: {k}={labels[k]!r} is never exported"
            seen += 1
    assert seen > 50


def test_each_alert_names_the_node_and_what_to_do():
    for name, a in alerts().items():
        assert name.startswith("Gpuwarden"), name
        assert a["labels"]["severity"] in SEVERITIES, name
        notes = a["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, name
        assert notes["runbook_url"] == "README.md#operate", name
        text = notes["summary"] + notes["description"]
        if "gpuwarden_node_info" in a["expr"]:
            assert "$labels.node" in notes["summary"] and "$labels.node" in notes["description"], name
        elif name != "GpuwardenAgentsAbsent":
            assert "$labels.instance" in notes["summary"], name
        assert "README.md#operate" in notes["description"], name
        # Where the alert is about a part, it names the part.
        carried = set().union(*(labels_of(m, recorded()) for m in references(a["expr"]).metrics))
        for part in ("port", "pci", "xid", "check", "outcome"):
            if part in carried:
                assert f"$labels.{part}" in text, (name, part)


def test_the_readmes_operate_section_the_alerts_link_to_names_real_alerts():
    readme = (ROOT / "README.md").read_text()
    assert "\n## Operate\n" in readme  # the anchor README.md#operate of every alert's runbook_url
    operate = readme.split("\n## Operate\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\bGpuwarden[A-Z][A-Za-z]+", operate)) - {"GpuwardenHealthy"}  # the node condition
    assert named and named <= set(alerts()), named - set(alerts())


def test_the_scrape_example_is_valid_and_names_the_instance_after_the_node():
    out = promtool("check", "config", "prometheus-scrape.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = yaml.safe_load((PROM / "prometheus-scrape.yml").read_text())
    assert cfg["rule_files"] == ["gpuwarden-rules.yml"]
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "gpuwarden" and job["static_configs"][0]["targets"] == ["127.0.0.1:9456"]
    # Static targets are there at once; the timeout is how long promtool waits for discovery to settle.
    sd = promtool("check", "service-discovery", "--timeout=2s", "prometheus-scrape.yml", "gpuwarden")
    assert sd.returncode == 0, sd.stdout + sd.stderr
    (target,) = yaml.safe_load(sd.stdout)
    assert target["labels"]["instance"] == "127.0.0.1" and target["labels"]["job"] == "gpuwarden"


# -- the series the rules and the dashboard need ----------------------------------------------------------------------
def test_the_job_metrics_appear_after_job_actions_with_every_action_and_doom_rule():
    from gpuwarden.agent.jobs import doom
    from gpuwarden.agent.jobs.respond import JOB_ACTION_KINDS

    series = after_job_actions()
    assert set(series) == {"gpuwarden_job_actions_total", "gpuwarden_job_fault_to_action_seconds",
                           "gpuwarden_job_gpu_seconds_saved_estimate_total"}
    assert values_of("gpuwarden_job_actions_total", "action") == set(JOB_ACTION_KINDS)
    assert values_of("gpuwarden_job_actions_total", "reason") == {r.name for r in doom.rules()}
    # The time to act is measured, and GPU-seconds saved estimated, only for what reached the scheduler; notify
    # ends no job and saves nothing.
    assert values_of("gpuwarden_job_fault_to_action_seconds", "action") == {"notify", "signal", "requeue", "cancel"}
    assert values_of("gpuwarden_job_gpu_seconds_saved_estimate_total", "action") == {"signal", "requeue", "cancel"}
    for text in _after_jobs_texts:
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr


def test_node_info_names_the_node_and_its_nvlink_domain():
    healthy = node_exposition("gb200-nvl72-healthy")
    assert ('gpuwarden_node_info{domain="62c4efc6-d460-488d-b7d7-69de49edd641.32766",node="gb200-rack07-tray03"} '
            '1.0') in healthy
    # The faulty tray's GPU 2 fell off the bus: its domain cannot be read, and is not guessed.
    assert 'gpuwarden_node_info{domain="",node="gb200-rack07-tray11"} 1.0' in node_exposition("gb200-nvl72-faulty")


def test_the_agents_own_series_on_a_recorded_node():
    text = node_exposition("gb200-nvl72-faulty")
    assert f'gpuwarden_build_info{{version="{metadata.version("gpuwarden")}"}} 1.0' in text
    assert "gpuwarden_loops_stalled 0.0" in text  # every loop made progress
    assert "gpuwarden_node_spare 0.0" in text  # dry-run never reads the scheduler
    (started,) = [float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("gpuwarden_start_time_seconds ")]
    assert 1.7e9 < started <= time.time()


def test_start_time_is_the_collectors_and_survives_each_scrape():
    from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
    from prometheus_client import generate_latest

    registry = registry_for(DaemonCollector(started=1796000000.5))
    for _ in range(2):
        text = generate_latest(registry).decode()
        assert "gpuwarden_start_time_seconds 1.7960000005e+09" in text


def test_live_samples_are_read_at_each_scrape():
    """What the collector reads at the scrape (the stalled loops) changes without a new snapshot."""
    from gpuwarden.agent.core.passive import MetricSample
    from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
    from prometheus_client import generate_latest

    stalled = []
    collector = DaemonCollector()
    collector.live(lambda: [MetricSample("gpuwarden_loops_stalled", "Stalled.", {}, float(len(stalled)))])
    registry = registry_for(collector)
    assert "gpuwarden_loops_stalled 0.0" in generate_latest(registry).decode()
    stalled.append("poll-xid")
    assert "gpuwarden_loops_stalled 1.0" in generate_latest(registry).decode()


@pytest.mark.parametrize("node", ["gb200-nvl72-faulty", "gb200-nvl72-healthy"])
def test_the_exposition_with_the_new_series_is_lint_clean(node):
    lint = subprocess.run(["promtool", "check", "metrics"], input=node_exposition(node), capture_output=True,
                          text=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr
