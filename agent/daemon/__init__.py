"""`gpuwarden run`: the daemon. Its loops (`loop`: the daemon, its options and lifecycle; `turn`: the state machine's
turns; `writer`: memory to the store; `actions`: the action worker; `polls`: the passive checks on their intervals;
`events`: the kernel log and NVML's XID events; `devices`: udev), its status socket (`status_socket`), its HTTP
endpoint (`http_endpoint`, the server: its connections `http_conn`, HTTP/1.1 `http_protocol`, its worker pool
`http_workers`, `http_guard` deciding which connections it keeps, `http_routes` what each path serves) and the
metrics it serves (`metrics`; `exposition`: prometheus-client's text and negotiation, mirrored).

It may import the core, the sources, the state, the checks, the node, the jobs and the remediation (`act`); it never
imports the fleet tools (sweeps, planning), and only the command line imports it.
"""
