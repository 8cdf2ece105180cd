"""`python -m boost_jax.bench COMMAND ...` (__main__.py lists them): measurements, each on abstract or
real programs. One module per command: comm.py, step.py, profile.py, memory.py, kernels.py,
decode.py, quality.py, paper.py, planner.py, report.py, data.py, checkpoint.py, soak.py, startup.py,
recovery.py, serve.py (with serve_clients.py, the clients' own process, and serve_soak.py), finetune.py
(with finetune_task.py, its chat task); common.py is what they share (the config, variants, simulated devices), hf.py the Hugging Face side of `--hf`.
report.py puts the results page together from its template's text (page.py, results_page.md), its plots
(figures.py) and one module per section of the page: paper_section.py (sections 1-3: the paper, the
performance model, the planner), measured_section.py (4 and 5: steps, profiles and decoding on this
machine), study_section.py (6: a saved study, `--study-json`), quality_section.py (6 without a study,
6b, 6c), gpu_section.py (8: compiled for GPUs), latent_section.py (9: latent heads,
`--latent-decode-json`, `--latent-comm-json`, `--latent-quality-json`), absorbed_section.py (10: decoupled
RoPE) and finetune_section.py (12: `--finetune-json`; 11, `--serve-json`, is report.py's own)."""
