import threading

from gpuwarden.agent.core import config
from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.errors import NotApplicable, SourceError, ToolMissing
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.node.runner import run_checks

GPU = Entity("gpu", "GPU-1", 0, "0000:18:00.0")


def spec(name, fn, timeout_s=5.0):
    return CheckSpec(name=name, summary=name, run=fn, timeout_s=timeout_s)


def run(*specs):
    return run_checks(object(), specs, config.defaults(specs))


def test_each_way_a_check_ends():
    release = threading.Event()

    def hangs(node, cfg):
        release.wait(30)
        return []

    def finds(node, cfg):
        yield Finding("finds", "x", GPU, Status.WARN, "warm", Action.MONITOR)

    def source_error(node, cfg):
        raise SourceError("/sys/class/infiniband/mlx5_0/ports/1/state: cannot read")

    def crashes(node, cfg):
        return {}["missing"]

    def not_here(node, cfg):
        raise NotApplicable("no InfiniBand HCA")

    def no_tool(node, cfg):
        raise ToolMissing("dcgmi: not installed")

    results = {r.check: r for r in run(
        spec("ok", lambda n, c: []), spec("finds", finds), spec("hangs", hangs, timeout_s=0.2),
        spec("source_error", source_error), spec("crashes", crashes), spec("not_here", not_here),
        spec("no_tool", no_tool))}
    release.set()
    assert results["ok"].status is Status.OK and results["ok"].error is None
    assert results["finds"].status is Status.WARN and results["finds"].action is Action.MONITOR
    assert results["hangs"].status is Status.UNKNOWN and "timed out after 0.2s" in results["hangs"].error
    assert results["source_error"].status is Status.UNKNOWN and "mlx5_0" in results["source_error"].error
    assert results["crashes"].status is Status.UNKNOWN and "KeyError" in results["crashes"].error
    assert results["not_here"].status is Status.SKIPPED and "InfiniBand" in results["not_here"].error
    assert results["no_tool"].status is Status.SKIPPED


def test_checks_run_concurrently():
    # Both checks must be inside run() at the same time for the barrier to open.
    barrier = threading.Barrier(2, timeout=10)

    def meet(node, cfg):
        barrier.wait()
        return []

    results = run(spec("a", meet, timeout_s=20), spec("b", meet, timeout_s=20))
    assert [r.status for r in results] == [Status.OK, Status.OK]


def test_config_timeout_overrides_the_checks_own():
    release = threading.Event()
    specs = [spec("slow", lambda n, c: release.wait(30) and [], timeout_s=60)]
    cfg = config.defaults(specs)
    cfg.agent["check_timeout_s"] = 0.1
    (result,) = run_checks(object(), specs, cfg)
    release.set()
    assert result.status is Status.UNKNOWN and "0.1s" in result.error


def test_checks_sharing_a_resource_take_turns():
    inside = []
    overlap = []
    gate = threading.Lock()

    def exclusive(name):
        def run(node, cfg):
            with gate:
                if inside:
                    overlap.append((inside[0], name))
                inside.append(name)
            threading.Event().wait(0.05)
            with gate:
                inside.remove(name)
            return []
        return run

    specs = [CheckSpec(name=n, summary=n, run=exclusive(n), resources=("gpu",), timeout_s=10) for n in "abc"]
    results = run_checks(object(), specs, config.defaults(specs))
    assert [r.status for r in results] == [Status.OK] * 3
    assert overlap == []  # never two "gpu" checks at once


def test_budget_marks_checks_that_could_not_start_unknown():
    release = threading.Event()

    def hog(node, cfg):
        release.wait(30)
        return []

    specs = [CheckSpec(name="first", summary="", run=hog, resources=("gpu",), timeout_s=30),
             CheckSpec(name="second", summary="", run=lambda n, c: [], resources=("gpu",), timeout_s=30)]
    results = {r.check: r for r in run_checks(object(), specs, config.defaults(specs), budget_s=0.3)}
    release.set()
    assert results["first"].status is Status.UNKNOWN and "timed out" in results["first"].error
    assert results["second"].status is Status.UNKNOWN and "budget" in results["second"].error


def test_findings_before_a_crash_are_kept():
    def partial(node, cfg):
        yield Finding("partial", "gpu-lost", GPU, Status.FAIL, "lost", Action.REBOOT)
        raise SourceError("nvbandwidth: no answer within 60s")

    def partial_warn(node, cfg):
        yield Finding("partial_warn", "x", GPU, Status.WARN, "warm", Action.MONITOR)
        raise ValueError("boom")

    results = {r.check: r for r in run(spec("partial", partial), spec("partial_warn", partial_warn))}
    assert results["partial"].status is Status.FAIL and len(results["partial"].findings) == 1
    assert "nvbandwidth" in results["partial"].error
    assert results["partial_warn"].status is Status.UNKNOWN and "ValueError" in results["partial_warn"].error


def test_findings_before_a_timeout_are_kept():
    """A check that found a fault and then hangs (a driver call that never returns) is that FAIL, with the timeout
    as its error: running out of time must not turn what was found into an UNKNOWN."""
    release = threading.Event()

    def found_then_hangs(node, cfg):
        yield Finding("hangs", "gpu-lost", GPU, Status.FAIL, "lost", Action.REBOOT)
        release.wait(30)

    def warned_then_hangs(node, cfg):
        yield Finding("warns", "x", GPU, Status.WARN, "warm", Action.MONITOR)
        release.wait(30)

    try:
        results = {r.check: r for r in run(spec("hangs", found_then_hangs, timeout_s=0.3),
                                           spec("warns", warned_then_hangs, timeout_s=0.3))}
    finally:
        release.set()
    assert results["hangs"].status is Status.FAIL and "timed out" in results["hangs"].error
    assert [f.code for f in results["hangs"].findings] == ["gpu-lost"]
    assert results["warns"].status is Status.UNKNOWN and [f.code for f in results["warns"].findings] == ["x"]
