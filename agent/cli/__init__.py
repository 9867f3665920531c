"""The command line: the only code that parses argv. `command` is the console entry (`gpuwarden`, with the
fast paths that load nothing they do not need; `analyze_ahead` starts a large kernel log's readers before the CLI
loads), `main` the parser and its table of commands, and one module per command (`preflight`, `analyze`, `record`,
`run`, `status`, `breaker`, `topology`, `checks`, `explain`, `jobs`, `slurm`, `sweep`, `plan`), each with its
options (`add_arguments`) and `run(args)`. What several share: `flags` (log flags, exit codes, `options()`, which
hands parsed flags below the CLI as that code's own record), `interrupt` (tools ended on SIGINT/SIGTERM), `node`,
`verdict`. `manpage` and `sample_config` write the manual and the packaged config from the parser and the code's
defaults.

It may import every other package; nothing imports it.
"""
