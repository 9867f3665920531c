"""GEMM burn-in and device-to-device copies through PyTorch: the only code that imports torch.

PyTorch is optional (`pip install 'gpuwarden[burnin]'`). `Gemm` is the source the checks call: live it runs
torch on the devices; on a recorded node it replays `tools/burnin.json` (a list of per-device results, see
`GemmResult.from_dict`); `tools/burnin.hang` makes the call behave like a GEMM that never returns, so the
runner's timeout path is exercised without a real hang.

Checksums are compared bitwise. cuBLAS documents ("Results reproducibility", cuBLAS library guide,
docs.nvidia.com/cuda/cublas): "By design, all cuBLAS API routines from a given toolkit version generate the
same bit-wise results at every run when executed on GPUs with the same architecture and the same number of
SMs", as long as a single CUDA stream is active. Every device here multiplies the same matrices (made on the
CPU from the seed, then copied) with one toolkit on its default stream, so GPUs of one model (same name and
SM count) must agree bit for bit; GPUs of different models may legitimately differ in low bits and are never
compared with each other (the check groups by model).
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import warnings
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.tools import current_scope

BURNIN_FILE = "burnin.json"
DTYPES = ("bfloat16", "float16", "float32")
# Seconds a recorded hang blocks (the runner's check timeout fires long before).
RECORDED_HANG_S = 3600.0


class CopyMismatch(SourceError):
    """A device-to-device copy delivered different bytes than it was given (not a failure to run)."""


@dataclass(frozen=True)
class GemmResult:
    device: str  # "cuda:3", "cpu"
    tflops: float  # achieved, 2*n^3 flops per multiply over the timed loop
    iterations: int
    checksum: str  # sha256 of the result matrix's bytes (bitwise)
    name: str | None = None  # device model as the runtime names it, "NVIDIA H100 80GB HBM3"
    sm_count: int | None = None  # streaming multiprocessors (cuBLAS bitwise guarantee needs the same count)
    stable: bool = True  # the last result equals the first: the same GPU gave the same answer every time

    @classmethod
    def from_dict(cls, d: Any, origin: str) -> "GemmResult":
        """One entry of a recorded burnin.json; SourceError names the file and what is wrong."""
        if not isinstance(d, dict):
            raise SourceError(f"{origin}: each entry must be an object, got {type(d).__name__}")
        try:
            return cls(device=str(d["device"]), tflops=float(d["tflops"]), iterations=int(d["iterations"]),
                       checksum=str(d["checksum"]), name=d.get("name"),
                       sm_count=None if d.get("sm_count") is None else int(d["sm_count"]),
                       stable=bool(d.get("stable", True)))
        except KeyError as exc:
            raise SourceError(f"{origin}: entry for {d.get('device', '?')} has no {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{origin}: entry for {d.get('device', '?')}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _import_torch() -> Any:
    # CUDA orders devices fastest-first unless told otherwise; NVML orders by PCI bus. With PCI order the CUDA
    # ordinal of a GPU is its NVML index (when no CUDA_VISIBLE_DEVICES narrows the set). It must be set before
    # CUDA initialises, i.e. before torch first touches a GPU; an explicit setting by the operator wins.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with warnings.catch_warnings():
        # A torch wheel without numpy warns "Failed to initialize NumPy" at import; nothing here needs numpy.
        warnings.filterwarnings("ignore", message=".*NumPy.*")
        import torch  # optional dependency: the burnin extra; without it burnin and the peer copies are SKIPPED
    return torch


@lru_cache(maxsize=1)
def _torch_or_none() -> Any:
    try:
        return _import_torch()
    except ImportError:
        return None


def torch_available() -> bool:
    """PyTorch importable (CPU-only builds count: the checks run on the CPU in CI)."""
    return _torch_or_none() is not None


def _torch() -> Any:
    torch = _torch_or_none()
    if torch is None:
        raise SourceError("PyTorch is not installed (pip install 'gpuwarden[burnin]')")
    return torch


def _dtype(torch: Any, name: str) -> Any:
    if name not in DTYPES:
        raise SourceError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


@lru_cache(maxsize=1)
def _inputs(n: int, dtype: str, seed: int) -> tuple[Any, Any]:
    """The two operands, generated on the CPU from the seed so every device multiplies the same bits."""
    torch = _torch()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32).to(_dtype(torch, dtype))
    b = torch.randn(n, n, generator=gen, dtype=torch.float32).to(_dtype(torch, dtype))
    return a, b


def _sync(torch: Any, *devs: Any) -> None:
    for dev in devs:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _checksum(tensor: Any) -> str:
    """sha256 of the tensor's bytes, on the CPU (no numpy needed: the bytes are read at the data pointer)."""
    import hashlib  # at use: +4 ms (python -X importtime) to a full check that takes no checksum (no torch)

    host = tensor.detach().to("cpu").contiguous()
    return hashlib.sha256(ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())).hexdigest()


