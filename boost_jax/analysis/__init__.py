"""Static analyses of compiled programs: the collectives of the HLO (hlo.py), its GEMMs and memory traffic (work.py)."""

from boost_jax.analysis.hlo import Collective, audit, collectives, summarize

__all__ = ["Collective", "audit", "collectives", "summarize"]
