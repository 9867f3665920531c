"""NVLink lanes, continuously: every link a GPU should have is up, and the link-level error counters (CRC,
replay, recovery) rise no faster than NVIDIA's DCGM health watch tolerates, judged as rates over a window.

Which links a GPU should have: the SKU's link count (every known SKU has 18: NVLink 4 on H100/H200 SXM, NVLink 5
on B200/GB200/GB300) and every link ever seen active since the check first sampled the GPU (persisted), so a
link that drops is caught on any SKU. NVIDIA: an NVLink that is down needs a GPU reset or a node reboot
(XID 74 in the XID catalogue, checks/data/xid_catalog.csv) -> RESET_GPU.

Rates follow DCGM's NVLink health watch (NVIDIA/DCGM modules/health/DcgmHealthWatch.cpp MonitorNVLink, limits
in common/DcgmGPUHardwareLimits.h): it looks at the last minute; any CRC FLIT/DATA error warns and 100 or more
per second fail; any replay or recovery error fails. We differ on replays only: a replay is the link-level
retransmission that repairs a CRC error (the data still arrives), so it warns; a recovery is the link
retraining, during which traffic stalls, so it fails (DRAIN).

A GPU that reports no NVLink at all is told apart from one whose links are down. NVML answers NOT_SUPPORTED or
INVALID_ARGUMENT for every link of a GPU whose NVLinks are not exposed to the system (agent/sources/nvml reads those
as "no such link"): a real H200 passed through alone to a VM (fixtures/nodes/h200-vm-1gpu, driver 580.159.04:
no link, fabric state NOT_SUPPORTED, `nvidia-smi topo -m` with no NV# column), or the GPUs of a VM given without
their NVSwitches (NVIDIA Fabric Manager user guide, "Full Passthrough Virtualization Model", the one-GPU VM).
So, with `expect_nvlink = "auto"`, at a GPU's first look (no link of it ever reported):
- one GPU on the node and it reports no link: SKIPPED, the link count of the SKU does not apply here;
- several GPUs and none reports a link: UNKNOWN, naming the setting that says what the node is (a VM given GPUs
  without NVLink: expect_nvlink = "no"; NVLink that should be there: "yes"); never FAIL, which would drain every
  such VM, and never OK, since the SKU says the links exist;
- some GPUs report links and another reports none: that one FAILs for every link the SKU has (an asymmetry on one
  board is a fault, not a deployment).
A link once reported or seen active and now missing FAILs in every mode. `expect_nvlink = "yes"` judges the SKU's
links even on a GPU that never reported one; `"no"` expects no link (only those seen active count).

A link down is judged at the look that sees it (no settle time): preflight judges one look, and the daemon's first
poll makes the same decision; the down time is evidence only.

Counters are volatile (a GPU reset or driver reload zeroes them): a counter that went down is a reset and its
new value counts as the increase (Prometheus' rate() rule), so no delta is ever negative or spans two lives
of the counter. A first sample only sets the baseline: errors accumulated before it are not a rate.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.errors import ConfigError, NotApplicable
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass

CHECK_NAME = "nvlink_lanes"
COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")  # nvml.json / Nvml.nvlinks() names
CRC = ("crc_flit", "crc_data")
# Links per GPU by SKU: 18 on every known SKU (H100/H200 SXM: NVLink 4, "900 GB/s" = 18 x 50 GB/s; B200, GB200,
# GB300: NVLink 5, 1.8 TB/s = 18 x 100 GB/s; sources in checks/data/thresholds/peer_p2p.toml). Real H100
# `nvidia-smi nvlink -e` lists links 0..17 (fixtures/logs/nvswitch/stas00__nvidia-smi-nvlink-e__H100-FRAGMENT.txt).
SKU_LINKS = {"H100-SXM-HGX": 18, "H200-SXM-HGX": 18, "B200-HGX": 18, "GB200-NVL72": 18, "GB300-NVL72": 18}
EXPECT = ("auto", "yes", "no")


@dataclass(frozen=True)
class GpuLinks:
    index: int
    uuid: str  # the GPU's UUID (or its PCI address when NVML could not say)
    pci: str | None
    links: tuple[Mapping[str, Any], ...]  # Nvml.nvlinks(): {"link", "state", "errors": {replay, ...}}


@dataclass(frozen=True)
class NvlinkSample:
    expected_links: int  # per GPU, from the SKU or the config (0: only links seen active count)
    gpus: tuple[GpuLinks, ...]
    problems: tuple[Finding, ...]  # GPUs NVML could not read (lost -> FAIL, other errors -> UNKNOWN)
    # GPUs whose NVLink fabric registration has not completed yet (NVML fabric state NOT_STARTED or IN_PROGRESS):
    # their links come up only once Fabric Manager has trained them, so a link down there is not judged; the
    # check `fabric` fails a registration that does not complete within its settle_s.
    fabric_pending: frozenset[str] = frozenset()


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> NvlinkSample:
    readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: node.nvml.nvlinks(gpu))
    mode = cfg["expect_nvlink"]
    if mode not in EXPECT:
        raise ConfigError(f"checks.{CHECK_NAME}.expect_nvlink must be auto, yes or no, got {mode!r}")
    expected = 0 if mode == "no" else int(cfg["expected_links"]) or SKU_LINKS.get(node.info.sku, 0)
    gpus = tuple(GpuLinks(g.index, g.entity.id, g.pci, tuple(links)) for g, links in readings)
    known = state.get("gpus", {})
    seen_active = any(link.get("active_seen") for g in known.values() for link in g.get("links", {}).values())
    if not expected and not seen_active and not problems and not any(g.links for g in gpus):
        raise NotApplicable("no GPU reports an NVLink and none is expected"
                            + (" (expect_nvlink = \"no\")" if mode == "no" else " on this SKU"))
    silent = [g for g in gpus if not g.links and not _ever_reported(known.get(g.uuid))]
    if mode == "auto" and expected and gpus and len(silent) == len(gpus):
        # No GPU has ever reported a link: NVLink is not exposed here, or it is broken on every GPU at once.
        nvml = "NVML answers NOT_SUPPORTED or INVALID_ARGUMENT for every NVLink"
        if len(gpus) == 1 and not problems:
            raise NotApplicable(f"{nvml} of GPU {gpus[0].index}, the only GPU on this node: NVLink is not exposed "
                                f"to this system (a GPU passed through alone to a VM); the {expected} links per GPU "
                                f"of {node.info.sku} are not expected here")
        unknown = Finding(CHECK_NAME, "nvlink-not-exposed", Entity.node(node.hostname), Status.UNKNOWN,
                          f"{nvml} of each of the {len(gpus)} GPUs, where {node.info.sku} has {expected} per GPU: "
                          "NVLink is not exposed to this system (GPUs passed through to a VM without their "
                          "NVSwitches) or it is down on every GPU at once; say which: [checks.nvlink_lanes] "
                          "expect_nvlink = \"no\" for a node without NVLink, \"yes\" to judge the links as down",
                          Action.NONE, {"gpus": [g.index for g in gpus], "expected_links": expected,
                                        "sku": node.info.sku})
        return NvlinkSample(0, gpus, (*problems, unknown))
    return NvlinkSample(expected, gpus, tuple(problems), _fabric_pending(node, [g for g, _ in readings]))


FABRIC_PENDING_STATES = (1, 2)  # NVML_GPU_FABRIC_STATE_NOT_STARTED, _IN_PROGRESS (checks/fabric.py STATES)


def _fabric_pending(node: Any, gpus: list[Any]) -> frozenset[str]:
    """The GPUs still registering with the NVLink fabric. At boot the node agent can look before Fabric Manager has
    trained the links (FM user guide: GPUs register, then links train); links down then are the boot, not a fault.
    A GPU whose fabric state cannot be read is judged as usual."""
    pending = set()
    for gpu in gpus:
        try:
            state = int(node.nvml.fabric_info(gpu)["state"])
        except Exception:  # noqa: BLE001 - not supported, or unreadable: no reason to hold the judgement back
            continue
        if state in FABRIC_PENDING_STATES:
            pending.add(gpu.entity.id)
    return frozenset(pending)


def _ever_reported(rec: Mapping[str, Any] | None) -> bool:
    """Whether NVML ever reported a link of this GPU (a reported link has counters; one only expected has none)."""
    return rec is not None and any("counters" in link or link.get("active_seen") for link in rec["links"].values())


def _advance(link: dict[str, Any], counters: Mapping[str, int], now: float, window_s: float) -> None:
    """Fold one reading of a link's counters into its persisted record: the increase since the last reading
    (a decrease is a counter reset: the new value is the increase) and the window of recent increases."""
    window = link.setdefault("window", [])
    last, at = link.get("counters"), link.get("t")
    if last is not None and at is not None and now > at:
        before = [int(last.get(c, 0)) for c in COUNTERS]
        after = [counters[c] for c in COUNTERS]
        if any(a < b for a, b in zip(after, before, strict=True)):  # one reset zeroes every counter of the link
            link["resets"] = link.get("resets", 0) + 1
        window.append([at, now, *(a if a < b else a - b for a, b in zip(after, before, strict=True))])
    link["window"] = [w for w in window if w[1] > now - window_s]
    link["counters"], link["t"] = dict(counters), now


def rates_per_minute(window: list[list[float]]) -> tuple[dict[str, int], dict[str, float], float]:
    """(increase per counter, increase per minute, seconds covered) over the window's intervals."""
    if not window:
        return {c: 0 for c in COUNTERS}, {c: 0.0 for c in COUNTERS}, 0.0
    span = max(w[1] for w in window) - min(w[0] for w in window)
    counts = {c: int(sum(w[2 + i] for w in window)) for i, c in enumerate(COUNTERS)}
    return counts, {c: (60.0 * n / span if span > 0 else 0.0) for c, n in counts.items()}, span


