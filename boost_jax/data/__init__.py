"""The data pipeline: corpus -> prepared dataset (tokenizer, token shards, index) -> batches.

    python -m boost_jax.data prepare SOURCE... --out DIR      # corpus.py, prepare.py, encode.py, shards.py
    data = build_data(cfg.data, vocab_size=..., seq_len=..., seed=...)   # build.py; loader.py
    batch = data.train.batch(step, batch_size)                 # {"inputs", "targets"}: int32 [B, S]

tokenizer.py trains or loads the tokenizer, chat.py renders and tokenizes a tokenizer's chat template
(as transformers' apply_chat_template), instruct.py encodes chat and prompt-completion rows with their
loss targets (data.format), packing.py packs them whole into windows and makes their batches (per-row
masks, positions, loss weights), mixture.py draws a batch's rows from several prepared datasets
(data.source=mixture), synthetic.py writes datasets directly for the loader's benchmarks, and
__main__.py is the `prepare` command. Nothing is imported here, so encode worker processes
start without JAX or Grain.
"""
