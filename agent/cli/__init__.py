"""The command line: the only code that parses argv. `command` is the console entry (`gpuwarden`, with the
fast paths that load nothing they do not need), `main` the parser and its command table, and one module per command
whose work is more than a call (`analyze`, `explain`, `jobs`, `run`, `slurm_healthcheck`); `manpage` and
`sample_config` write the manual and the packaged config from the parser and the code's defaults.

It may import every other package; nothing imports it.
"""
