"""What the daemon keeps across restarts: the node's state machine (`transitions`: states, transitions, the policy),
the SQLite store of check results, transitions, intents and the kernel log's cursor (`store`; its reads
`store_reads`, a check's record and its parts `check_record`, its errors `store_errors`, the folder's lock
`folder_lock`, its schema `store_schema`), and the InfiniBand outage history read back from it (`outages`).

It may import the core only (it reads no hardware); everything above the sources may import it.
"""
