"""A command's start: prepare.py sets, from the config, what JAX reads when its backend starts
(simulated CPU devices, compile_cache.py's persistent compilation cache, host_memory.py's malloc
setting), the same for every command; startup.py splits the seconds to a command's first result
into import, data, restore, compile and run (`--timings`); peaks.py holds the devices' datasheet peaks
and measures the host's matmul peak and read bandwidth (MFU's denominator); gpu_target.py describes GPUs this machine
does not have as devices XLA:GPU compiles for (`python -m boost_jax.compile`)."""
