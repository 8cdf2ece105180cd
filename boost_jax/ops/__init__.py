"""The ops: math on plain arrays that the layers and the plan's strategies both call, below both
(no mesh, scheme or parameter). attention.py: causal, blocked, cached and latent-value attention,
RoPE, where the tokens sit and a layer's `AttentionOp`; ring.py: ring attention's online softmax
round a named axis and its backward."""
