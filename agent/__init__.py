"""gpuwarden: a node-level GPU health agent. Everything that is not a check lives in this package, in layers; each
package may import only those below it (the contracts in pyproject.toml, checked by `lint-imports`):

    cli                      the command line
    fleet | daemon           sweeps and planning | the daemon (independent of each other)
    act                      remediation, breaker, spares, recovery, scheduler adapters
    jobs                     the job-level response and `explain`
    node                     this node looked at once: runner, record, kernel-log scan, retest, topology
    gpuwarden.checks         one module per concern
    state | sources          the daemon's store | the only code that reads hardware or the OS
    core                     the result model, errors, records, config, logging

docs/architecture.md draws the packages and their imports from the code.
"""
