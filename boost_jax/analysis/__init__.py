"""Static analyses of compiled programs (communication audit of the HLO)."""

from boost_jax.analysis.hlo import Collective, audit, collectives, summarize

__all__ = ["Collective", "audit", "collectives", "summarize"]
