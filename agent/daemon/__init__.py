"""`gpuwarden run`: the daemon. Its loops (`loop`: the state machine's turns and the action worker; `polls`: the
passive checks on their intervals; `events`: the kernel log and NVML's XID events; `devices`: udev), its status
socket (`status_socket`), its HTTP endpoint (`http_endpoint`, with `http_guard` deciding which connections it keeps)
and the metrics it serves (`metrics`).

It may import the core, the sources, the state, the checks, the node, the jobs and the remediation (`act`); it never
imports the fleet tools (sweeps, planning), and only the command line imports it.
"""
