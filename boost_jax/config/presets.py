"""Model sizes: the LLaMA family of docs/design.md section 1, plus small presets for tests and the quickstart.

Each preset gives sizes (and the open models' family switches: tied embeddings, RoPE's theta and
scaling, q/k/v bias, the norm's epsilon); the arch (dense/svd/cola/lax) is chosen separately, and
ranks default to d_model/4. Any field can be overridden (`model.d_model=...`).
"""

_LLAMA = dict(vocab_size=32000)
# The open models people fine-tune, as their Hugging Face config.json gives them (`convert import`
# reads the checkpoints themselves; docs/design/hf-models.md).
_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0, norm_eps=1e-5, mlp_gate_silu=True)
_LLAMA3_ROPE = dict(type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_QWEN25 = dict(rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, mlp_gate_silu=True)

PRESETS: dict[str, dict] = {
    # Tests: tiny, with GQA (8 heads, 2 kv heads: tp=8 replicates kv heads) so every path runs in seconds.
    "llama-tiny": dict(d_model=64, d_ff=160, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=512),
    # Quickstart: trains on 2 CPU cores in about three minutes.
    "llama-mini": dict(d_model=256, d_ff=688, n_layers=4, n_heads=4, vocab_size=4096),
    # The CPU study (configs/study-cpu.yaml): three sizes small enough to train past 10 tokens per
    # non-embedding parameter on 2 cores (vocab 512: embedding and head are about half the parameters).
    "llama-micro-s": dict(d_model=32, d_ff=88, n_layers=2, n_heads=4, vocab_size=512),
    "llama-micro-m": dict(d_model=48, d_ff=128, n_layers=3, n_heads=4, vocab_size=512),
    "llama-micro-l": dict(d_model=64, d_ff=176, n_layers=4, n_heads=4, vocab_size=512),
    # CoLA's 60M/130M configs keep the SwiGLU gate SiLU (docs/design.md section 1).
    "llama-60m": dict(d_model=512, d_ff=1376, n_layers=8, n_heads=8, mlp_gate_silu=True, **_LLAMA),
    "llama-130m": dict(d_model=768, d_ff=2048, n_layers=12, n_heads=12, mlp_gate_silu=True, **_LLAMA),
    "llama-350m": dict(d_model=1024, d_ff=2736, n_layers=24, n_heads=16, **_LLAMA),
    "llama-1b": dict(d_model=2048, d_ff=5472, n_layers=24, n_heads=32, **_LLAMA),
    "llama-3b": dict(d_model=3072, d_ff=8192, n_layers=28, n_heads=24, **_LLAMA),
    "llama-7b": dict(d_model=4096, d_ff=11008, n_layers=32, n_heads=32, **_LLAMA),
    "llama-13b": dict(d_model=5120, d_ff=13824, n_layers=40, n_heads=40, **_LLAMA),
    "llama-30b": dict(d_model=8192, d_ff=22016, n_layers=36, n_heads=64, **_LLAMA),
    "llama3.2-1b": dict(d_model=2048, d_ff=8192, n_layers=16, n_heads=32, tie_embeddings=True,
                        rope_scaling=dict(factor=32.0, **_LLAMA3_ROPE), **_LLAMA3),
    "llama3.2-3b": dict(d_model=3072, d_ff=8192, n_layers=28, n_heads=24, tie_embeddings=True,
                        rope_scaling=dict(factor=32.0, **_LLAMA3_ROPE), **_LLAMA3),
    "llama3.1-8b": dict(d_model=4096, d_ff=14336, n_layers=32, n_heads=32, tie_embeddings=False,
                        rope_scaling=dict(factor=8.0, **_LLAMA3_ROPE), **_LLAMA3),
    "qwen2.5-0.5b": dict(d_model=896, d_ff=4864, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936,
                         tie_embeddings=True, **_QWEN25),
    "qwen2.5-1.5b": dict(d_model=1536, d_ff=8960, n_layers=28, n_heads=12, n_kv_heads=2, vocab_size=151936,
                         tie_embeddings=True, **_QWEN25),
    "qwen2.5-7b": dict(d_model=3584, d_ff=18944, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
                       tie_embeddings=False, **_QWEN25),
    "smollm2-135m": dict(d_model=576, d_ff=1536, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                         tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5, mlp_gate_silu=True),
    "smollm2-360m": dict(d_model=960, d_ff=2560, n_layers=32, n_heads=15, n_kv_heads=5, vocab_size=49152,
                         tie_embeddings=True, rope_theta=100000.0, norm_eps=1e-5, mlp_gate_silu=True),
}

# The keys that make a model a preset's shape (the rest are switches a run may set over any shape).
SHAPE_KEYS = ("d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "vocab_size")


def shape_name(model) -> str:
    """What a log line calls a resolved model: its preset where it has the preset's shape, else
    "custom" (e.g. a model imported from a folder, whose keys all come from the folder)."""
    preset = PRESETS[model.preset]
    return model.preset if all(getattr(model, k) == preset[k] for k in SHAPE_KEYS if k in preset) else "custom"
