"""This node, looked at once: the node and its sources (`host`: live or a recorded folder), the runner that runs
checks under their timeouts and a budget (`runner`), recording a node (`record`, `record_tools`), the kernel-log scan
of saved files (`kernel_scan`, with `kernel_scan_lines`, the search, and `kernel_scan_readers`, the reader processes
of a large file), the retest of a quarantined node (`retest`) and this node's NVLink domain as the scheduler should
know it (`topology`; the fleet's as Slurm's block topology, `topology_slurm`; `gpuwarden topology`'s work,
`topology_command`).

It may import the core, the sources, the state and the checks; the jobs, the remediation, the daemon, the fleet
tools and the command line import it.
"""
