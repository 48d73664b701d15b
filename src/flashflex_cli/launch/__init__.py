"""Turn a plan into processes: a local torch elastic launch, torchrun command lines, SLURM scripts.

Modules: `layout` (plan nodes -> hosts), `options` (worker arguments), `preflight` (checks before
anything starts), `local` (torch elastic on this host), `torchrun` and `slurm` (rendering from the
`launchers/` templates), `failures` (which rank failed).
"""
