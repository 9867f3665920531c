"""The agent's structured log lines: what journald and log shippers read (JSON), and what a person reads (console)."""
from __future__ import annotations

import io
import json
import re
import sys
import threading
from pathlib import Path

import pytest
from gpuwarden.agent.core import logs

log = logs.get_logger("gpuwarden.test")


@pytest.fixture(autouse=True)
def _restore():
    with logs.preserved():
        yield


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_line_holds_the_keys_then_event_level_and_a_utc_timestamp():
    out = io.StringIO()
    logs.setup("auto", "info", out)  # not a TTY: JSON
    log.info("running", checks=5, node="n1", root=Path("/x"), ratio=0.5, gone=None)
    (line,) = out.getvalue().splitlines()
    entry = json.loads(line)
    assert list(entry) == ["checks", "node", "root", "ratio", "gone", "event", "level", "timestamp"]
    assert entry["event"] == "running" and entry["level"] == "info" and entry["root"] == "PosixPath('/x')"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", entry["timestamp"])
    assert '"event": "running"' in line  # what the systemd test and journal greps look for


def test_level_filter():
    out = io.StringIO()
    logs.setup("json", "warning", out)
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [json.loads(x)["event"] for x in out.getvalue().splitlines()] == ["w", "e"]
    logs.setup("json", "debug", out)
    log.debug("d2")
    assert json.loads(out.getvalue().splitlines()[-1]) | {"timestamp": 0} == {"event": "d2", "level": "debug",
                                                                              "timestamp": 0}
    logs.setup("json", "nonsense", out)  # an unknown level is info
    log.debug("hidden")
    log.info("shown")
    assert json.loads(out.getvalue().splitlines()[-1])["event"] == "shown"


def test_console_on_a_tty_is_one_readable_line():
    out = Tty()
    logs.setup("auto", "info", out)
    log.warning("port down", port="mlx5_0/1", reason="link down", n=3)
    (line,) = out.getvalue().splitlines()
    assert re.fullmatch(r"\S+Z \[warning  \] port down +n=3 port=mlx5_0/1 reason='link down'", line), line


def test_exception_is_an_error_with_its_traceback():
    out = io.StringIO()
    logs.setup("json", "info", out)
    try:
        raise ValueError("bad value")
    except ValueError:
        log.exception("poll failed", check="xid")
    entry = json.loads(out.getvalue())
    assert entry["level"] == "error" and entry["check"] == "xid"
    assert "Traceback" in entry["exception"] and entry["exception"].endswith("ValueError: bad value")


def test_writes_to_stderr_as_it_is_when_the_line_is_written(monkeypatch):
    logs.setup("json", "info")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.info("one")
    monkeypatch.setattr(sys, "stderr", second)
    log.info("two")
    first.close()  # a closed stream from before must not matter
    log.info("three")
    assert [json.loads(x)["event"] for x in second.getvalue().splitlines()] == ["two", "three"]


def test_lines_from_many_threads_stay_whole():
    out = io.StringIO()
    logs.setup("json", "info", out)

    def burst(i: int) -> None:
        for j in range(200):
            log.info("tick", thread=i, j=j, pad="x" * 200)

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(entries) == 800
    for i in range(4):
        assert [e["j"] for e in entries if e["thread"] == i] == list(range(200))


def test_capture_and_silenced():
    logs.setup("json", "error", io.StringIO())
    with logs.capture() as entries:
        log.debug("seen in capture", k=1)
    assert entries == [{"k": 1, "event": "seen in capture", "level": "debug"}]
    out = io.StringIO()
    logs.setup("json", "info", out)
    with logs.silenced("critical"):
        log.error("quiet")
        log.critical("loud")
    log.info("after")
    assert [json.loads(x)["event"] for x in out.getvalue().splitlines()] == ["loud", "after"]
