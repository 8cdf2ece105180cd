"""The model: transformer.py (the LLaMA decoder for every arch: embedding -> scanned stack of blocks
-> RMSNorm -> LM head, and the loss), re-exported here.

Beside the decoder: counts.py (a model's parameter counts and FLOPs per token), train_state.py (the
typed train state and its checkpoint layout), checkpoint.py (the Orbax store of a run's checkpoints
and each checkpoint's identity), weights.py (a model's parameters:
init, placement on a plan, restore of a checkpoint's parameters only), decode.py (generation against
the caches), cache_choice.py (`--cache auto`'s roofline of a decode step per cache kind), compress.py (a dense model's weights factored by SVD), latent_heads.py (k/v's
block-diagonal B written dense, and a low-rank model refactored into latent heads), hf.py (the
safetensors format and the Hugging Face names), hf_remote/ (the transformers configuration and
modeling files `export --format hf` copies beside a low-rank model's weights: package data, not
imported by boost_jax), run_dir.py (a run dir opened for inference:
`open_run`) and harness.py (a run dir as an lm-evaluation-harness model: `BoostLM`). Nothing here imports training/ or analysis/, so a change there cannot break generate,
lm_eval or export (tests/test_layout_of_the_code.py).
"""

from boost_jax.model.transformer import (
    PROJECTIONS,
    RESIDUAL_AXES,
    Block,
    Model,
    decoder_layer,
    loss_fn,
    residual,
    unstack_layers,
)

__all__ = ["PROJECTIONS", "RESIDUAL_AXES", "Block", "Model", "decoder_layer", "loss_fn", "residual", "unstack_layers"]
