"""Building blocks of the decoder: the low-rank linear, RMSNorm, attention and the MLP."""
