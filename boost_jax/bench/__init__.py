"""`python -m boost_jax.bench {comm,step,memory,kernels,paper,report} ...`: measurements, each on abstract or real programs."""
