"""The version of gpuwarden, kept equal to pyproject's [project] version (a test holds them together): reading it
here costs nothing, where importlib.metadata costs every command tens of milliseconds."""

VERSION = "0.1.0"
