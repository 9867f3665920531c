"""The project's own errors. Library errors (pynvml, subprocess, OS) never leave a source raw."""
from __future__ import annotations


class GpuwardenError(Exception):
    """Base of every error the project raises on purpose."""


class SourceError(GpuwardenError):
    """A read of hardware or OS state failed; the message names what was read and where."""


class NvmlError(SourceError):
    """An NVML call failed. ``code`` is NVML's name for it (NOT_SUPPORTED, GPU_IS_LOST, ...)."""

    def __init__(self, call: str, code: str, device: int | None = None, detail: str = ""):
        self.call, self.code, self.device = call, code, device
        where = f"GPU {device}: " if device is not None else ""
        super().__init__(f"{where}{call} failed: NVML_ERROR_{code}{(' (' + detail + ')') if detail else ''}")

    @property
    def gpu_lost(self) -> bool:
        return self.code == "GPU_IS_LOST"

    @property
    def not_supported(self) -> bool:
        return self.code in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND")


class ToolError(SourceError):
    """An external tool could not be run, timed out, or failed."""


class ToolMissing(ToolError):
    """The tool is not installed on this node (a check then reports SKIPPED, not UNKNOWN)."""


class ParseError(GpuwardenError):
    """Input did not have the expected shape. Names the file and line where known."""

    def __init__(self, what: str, source: str = "", line: int | None = None):
        self.what, self.source, self.line = what, source, line
        loc = source + (f":{line}" if line is not None else "")
        super().__init__(f"{loc}: {what}" if loc else what)


class ConfigError(GpuwardenError):
    """A configuration file or flag is wrong; names the key and the file."""


class NotApplicable(GpuwardenError):
    """Raised by a check when it does not apply to this node; the runner reports SKIPPED."""
