"""What /metrics carries on an idle node, scraped over HTTP from the daemon run on a recorded node: small (under
48 KB; it was 100 KB on the 4-GPU GB200 tray and 188 KB on the 8-GPU H100 node, most of it one series per NVLink
and error counter; the H100 node is 41 KB with its four NVSwitches' PCIe AER counters and the remediation
families), lint-clean, and still everything an operator alerts and graphs on, per GPU, per port and per
NVSwitch, with a link's own series where the link is not clean."""
from __future__ import annotations

import urllib.request

import pytest
from conftest import edit_nvml, promtool_lint, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs

MAX_PAGE = 48 * 1024


@pytest.fixture
def served(scenario_copy, tmp_path):
    """The daemon on a copy of a scenario (every check every 0.1 s) with its endpoint; returns (root, scrape)."""
    running = []

    def start(name: str):
        root = scenario_copy(name)
        store = Store(tmp_path / name / "state.db")
        collector = DaemonCollector()
        d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(all_specs()), store,
                   LocalAdapter(tmp_path / name / "actions.jsonl"), collector,
                   DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE}))
        ep = MetricsEndpoint("127.0.0.1", 0, registry_for(collector))
        d.start()
        ep.start()
        running.append((d, ep, store))

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=10).read().decode()

        # Steady state: every check has looked, and looked again (the clock-event ratios need two readings).
        wait_for(lambda: len(d.results()) == len(PASSIVE) + len(KERNEL_CONSUMERS), what="every check's first look")
        wait_for(lambda: "gpuwarden_gpu_clock_event_ratio{" in scrape(), what="a second clock-event reading")
        return root, d, scrape

    yield start
    for d, ep, store in running:
        ep.stop()
        d.stop()
        store.close()


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def value(text: str, line_start: str) -> float:
    (line,) = [s for s in series(text) if s.startswith(line_start + " ")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("name,gpus,ports", [("gb200-nvl72-healthy", 4, 4), ("h100-hgx-healthy", 8, 9)])
def test_an_idle_nodes_page_is_small_and_carries_what_an_operator_needs(served, name, gpus, ports):
    _, d, scrape = served(name)
    text = scrape()
    assert len(text.encode()) < MAX_PAGE, f"{name}: /metrics is {len(text.encode())} bytes"
    promtool_lint(text)
    assert all(r.status.value == "ok" for n, r in d.results().items() if n != "fabric"), d.results()
    for i in range(gpus):
        gpu = f'gpu="{i}"'
        assert value(text, f"gpuwarden_nvlink_links_active{{{gpu}}}") == 18.0
        assert value(text, f"gpuwarden_nvlink_links_down{{{gpu}}}") == 0.0
        assert value(text, f'gpuwarden_nvlink_errors{{counter="crc_flit",{gpu}}}') == 0.0
        assert value(text, f'gpuwarden_nvlink_error_rate_per_minute{{counter="recovery",{gpu}}}') == 0.0
        assert [s for s in series(text) if s.startswith("gpuwarden_gpu_info{" + gpu + ',uuid="GPU-')]
        assert [s for s in series(text) if s.startswith("gpuwarden_gpu_temperature_celsius{") and gpu in s]
    assert len([s for s in series(text) if s.startswith("gpuwarden_ib_port_up{")]) == ports
    assert "link=" not in text  # every link is clean
    uuids = [s for s in series(text) if ',uuid="' in s or '{uuid="' in s]
    assert len(uuids) == gpus and all(s.startswith("gpuwarden_gpu_info{") for s in uuids)  # once per GPU


def test_a_link_that_is_not_clean_gets_its_own_series(served):
    root, _, scrape = served("gb200-nvl72-healthy")

    def fault(data):
        data["gpus"][2]["nvlinks"][11]["state"] = 0
        data["gpus"][1]["nvlinks"][4]["errors"]["crc_flit"] = 7

    edit_nvml(root, fault)
    wait_for(lambda: 'gpuwarden_nvlink_link_up{gpu="2",link="11"} 0.0' in scrape(), what="the down link's series")
    text = wait_for(lambda: (lambda t: t if 'link="4"' in t else None)(scrape()), what="the link with errors")
    assert value(text, 'gpuwarden_nvlink_links_down{gpu="2"}') == 1.0
    assert value(text, 'gpuwarden_nvlink_links_active{gpu="2"}') == 17.0
    assert value(text, 'gpuwarden_nvlink_link_errors{counter="crc_flit",gpu="1",link="4"}') == 7.0
    assert value(text, 'gpuwarden_nvlink_errors{counter="crc_flit",gpu="1"}') == 7.0
    assert {s.split('link="')[1].split('"')[0] for s in series(text) if 'link="' in s} == {"4", "11"}
    promtool_lint(text)


def test_the_faulty_tray_names_each_nvswitch_and_port(served):
    _, d, scrape = served("gb200-nvl72-faulty")
    text = wait_for(lambda: (lambda t: t if "gpuwarden_nvswitch_sxid_events{" in t else None)(scrape()),
                    what="the SXid series")
    assert len(text.encode()) < MAX_PAGE
    promtool_lint(text)
    switches = {s.split('pci="')[1].split('"')[0] for s in series(text)
                if s.startswith("gpuwarden_nvswitch_sxid_events")}
    assert switches == {"0000:05:00.0", "0000:06:00.0", "0000:07:00.0"}
    assert value(text, 'gpuwarden_ib_port_up{port="mlx5_2/1"}') == 0.0


def test_per_gpu_series_name_the_gpu_by_index_and_gpu_info_maps_it_to_the_uuid():
    from conftest import exposition
    from gpuwarden.agent.core.passive import MetricSample

    def temp(gpu: str, uuid: str, value: float) -> MetricSample:
        return MetricSample("gpuwarden_gpu_temperature_celsius", "T.", {"gpu": gpu, "uuid": uuid, "sensor": "gpu"},
                            value)

    # GPU 1 read twice in one scrape under two UUIDs (indices shifted between two checks' reads after a GPU fell
    # off the bus): one series, never two with the same labels (Prometheus would reject the whole scrape).
    text = exposition([temp("0", "GPU-a", 40.0), temp("1", "GPU-b", 41.0), temp("1", "GPU-c", 42.0),
                       MetricSample("gpuwarden_ib_port_up", "Up.", {"port": "mlx5_0/1"}, 1.0)])
    lines = series(text)
    assert 'gpuwarden_gpu_temperature_celsius{gpu="0",sensor="gpu"} 40.0' in lines
    assert 'gpuwarden_gpu_temperature_celsius{gpu="1",sensor="gpu"} 41.0' in lines
    assert len([s for s in lines if s.startswith("gpuwarden_gpu_temperature_celsius")]) == 2
    assert {s for s in lines if s.startswith("gpuwarden_gpu_info")} == {
        'gpuwarden_gpu_info{gpu="0",uuid="GPU-a"} 1.0', 'gpuwarden_gpu_info{gpu="1",uuid="GPU-b"} 1.0'}
    assert 'gpuwarden_ib_port_up{port="mlx5_0/1"} 1.0' in lines
    promtool_lint(text)