def _copy_gpus(gpus: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the state's GPUs deep enough for judge to change: each GPU's and each link's dict, and a link's window
    list (appended to). What judge only replaces (a link's counters, a window's entries) is shared: a copy through
    JSON of 144 links with their windows was a fifth of a judgement."""
    def links(rec: Mapping[str, Any]) -> dict[str, Any]:
        return {n: {**lrec, "window": list(lrec["window"])} if "window" in lrec else dict(lrec)
                for n, lrec in rec["links"].items()}

    return {uuid: {**rec, "links": links(rec)} if "links" in rec else dict(rec) for uuid, rec in gpus.items()}


def judge(state: Mapping[str, Any], smp: NvlinkSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    gpus = _copy_gpus(state.get("gpus", {}))  # judge stays pure
    findings: list[Finding] = list(smp.problems)
    metrics: list[MetricSample] = []
    for g in smp.gpus:
        rec = gpus.get(g.uuid)
        if rec is None:
            rec = gpus[g.uuid] = {"first_seen": now, "links": {},
                                  "baseline_active": sum(1 for link in g.links if int(link["state"]) == 1)}
        rec["index"] = g.index
        links: dict[str, Any] = rec["links"]
        reported = {int(link["link"]): link for link in g.links}
        for n, link in reported.items():
            lrec = links.setdefault(str(n), {"active_seen": False})
            unread = link.get("unread")
            if unread:
                # Could not look at these counters: the link's counts stay where they were (the next good read
                # covers the whole interval), and each counter is UNKNOWN with NVML's reason.
                findings.append(_unread(Entity("nvlink", f"{g.uuid}/link{n}", g.index, g.pci, link=n), g, unread))
            else:  # a counter NVML does not offer on this GPU (NOT_SUPPORTED) is absent: it counts nothing
                _advance(lrec, {c: int(link["errors"].get(c, 0)) for c in COUNTERS}, now,
                         float(cfg["rate_window_s"]))
            lrec["state"] = int(link["state"])
            lrec["active_seen"] = lrec["active_seen"] or lrec["state"] == 1
        expected = set(range(smp.expected_links)) | {int(n) for n, lr in links.items() if lr.get("active_seen")}
        per_gpu = _GpuTotals()
        for n in sorted(expected | set(reported)):
            lrec = links.setdefault(str(n), {"active_seen": False})
            if n not in reported:
                lrec["state"] = None
            up = n in reported and int(reported[n]["state"]) == 1
            if up:
                lrec["down_since"] = None
            elif lrec.get("down_since") is None:
                lrec["down_since"] = now
            # The window's rates, taken once for the metrics and the findings (8 GPUs x 18 links a judgement).
            rated = rates_per_minute(lrec.get("window", [])) if n in reported and "counters" in lrec else None
            per_gpu.add({"gpu": str(g.index), "uuid": g.uuid, "link": str(n)}, up, n in expected, lrec, rated)
            link_entity = partial(Entity, "nvlink", f"{g.uuid}/link{n}", g.index, g.pci, link=n)  # made if needed
            if n in expected and not up and g.uuid not in smp.fabric_pending:
                findings.append(_down(link_entity(), g, lrec, n in reported, smp.expected_links, now,
                                      rec.get("baseline_active")))
            elif up and rated is not None:
                findings.extend(_rate_findings(link_entity, lrec, rated, cfg))
        metrics.extend(per_gpu.samples({"gpu": str(g.index), "uuid": g.uuid}))
    return Judgement({"gpus": gpus}, tuple(findings), tuple(metrics))


class _GpuTotals:
    """The metrics of one GPU's links: counts and error totals per GPU, and a link's own series only while it is
    not clean (not up, or any error counted or rising). 8 GPUs x 18 links x 4 counters would be 1,300 series of
    zeros on a healthy node, where what an operator alerts and graphs on is per GPU; the link that is not clean
    is named by its own series."""

    def __init__(self) -> None:
        self.active = self.down = 0
        self.errors = {c: 0.0 for c in COUNTERS}
        self.rates = {c: 0.0 for c in COUNTERS}
        self.links: list[MetricSample] = []

    def add(self, labels: Mapping[str, str], up: bool, expected: bool, lrec: Mapping[str, Any],
            rated: tuple[dict[str, int], dict[str, float], float] | None) -> None:
        """One link; `rated`, its window's rates_per_minute, where its counters were read (None: no counts)."""
        self.active += up
        self.down += expected and not up
        counters = {c: float(lrec["counters"][c]) for c in COUNTERS} if rated is not None else {}
        rates = rated[1] if rated is not None else {}
        for c in counters:
            self.errors[c] += counters[c]
            self.rates[c] += rates[c]
        if up and not any(counters.values()) and not any(rates.values()):
            return  # clean
        self.links.append(MetricSample("gpuwarden_nvlink_link_up", "1 if the NVLink is active, 0 if it is down or "
                                       "missing (only links that are not clean: down, or with errors).", labels,
                                       1.0 if up else 0.0))
        for c in counters:
            lab = {**labels, "counter": c}
            self.links.append(MetricSample("gpuwarden_nvlink_link_errors", "The link's NVLink error counter as NVML "
                                           "reports it (only links that are not clean).", lab, counters[c]))
            self.links.append(MetricSample("gpuwarden_nvlink_link_error_rate_per_minute", "Increase of the link's "
                                           "error counter per minute over the rate window (only links that are not "
                                           "clean).", lab, rates[c]))

    def samples(self, gpu: Mapping[str, str]) -> list[MetricSample]:
        out = [MetricSample("gpuwarden_nvlink_links_active", "NVLinks of the GPU that are active.", gpu,
                            float(self.active)),
               MetricSample("gpuwarden_nvlink_links_down", "NVLinks of the GPU that should be active (the SKU's "
                            "links, and any seen active) and are down or missing.", gpu, float(self.down))]
        for c in COUNTERS:
            lab = {**gpu, "counter": c}
            out.append(MetricSample("gpuwarden_nvlink_errors", "NVLink error counter summed over the GPU's links, as "
                                    "NVML reports it (volatile: a GPU reset zeroes it).", lab, self.errors[c]))
            out.append(MetricSample("gpuwarden_nvlink_error_rate_per_minute", "Increase of the NVLink error counter "
                                    "summed over the GPU's links, per minute over the rate window.", lab,
                                    self.rates[c]))
        return out + self.links


def _down(entity: Entity, g: GpuLinks, lrec: Mapping[str, Any], reported: bool, sku_links: int, now: float,
          baseline: int | None) -> Finding:
    why = "was active before" if lrec.get("active_seen") else f"the SKU has {sku_links} links per GPU"
    what = "inactive" if reported else "not reported by NVML"
    since = lrec.get("down_since", now)
    return Finding(CHECK_NAME, "nvlink-down", entity, Status.FAIL,
                   f"{entity.label()} ({g.uuid}) is {what} ({why}) for {now - since:.0f}s: NVLink traffic of this "
                   "GPU runs on fewer links or falls back to PCIe; a GPU reset or node reboot is needed",
                   Action.RESET_GPU,
                   {"state": lrec.get("state"), "reported": reported, "was_active": bool(lrec.get("active_seen")),
                    "expected_links": sku_links, "active_at_first_sample": baseline, "down_since": since,
                    "down_seconds": now - since})


def _unread(entity: Entity, g: GpuLinks, unread: Mapping[str, str]) -> Finding:
    what = ", ".join(f"{c} (NVML_ERROR_{code})" for c, code in sorted(unread.items()))
    return Finding(CHECK_NAME, "nvlink-counters-unread", entity, Status.UNKNOWN,
                   f"{entity.label()} ({g.uuid}): NVML could not read {what}: their rates are not judged until a "
                   "read succeeds", Action.NONE, {"unread": dict(unread)})


def _rate_findings(link_entity: Callable[[], Entity], lrec: Mapping[str, Any],
                   rated: tuple[dict[str, int], dict[str, float], float], cfg: Mapping[str, Any]) -> list[Finding]:
    """The rate findings of one link that is up, from its window's `rated` (rates_per_minute); its entity and the
    evidence are made only for a finding (a healthy node's 144 links make none)."""
    counts, rates, span = rated
    out: list[Finding] = []

    def add(code: str, status: Status, action: Action, msg: str) -> None:
        entity = link_entity()
        evidence = {"window_s": span, "increase": counts, "per_minute": {c: round(r, 3) for c, r in rates.items()},
                    "counters": dict(lrec["counters"]), "resets": lrec.get("resets", 0)}
        out.append(Finding(CHECK_NAME, code, entity, status, f"{entity.label()}: {msg}", action, evidence))

    if rates["recovery"] > cfg["recovery_fail_per_minute"]:
        add("nvlink-recovery-errors", Status.FAIL, Action.DRAIN,
            f"{counts['recovery']} link recovery event(s) in {span:.0f}s ({rates['recovery']:.1f}/min): the link "
            "retrains and traffic stalls; drain and reset the GPU, replace it if it repeats")
    crc = max(rates[c] for c in CRC)

    def crc_text() -> str:
        return ", ".join(f"{c} +{counts[c]} ({rates[c]:.1f}/min)" for c in CRC)

    if crc > cfg["crc_fail_per_minute"]:
        add("nvlink-crc-errors", Status.FAIL, Action.DRAIN,
            f"CRC errors at {crc / 60:.0f}/s ({crc_text()}), above the {cfg['crc_fail_per_minute'] / 60:g}/s DCGM "
            "fails at: the link is marginal")
    elif crc > cfg["crc_warn_per_minute"]:
        add("nvlink-crc-errors", Status.WARN, Action.MONITOR,
            f"CRC errors in the last {span:.0f}s ({crc_text()}): corrected by replays, watch the link")
    if rates["replay"] > cfg["replay_warn_per_minute"]:
        add("nvlink-replay-errors", Status.WARN, Action.MONITOR,
            f"{counts['replay']} replay(s) in {span:.0f}s ({rates['replay']:.1f}/min): retransmissions after "
            "link errors; watch the link")
    return out


def quiet(state: Mapping[str, Any]) -> bool:
    """Every link seen is up: with the same counters another look changes nothing but time."""
    return all(link.get("state") == 1 for g in state.get("gpus", {}).values() for link in g["links"].values())


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="NVLink links up (per GPU and link) and their CRC / replay / recovery error rates",
    sample=sample,
    judge=judge,
    interval_s=30.0,
    defaults={
        "expected_links": 0,  # links per GPU; 0 = the SKU's count (18), else only links once seen active
        "expect_nvlink": "auto",  # auto: a GPU that never reported a link is judged as in the module docstring |
                                  # yes: the SKU's links always | no: only links seen active
        "rate_window_s": 60.0,  # DCGM's NVLink health watch looks at the last minute
        "crc_warn_per_minute": 0.0,  # CRC FLIT or DATA errors above this rate warn (DCGM: any)
        "crc_fail_per_minute": 6000.0,  # ... and above this fail (DCGM: 100 per second)
        "replay_warn_per_minute": 0.0,  # replays above this rate warn
        "recovery_fail_per_minute": 0.0,  # recoveries (link retraining) above this rate fail (DCGM: any)
    },
    choices={"expect_nvlink": EXPECT},
    timeout_s=10.0,
    quiet=quiet,
    quiet_rejudge_s=300.0,  # 8 GPUs x 18 links x 4 counters: judging is most of a tick's cost
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="nvlink_lanes", order=60, level="quick", look="SPEC", poll="SPEC", poll_order=4, doom=("nvlink-down",),
)
