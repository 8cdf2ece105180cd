"""`python -m boost_jax.bench COMMAND ...` (__main__.py lists them): measurements, each on abstract or
real programs. One module per command: comm.py, step.py, profile.py, memory.py, kernels.py,
decode.py, quality.py, paper.py, planner.py, report.py, data.py, checkpoint.py, soak.py, startup.py,
recovery.py; common.py is what they share (the config, variants, simulated devices), hf.py the Hugging Face side of `--hf`,
study_section.py report.py's section of a saved study (`--study-json`), and latent_section.py its
section 9, latent heads (`--latent-decode-json`, `--latent-comm-json`, `--latent-quality-json`)."""
