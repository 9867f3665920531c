"""`gpuwarden plan`: fleet planning from numbers. `capacity` (usable nodes per slice size), `risk` (MTBI and the
chance a job meets a failure), `simulate` over `sim_fleet` (a fleet through simulated days, with the real state
machine and remediation engine), `defrag` (the preemptible jobs to move so one rack has a free slice); `command`
wires them under one command."""
