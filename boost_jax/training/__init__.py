"""Training, below the `train` command: optimizers.py (AdamW, Muon, Spectron and the factor-aware
updates, with their schedules), health.py (the factors' spectra and the products' stable rank),
step.py (the train state made and the jitted train and eval steps), muon_layout.py (where each split
matrix is orthogonalised, priced three ways), local_tier.py (the frequent checkpoint tier on each host's own
disk), recovery.py (what a restart cost, in the metrics), log.py (progress, metrics.jsonl, TensorBoard,
W&B), metrics.py (the steps' metrics, fetched from the device when the loop syncs), loss.py (the
loss and the eval step, without an optimizer), the loop's parts: run_dir.py (the run dir checked,
held and claimed), checkpointing.py (when to save, and the resume), preemption.py (a signal: save and
stop), meeting.py (the decisions every process takes together, at one collective per step),
meter.py (throughput and MFU), guard.py (a non-finite loss stops the run), profiler.py (a trace),
run.py (`train()`: the loop over them), evaluate.py (the eval, and a checkpoint's eval figures, by
the eval step) and importer.py (a run dir started from a model made elsewhere: its checkpoint 0). The
checkpoint store is model/checkpoint.py, below, so inference never imports training/. Nothing is
imported here: its modules sit on different floors (docs/design.md)."""
