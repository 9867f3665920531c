"""DCGM through `dcgmi` (JSON output). The diag parser proper arrives with the bootstrap suite."""
from __future__ import annotations

import json
from typing import Any

from gpuwarden.agent.core.errors import ParseError, ToolError
from gpuwarden.agent.sources.tools import ToolRunner


class Dcgm:
    def __init__(self, tools: ToolRunner):
        self.tools = tools

    def diag(self, level: int, timeout_s: float) -> dict[str, Any]:
        """`dcgmi diag -r LEVEL -j` as a dict; ToolMissing when dcgmi is absent, ParseError on bad JSON."""
        name = f"dcgmi-diag-r{level}"
        out = self.tools.run(name, ["dcgmi", "diag", "-r", str(level), "-j"], timeout_s)
        try:
            data = json.loads(out.output)
        except json.JSONDecodeError as exc:
            if out.returncode != 0:
                raise ToolError(f"dcgmi diag -r {level} exited {out.returncode}: {out.output.strip()[:200]}") from None
            raise ParseError(f"malformed JSON from dcgmi: {exc.msg}", name, exc.lineno) from None
        if not isinstance(data, dict):
            raise ParseError("dcgmi JSON is not an object", name)
        return data
