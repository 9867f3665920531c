"""`gpuwarden sweep`: multi-node NCCL collectives over idle nodes (`sweep`), judged by regime (`criteria`, with the
learned baselines of `history`), the culprit of a failing group found by group testing (`localise`), launched by srun
or mpirun (`launch`), with a verdict per node for its daemon (`model`); `command` is the command's body."""