def _device_info(torch: Any, dev: Any) -> tuple[str | None, int | None]:
    if dev.type != "cuda":
        return None, None
    props = torch.cuda.get_device_properties(dev)
    return str(props.name), int(props.multi_processor_count)


def run_gemm(device: str, n: int, dtype: str, seconds: float, seed: int) -> GemmResult:
    """Multiply two seeded n x n matrices on `device` in a loop for about `seconds`; report TFLOP/s and a
    checksum of the result. Any torch/CUDA failure becomes SourceError naming the device."""
    torch = _torch()
    try:
        dev = torch.device(device)
        a_host, b_host = _inputs(n, dtype, seed)
        a, b = a_host.to(dev), b_host.to(dev)
        c = torch.matmul(a, b)  # warm-up: cuBLAS handle, algorithm choice, clocks ramp
        _sync(torch, dev)
        first = c.clone()
        batch, iterations, start = 1, 0, time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds or iterations == 0:
            for _ in range(batch):
                torch.matmul(a, b, out=c)
            _sync(torch, dev)  # kernels are asynchronous: only a synchronised clock means anything
            iterations += batch
            elapsed = time.perf_counter() - start
            # Grow the batch so the host checks the clock a few times a second, not after every kernel.
            per_iter = elapsed / iterations
            batch = max(1, min(batch * 2, int(0.25 / per_iter) if per_iter > 0 else batch * 2))
        stable = bool(torch.equal(first, c))
        name, sms = _device_info(torch, dev)
        checksum = _checksum(c)
    except SourceError:
        raise
    except (RuntimeError, AssertionError, ValueError, TypeError, MemoryError) as exc:
        # CUDA errors (incl. OOM) are RuntimeError; a CPU-only torch asked for CUDA raises AssertionError.
        raise SourceError(f"{device}: GEMM failed: {type(exc).__name__}: {str(exc).strip()[:300]}") from None
    tflops = 2.0 * n ** 3 * iterations / elapsed / 1e12
    return GemmResult(device, tflops, iterations, checksum, name, sms, stable)


