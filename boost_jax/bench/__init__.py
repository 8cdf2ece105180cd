"""`python -m boost_jax.bench {comm,step} ...`: measurements, each on abstract or real programs."""
