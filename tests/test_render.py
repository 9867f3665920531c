import io

from gpuwarden.agent.core.model import Action, CheckResult, Entity, Finding, Report, Status
from gpuwarden.agent.core.render import Progress, table


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_running_checks_on_a_tty_and_clears():
    stream = FakeTty()
    progress = Progress(stream, delay_s=0.0)
    progress("dcgm_diag", "start", None)
    assert "running: dcgm_diag 0s" in stream.getvalue()
    progress("dcgm_diag", "done", CheckResult("dcgm_diag", Status.OK))
    progress.close()
    assert stream.getvalue().endswith("\r\033[K")


def test_progress_is_silent_when_not_a_tty():
    stream = io.StringIO()
    progress = Progress(stream, delay_s=0.0)
    progress("x", "start", None)
    progress.close()
    assert stream.getvalue() == ""


def test_table_lists_every_finding_with_entity_action_and_verdict():
    gpu = Entity("gpu", "GPU-d31f", 2, "0018:01:00.0")
    report = Report("node1", (
        CheckResult("xid", Status.FAIL, (Finding("xid", "79", gpu, Status.FAIL, "fallen off the bus", Action.REBOOT),)),
        CheckResult("ib_port", Status.SKIPPED, error="no InfiniBand/RoCE port"),
    ))
    text = table(report)
    assert "xid     FAIL     REBOOT      79" in text and "GPU 2 GPU-d31f 0018:01:00.0" in text
    assert "SKIP" in text and "no InfiniBand/RoCE port" in text
    assert text.rstrip().endswith("verdict: FAULT: action needed (exit 1)")
