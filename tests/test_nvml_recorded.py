"""The recorded NVML must not be laxer than the real library: same names, signatures, types and errors."""
import ast
import ctypes
import inspect
from pathlib import Path

import pynvml
import pytest
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.nvml.bindings import GPU_FABRIC_INFO_V2, GpuFabricInfoV2, const
from gpuwarden.agent.sources.nvml.gpu import canonical_bdf
from gpuwarden.agent.sources.nvml.links import P2P_CAPS
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml

ROOT = Path(__file__).resolve().parent.parent

SNAPSHOT = {
    "format": 1, "driver_version": "570.133.20", "nvml_version": "12.570.133.20",
    "gpus": [
        {"index": 0, "name": "NVIDIA GB200", "uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555", "serial": "1",
         "pci_bus_id": "00000008:01:00.0", "memory_total_bytes": 199715979264,
         "ecc_mode": {"current": 1, "pending": 1},
         "ecc_errors": {"volatile": {"corrected": 0, "uncorrected": 0},
                        "aggregate": {"corrected": 7, "uncorrected": 0}},
         "remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False},
         "row_remapper_histogram": {"max": 3071, "high": 1, "partial": 0, "low": 0, "none": 0},
         "clocks_event_reasons": 1, "temperature": {"gpu": 40, "memory": 46},
         "nvlinks": [{"link": i, "state": 1, "errors": {"replay": 0, "recovery": 0, "crc_flit": i, "crc_data": 0}}
                     for i in range(18)],
         "fabric": {"cluster_uuid": "1d5e4a6c-7b8f-4c2d-9e01-23456789abcd", "clique_id": 32766, "state": 3,
                    "status": 0, "health_mask": 426},
         "errors": {"nvmlDeviceGetSerial": "NOT_SUPPORTED"}},
        {"index": 1, "name": "NVIDIA GB200", "uuid": "GPU-lost", "pci_bus_id": "00000009:01:00.0",
         "errors": {"*": "GPU_IS_LOST"}},
        {"index": 2, "name": "NVIDIA GB200", "uuid": "GPU-2", "pci_bus_id": "00000018:01:00.0",
         "memory_total_bytes": 1, "errors": {"nvmlDeviceGetTotalEccErrors": "UNKNOWN",
                                             "nvmlDeviceGetRemappedRows": "NOT_SUPPORTED"}},
    ],
}


def nvml() -> Nvml:
    n = Nvml(RecordedNvml(SNAPSHOT), "test")
    n._call("nvmlInit")
    return n


def test_every_recorded_function_exists_in_installed_pynvml_with_the_same_parameters():
    offered = [n for n in dir(RecordedNvml) if n.startswith("nvml")]
    assert len(offered) >= 20
    for name in offered:
        assert hasattr(pynvml, name), f"{name} is not in nvidia-ml-py {pynvml.__name__}"
        real = [p.name for p in inspect.signature(getattr(pynvml, name)).parameters.values()]
        fake = [p.name for p in inspect.signature(getattr(RecordedNvml, name)).parameters.values()][1:]
        assert fake == real, f"{name}: recorded takes {fake}, pynvml takes {real}"


def test_live_path_calls_only_functions_the_recorded_backend_offers():
    # Every pynvml function name the Nvml wrapper (any module of the source but the recorded backend itself)
    # calls must be served by the recorded backend, so the code exercised in tests is the code that runs on a GPU.
    called: set[str] = set()
    for path in (ROOT / "agent" / "sources" / "nvml").glob("*.py"):
        if path.name == "recorded.py":
            continue
        tree = ast.parse(path.read_text())
        called |= {node.args[1].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_dev"
                   and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)}
        called |= {node.args[0].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_call"
                   and node.args and isinstance(node.args[0], ast.Constant)}
    assert {"nvmlDeviceGetRowRemapperHistogram", "nvmlEventSetWait_v2"} <= called
    missing = sorted(c for c in called if not hasattr(RecordedNvml, c))
    assert not missing, missing