def copy_bandwidth(src: str, dst: str, nbytes: int, seconds: float) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s): `dst` buffer filled from `src` in a loop for
    about `seconds`. Between two GPUs torch copies peer-to-peer when the pair allows it, else through the host,
    so a pair that lost NVLink shows up as a low figure."""
    torch = _torch()
    try:
        s, d = torch.device(src), torch.device(dst)
        a = torch.empty(nbytes, dtype=torch.uint8, device=s).fill_(0x5A)
        b = torch.empty(nbytes, dtype=torch.uint8, device=d)
        b.copy_(a)  # warm-up: enables peer access, maps the buffers
        _sync(torch, s, d)
        copies, start, elapsed = 0, time.perf_counter(), 0.0
        while elapsed < seconds or copies == 0:
            b.copy_(a, non_blocking=True)
            copies += 1
            if copies % 8 == 0 or s.type != "cuda":
                _sync(torch, s, d)
                elapsed = time.perf_counter() - start
        _sync(torch, s, d)
        elapsed = time.perf_counter() - start
        if not bool((b == 0x5A).all()):  # checked where it landed: no second trip over the link
            raise CopyMismatch(f"{src} -> {dst}: copied data differs from the source")
    except SourceError:
        raise
    except (RuntimeError, AssertionError, ValueError, TypeError, MemoryError) as exc:
        raise SourceError(f"{src} -> {dst}: copy failed: {type(exc).__name__}: {str(exc).strip()[:300]}") from None
    return nbytes * copies / elapsed / 1e9


def cuda_ordinals() -> dict[str, int]:
    """CUDA ordinal per canonical PCI address ("0000:19:00.0"), from torch's device properties; {} when torch
    cannot say (no CUDA, or a torch without PCI fields): callers then fall back to NVML index order."""
    torch = _torch_or_none()
    out: dict[str, int] = {}
    try:
        if torch is None or not torch.cuda.is_available():
            return {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            fields = [getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
            if any(f is None for f in fields):
                return {}
            domain, bus, dev = (int(f) for f in fields)
            out[f"{domain:04x}:{bus:02x}:{dev:02x}.0"] = i
    except (RuntimeError, AssertionError):
        return {}
    return out


class Gemm:
    """The burn-in source: live torch, or a recorded node's tools/burnin.json."""

    def __init__(self, recorded_dir: Path | None = None, use_torch: bool = True):
        self.recorded_dir = None if recorded_dir is None else Path(recorded_dir)
        self.use_torch = use_torch

    @classmethod
    def for_node(cls, node: Any, use_torch: bool = True) -> "Gemm":
        """Live on a live node, recorded (root/tools) on a recorded one."""
        return cls(Path(node.root) / "tools" if node.recorded else None, use_torch)

    @property
    def recorded(self) -> bool:
        return self.recorded_dir is not None

    def available(self, device: str = "cuda") -> bool:
        """Can this source produce results for `device` ("cuda" or "cpu")?"""
        return not self.why_unavailable(device)

    def why_unavailable(self, device: str = "cuda") -> str:
        """"" when available, else why not (for the check's SKIPPED reason or finding)."""
        if self.recorded_dir is not None:
            hang = (self.recorded_dir / "burnin.hang").exists()
            return "" if hang or (self.recorded_dir / BURNIN_FILE).exists() else \
                f"no recorded tools/{BURNIN_FILE}"
        if not self.use_torch:
            return "PyTorch not used (use_torch = false)"
        torch = _torch_or_none()
        if torch is None:
            return "PyTorch not installed (pip install 'gpuwarden[burnin]')"
        if device.startswith("cuda") and not torch.cuda.is_available():
            return f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build, or no driver)"
        return ""

    def cuda_device(self, gpu: Any) -> str:
        """torch device name of an NVML GPU: matched by PCI address when torch tells it, else NVML index
        (equal to the CUDA ordinal under CUDA_DEVICE_ORDER=PCI_BUS_ID, which this module sets)."""
        ordinals = {} if self.recorded else cuda_ordinals()
        return f"cuda:{ordinals.get(gpu.pci or '', gpu.index)}"

    def run(self, devices: Sequence[str], n: int, dtype: str, seconds: float, seed: int,
            parallel: bool = True) -> dict[str, GemmResult | SourceError]:
        """A result (or the error) per distinct device. The devices run at the same time (one thread each, one
        stream each), so every GPU is measured under the node's full thermal and power load."""
        if self.recorded_dir is not None:
            return self._replay(devices)
        if not self.use_torch:
            raise SourceError("PyTorch disabled")
        _inputs(n, dtype, seed)  # once, before the threads: every device gets the same host tensors

        def one(device: str) -> GemmResult | SourceError:
            try:
                return run_gemm(device, n, dtype, seconds, seed)
            except SourceError as err:
                return err

        unique = list(dict.fromkeys(devices))
        try:
            if parallel and len(unique) > 1:
                # at use: concurrent.futures (and logging under it) is +10 ms (python -X importtime) to every
                # command that loads this module; only a parallel run over several GPUs needs it
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=len(unique), thread_name_prefix="gemm") as pool:
                    return dict(zip(unique, pool.map(one, unique), strict=True))
            return {d: one(d) for d in unique}
        finally:
            _inputs.cache_clear()  # 2 x n^2 host elements: not kept in a long-running agent

    def copy_bandwidth(self, src: str, dst: str, nbytes: int, seconds: float) -> float:
        if self.recorded_dir is not None:
            raise SourceError("copy bandwidth is not recorded (record nvbandwidth output instead)")
        if not self.use_torch:
            raise SourceError("PyTorch disabled")
        return copy_bandwidth(src, dst, nbytes, seconds)

    def _replay(self, devices: Sequence[str]) -> dict[str, GemmResult | SourceError]:
        assert self.recorded_dir is not None
        if (self.recorded_dir / "burnin.hang").exists():
            scope = current_scope()  # the check's: the replay stops waiting when the check is ended, as tools do
            if scope is not None:
                scope.sleep(RECORDED_HANG_S)
            else:
                threading.Event().wait(RECORDED_HANG_S)
            raise SourceError("GEMM did not return [recorded hang]")
        path = self.recorded_dir / BURNIN_FILE
        try:
            data = json.loads(confine.read_text(path, confine.scenario_prefix(self.recorded_dir.parent)))
        except FileNotFoundError:
            raise SourceError(f"{path}: no recorded burn-in") from None
        except OSError as exc:
            raise SourceError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg}") from None
        if not isinstance(data, list):
            raise SourceError(f"{path}: expected a list of per-device results")
        out: dict[str, GemmResult | SourceError] = {}
        by_device = {str(d.get("device")): d for d in data if isinstance(d, dict)}
        for device in devices:
            entry = by_device.get(device)
            if entry is None:
                out[device] = SourceError(f"{device}: no result recorded in {path}")
            elif "error" in entry:
                out[device] = SourceError(f"{device}: GEMM failed: {entry['error']}")
            else:
                try:
                    out[device] = GemmResult.from_dict(entry, str(path))
                except SourceError as err:
                    out[device] = err
        return out
