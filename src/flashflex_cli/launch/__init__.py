"""Turn a plan into processes: a supervised local launch, torchrun command lines, SLURM scripts.

Modules: `layout` (plan nodes -> hosts), `options` (worker arguments), `preflight` (checks before
anything starts), `local` (supervised worker processes on this host), `torchrun` and `slurm` (rendering from the
`launchers/` templates), `failures` (which rank failed).
"""
