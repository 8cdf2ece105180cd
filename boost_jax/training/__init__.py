"""Training, below the `train` command: optimizers.py (AdamW, Muon, Spectron and the factor-aware
updates, with their schedules), health.py (the factors' spectra and the products' stable rank),
step.py (the train state and the jitted train and eval steps), muon_layout.py (where each split
matrix is orthogonalised, priced three ways), checkpoint.py (Orbax saves and
restores, each checkpoint's identity), local_tier.py (the frequent checkpoint tier on each host's own
disk), recovery.py (what a restart cost, in the metrics), microbatch_fit.py (the micro-batches a resume on
fewer devices needs), log.py (progress, metrics.jsonl, TensorBoard, W&B) and
parts.py (the named parts of a run that `train.train` loops over). Nothing is imported here: its
modules sit on different floors (docs/design.md)."""
