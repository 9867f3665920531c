import json

from gpuwarden.agent.core.model import (
    Action,
    CheckResult,
    Entity,
    Finding,
    Report,
    Status,
    fold_status,
    verdict_exit_code,
)
from hypothesis import given
from hypothesis import strategies as st

entities = st.builds(Entity, kind=st.sampled_from(["gpu", "ib_port", "pcie", "nvlink", "node"]),
                     id=st.text(min_size=1), index=st.none() | st.integers(0, 71), pci=st.none() | st.text(),
                     link=st.none() | st.integers(0, 17))
evidence = st.dictionaries(st.text(), st.none() | st.booleans() | st.integers() | st.text())
findings = st.builds(Finding, check=st.text(min_size=1), code=st.text(min_size=1), entity=entities,
                     status=st.sampled_from([Status.WARN, Status.FAIL, Status.UNKNOWN]), message=st.text(),
                     action=st.sampled_from(list(Action)), evidence=evidence)
results = st.builds(CheckResult, check=st.text(min_size=1), status=st.sampled_from(list(Status)),
                    findings=st.lists(findings, max_size=4).map(tuple), error=st.none() | st.text(),
                    duration_s=st.floats(0, 1e4).map(lambda x: round(x, 3)), source=st.none() | st.text(),
                    notes=st.lists(st.text(), max_size=2).map(tuple))


@given(st.lists(results, max_size=4), st.text())
def test_report_json_round_trips(rs, node):
    report = Report(node=node, results=tuple(rs), source="x")
    back = Report.from_dict(json.loads(report.to_json()))
    assert back == report
    assert back.exit_code == report.exit_code


def test_action_ladder_order():
    ladder = [Action.NONE, Action.MONITOR, Action.RESTART_APP, Action.DRAIN, Action.RESET_GPU, Action.REBOOT,
              Action.SERVICE]
    assert sorted(ladder) == ladder


def test_exit_codes():
    ok = CheckResult("a", Status.OK)
    warn = CheckResult("b", Status.WARN)
    unknown = CheckResult("c", Status.UNKNOWN, error="could not look")
    fail = CheckResult("d", Status.FAIL)
    skipped = CheckResult("e", Status.SKIPPED)
    assert verdict_exit_code([ok, warn, skipped]) == 0
    assert verdict_exit_code([ok, unknown]) == 2
    assert verdict_exit_code([unknown, fail]) == 1  # a known fault outranks "could not look"


def test_fold_status_is_ok_only_without_findings():
    gpu = Entity("gpu", "GPU-1", 0, "0000:18:00.0")
    assert fold_status([]) is Status.OK
    w = Finding("ecc", "x", gpu, Status.WARN, "m")
    u = Finding("ecc", "y", gpu, Status.UNKNOWN, "m")
    f = Finding("ecc", "z", gpu, Status.FAIL, "m")
    assert fold_status([w]) is Status.WARN
    assert fold_status([w, u]) is Status.UNKNOWN
    assert fold_status([u, f, w]) is Status.FAIL


def test_gpu_entity_label_names_index_uuid_and_pci():
    e = Entity("gpu", "GPU-5f4b", 2, "0018:01:00.0")
    assert e.label() == "GPU 2 GPU-5f4b 0018:01:00.0"
    assert e.to_dict() == {"kind": "gpu", "id": "GPU-5f4b", "index": 2, "pci": "0018:01:00.0"}
