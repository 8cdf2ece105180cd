"""Analyses of compiled programs, before anything runs: program.py builds a config's sharded loss on
abstract inputs; hlo.py audits the collectives of its compiled HLO and issued.py counts those the
jaxpr issues; comm.py sets them per decoder layer beside the scheme's analytic volume; work.py
reads its GEMMs and memory traffic; timeline.py reads a profiler trace's op times by category;
memory_model.py and perf_model.py turn them into bytes per device and seconds per step;
compiled.py compiles every program of a run for its plan's devices (GPUs too, without one) and reads
each compile's memory, collectives and library calls; microbatch_fit.py finds, by the memory model, the
micro-batches a resume on fewer devices needs."""

from boost_jax.analysis.hlo import Collective, audit, collectives, summarize

__all__ = ["Collective", "audit", "collectives", "summarize"]