def test_return_types_match_pynvml():
    lib = RecordedNvml(SNAPSHOT)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(h, pynvml.c_nvmlDevice_t)  # a pointer, as live: a new object per call, the same address
    assert h is not lib.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(lib.nvmlDeviceGetPciInfo_v3(h), pynvml.nvmlPciInfo_t)
    assert isinstance(lib.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t)
    assert isinstance(lib.nvmlDeviceGetRowRemapperHistogram(h), pynvml.c_nvmlRowRemapperHistogramValues)
    fv = lib.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert isinstance(fv[0], pynvml.c_nvmlFieldValue_t) and fv[0].value.uiVal == 46
    assert isinstance(lib.nvmlDeviceGetRemappedRows(h), tuple)
    info = GpuFabricInfoV2(version=GPU_FABRIC_INFO_V2)  # what the source hands NVML (nvml.h's layout)
    assert lib.nvmlDeviceGetGpuFabricInfoV(h, pynvml.byref(info)) == pynvml.NVML_SUCCESS
    assert info.cliqueId == 32766 and info.state == 3 and info.healthMask == 426


def test_recorded_raises_the_real_pynvml_error_classes():
    lib = RecordedNvml(SNAPSHOT)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlDeviceGetCount()
    lib.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetSerial(lib.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetNvLinkState(lib.nvmlDeviceGetHandleByIndex(0), 18)


def test_wrapper_reads_everything_and_names_failures():
    n = nvml()
    gpus = n.gpus()
    assert [g.index for g in gpus] == [0, 1, 2]
    g0, lost, g2 = gpus
    assert g0.pci == "0008:01:00.0" and g0.uuid.startswith("GPU-0a1b") and g0.serial is None
    assert lost.error is not None and lost.error.gpu_lost and lost.uuid is None
    assert n.remapped_rows(g0) == {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
    assert n.row_remapper_histogram(g0)["high"] == 1
    assert n.temperatures(g0) == {"gpu": 40, "memory": 46}
    links = n.nvlinks(g0)
    assert len(links) == 18 and links[5]["errors"]["crc_flit"] == 5
    assert n.fabric_info(g0)["cluster_uuid"] == "1d5e4a6c-7b8f-4c2d-9e01-23456789abcd"
    with pytest.raises(NvmlError) as exc:
        n.ecc_errors(g2)
    assert exc.value.device == 2 and exc.value.call == "nvmlDeviceGetTotalEccErrors"
    assert "GPU 2" in str(exc.value) and "NVML_ERROR_UNKNOWN" in str(exc.value)
    with pytest.raises(NvmlError) as exc:
        n.remapped_rows(g2)
    assert exc.value.not_supported


def test_snapshot_round_trips_through_the_recorded_backend():
    first = nvml().snapshot()
    again = Nvml(RecordedNvml(first), "again")
    again._call("nvmlInit")
    assert again.snapshot() == first
    g0 = first["gpus"][0]
    for key in ("ecc_errors", "remapped_rows", "row_remapper_histogram", "nvlinks", "fabric", "temperature"):
        assert g0[key] == SNAPSHOT["gpus"][0][key]
    assert first["gpus"][1]["errors"] == {"*": "GPU_IS_LOST"}


def test_malformed_snapshot_is_a_clear_error_naming_the_gpu():
    broken = {"gpus": [{"index": 0, "uuid": "GPU-x", "pci_bus_id": "00000000:18:00.0"}]}
    n = Nvml(RecordedNvml(broken, "broken.json"), "broken.json")
    n._call("nvmlInit")
    (gpu,) = n.gpus()
    with pytest.raises(NvmlError) as exc:
        n.remapped_rows(gpu)
    assert "GPU 0" in str(exc.value) and "remapped_rows" in str(exc.value) and "broken.json" in str(exc.value)


def test_only_the_nvml_source_imports_pynvml():
    importers = []
    for path in list((ROOT / "agent").rglob("*.py")) + list((ROOT / "checks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "pynvml" for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers and all(p.startswith("agent/sources/nvml/") for p in importers), importers


def test_canonical_bdf():
    assert canonical_bdf("00000008:01:00.0") == "0008:01:00.0"
    assert canonical_bdf("00000000:1B:00.0") == "0000:1b:00.0"


def test_a_handle_stays_valid_when_the_recording_is_read_again():
    """A recorded node re-reads nvml.json into a new backend while other threads hold the last one's handles
    (a poll mid-sample when a test edits the file): those handles still name the same GPU, as live ones do."""
    from conftest import ROOT
    from gpuwarden.agent.sources.nvml.recorded import RecordedNvml

    path = ROOT / "fixtures/nodes/h100-hgx-healthy/nvml.json"
    first, second = RecordedNvml.from_file(path), RecordedNvml.from_file(path)
    first.nvmlInit()
    second.nvmlInit()
    handle = first.nvmlDeviceGetHandleByIndex(3)
    assert second.nvmlDeviceGetUUID(handle) == first.nvmlDeviceGetUUID(handle)
    assert second.nvmlDeviceGetNvLinkState(handle, 0) == first.nvmlDeviceGetNvLinkState(handle, 0)


# ---------------------------------------------------------------- every allowed nvidia-ml-py (.ci/run runs both ends)
def test_constants_are_ints_whatever_the_bindings_write():
    """Every release defines NVML_P2P_CAPS_INDEX_READ = 0, (a tuple): handed to NVML it raised ctypes.ArgumentError
    and crashed peer_p2p and `record` on every live node."""
    assert const("NVML_P2P_CAPS_INDEX_READ") == 0
    assert all(type(v) is int for v in P2P_CAPS.values()) and len(set(P2P_CAPS.values())) == 4


def test_fabric_info_layout_is_nvml_h_and_the_bindings_agree_where_theirs_is_right():
    assert ctypes.sizeof(GpuFabricInfoV2) == 36 and GPU_FABRIC_INFO_V2 == 0x02000024  # nvml.h nvmlGpuFabricInfo_v2
    theirs = pynvml.c_nvmlGpuFabricInfoV_t
    if ctypes.sizeof(theirs) == ctypes.sizeof(GpuFabricInfoV2):  # 12.570 on; 12.550-12.560 declare 80 UUID bytes
        for name in ("clusterUuid", "status", "cliqueId", "state", "healthMask"):
            assert getattr(theirs, name).offset == getattr(GpuFabricInfoV2, name).offset, name


def test_a_uuid_byte_of_zero_survives():
    fabric = {**SNAPSHOT["gpus"][0]["fabric"], "cluster_uuid": "00000000-7b8f-4c2d-9e01-2345678900cd"}
    snap = {**SNAPSHOT, "gpus": [dict(SNAPSHOT["gpus"][0], fabric=fabric)]}
    n = Nvml(RecordedNvml(snap), "test")
    n._call("nvmlInit")
    assert n.fabric_info(n.gpus()[0])["cluster_uuid"] == "00000000-7b8f-4c2d-9e01-2345678900cd"


def test_the_recorded_backend_refuses_what_ctypes_refuses():
    """Not laxer than the live library: a tuple where NVML takes an unsigned int is a ctypes.ArgumentError."""
    lib = RecordedNvml(SNAPSHOT)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    for call in (lambda: lib.nvmlDeviceGetP2PStatus(h, h, (0,)), lambda: lib.nvmlDeviceGetNvLinkState(h, (0,)),
                 lambda: lib.nvmlDeviceGetTemperature(h, (0,)), lambda: lib.nvmlDeviceGetHandleByIndex((0,))):
        with pytest.raises(ctypes.ArgumentError):
            call()


class Raising:
    """A backend whose every call raises `exc`: what the bindings can throw besides NVMLError."""

    def __init__(self, exc):
        self.exc = exc

    def __getattr__(self, name):
        def call(*args):
            raise self.exc
        return call


@pytest.mark.parametrize("exc", [ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3"),
                                 RuntimeError("driver/library version mismatch"), AttributeError("_fields_"),
                                 pynvml.NVMLError(999999), OverflowError("int too big to convert")],
                         ids=lambda e: type(e).__name__)
def test_no_library_error_type_leaves_the_source(exc):
    n = Nvml(Raising(exc), "test")
    with pytest.raises(NvmlError) as caught:
        n.driver_version()
    assert caught.value.call == "nvmlSystemGetDriverVersion"
    assert type(caught.value) is NvmlError and caught.value.__cause__ is None


def test_p2p_status_through_the_live_code_path_with_every_capability():
    n = Nvml(RecordedNvml({**SNAPSHOT, "gpus": [dict(SNAPSHOT["gpus"][0], p2p={"1": dict.fromkeys(P2P_CAPS, "OK")}),
                                                dict(SNAPSHOT["gpus"][0], index=1, p2p={})]}), "test")
    n._call("nvmlInit")
    g0, g1 = n.gpus()
    assert n.p2p_status(g0, g1) == dict.fromkeys(P2P_CAPS, "OK")
