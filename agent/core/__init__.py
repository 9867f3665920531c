"""The core: what every other part speaks in. The result model (`model`: Finding, CheckResult, Report, Status,
Action), errors, records (`records`: frozen dataclasses), the config schema and loader (`config`, `sweep_policy`,
`web_config`), what a check is (`check`: CheckSpec; `passive`: PassiveSpec, KernelConsumer), the kernel log's record
(`kernel_log`), the scheduler interface (`scheduler`), a job on a node (`job`, `nccl_env`), logging, thresholds, SKUs,
the text of a report (`render`), and small shared means (`backoff`, `line_search`, `memory`, `sqlite_files`).

It imports nothing of gpuwarden's: every other package may import it.
"""
