"""What every command's process stands on, with no JAX and no config: errors.py (the user-facing
errors), cli.py (how a command's `main` ends on one: a message and exit 1), paths.py (writable
folders and files checked before any work, a run dir's one-writer lock), cache.py (the project's
on-disk cache: prepared corpora, the measured matmul peak, the planner's compiles), processes.py
(a pool's worker that dies with its parent) and units.py (GiB and MiB)."""
