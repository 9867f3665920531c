"""The compiled parts: agent/core/_line_scan.c, the kernel and job logs' line search in one pass of C, and
agent/core/_log_rows.c, a dense kernel log's found lines made rows and the runs of their texts. Each is
optional: where no C compiler or Python headers are found the build goes on without it and
agent/core/line_search.py's own search runs, with the same answers (slower on logs dense in the lines it finds).
Everything else of the build is pyproject.toml's."""
from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(ext_modules=[
    Extension("gpuwarden.agent.core._line_scan", ["agent/core/_line_scan.c"],
              depends=["agent/core/_multi_find.h", "agent/core/_repeats.h"], optional=True, extra_compile_args=_FLAGS),
    Extension("gpuwarden.agent.core._log_rows", ["agent/core/_log_rows.c"], optional=True, extra_compile_args=_FLAGS),
])
