"""The fair comparison behind `python -m boost_jax.study` (the `study` config section), one file per job:
`spec.py` (the study's config, its cells and each run's config, the record that keeps a study dir to
one spec), `grid.py` (the learning-rate search), `runs.py` (one run dir: train, evaluate, record),
`fit.py` (loss against compute, bootstrap intervals, compute multipliers, the early cells),
`tasks.py` (the downstream lm-eval tasks of study.tasks) and `report.py` (the one JSON object and
the tables).
"""
