"""`model.attention` resolved by parallel/attention_choice.py's one table: auto takes cuDNN's fused
attention only where cuDNN takes the dtype, head dim and layout (else XLA's, and says why), an
explicit cudnn where it cannot run is refused by name. The compiles that show each choice holds on
XLA:GPU are tests/test_gpu_defaults.py's."""

from types import SimpleNamespace

import jax
import pytest

from boost_jax.parallel import attention_choice
from boost_jax.parallel.attention_choice import AttentionSite, checked_capability, resolve_attention
from boost_jax.runtime.errors import ConfigError

GPU = dict(platform="gpu", capability=None, dtype="bfloat16", head_dim=64, n_kv_heads=2, tp=1, kv_split_alike=True)
HOPPER, AMPERE = (9, 0), (8, 0)

# (the site's fields beside GPU's, what auto takes, a fragment of why auto took XLA's, a fragment of the
# refusal of an explicit cudnn; None: cudnn runs there)
CASES = [
    ({}, "cudnn", "", None),
    ({"dtype": "float32"}, "xla", "takes float16 or bfloat16 only, not model.dtype=float32", "model.dtype=float32"),
    ({"head_dim": 12}, "xla", "a multiple of 8 and at most 128 here", "not model.head_dim=12"),
    ({"head_dim": 192, "capability": HOPPER}, "cudnn", "", None),
    ({"head_dim": 256, "capability": HOPPER}, "cudnn", "", None),
    ({"head_dim": 264, "capability": HOPPER}, "xla", "at most 256 on this GPU", "not model.head_dim=264"),
    ({"head_dim": 192, "capability": AMPERE}, "xla", "at most 128 on this GPU (compute capability 8.0",
     "not model.head_dim=192"),
    ({"head_dim": 192}, "xla", "at most 128 here (JAX checks a deviceless compile", "not model.head_dim=192"),
    ({"kv_split_alike": False, "tp": 4}, "xla", "parallel.tp=4 does not divide model.n_kv_heads=2",
     "parallel.tp=4 does not divide model.n_kv_heads=2"),
    ({"platform": "cpu"}, "xla", "", "model.attention=cudnn needs GPU devices, this mesh has cpu"),
    ({"platform": None}, "xla", "", None),  # an abstract mesh: auto prices the CPU's attention
    ({"platform": None, "dtype": "float32"}, "xla", "", "model.dtype=float32"),
]


def test_each_site_resolves_by_the_one_table():
    for change, auto, why, refused in CASES:
        site = AttentionSite(**{**GPU, **change})
        impl, said = resolve_attention("auto", site)
        assert impl == auto and (said.startswith("auto: ") and why in said if why else said == ""), (change, said)
        assert resolve_attention("xla", site) == ("xla", ""), change
        if refused is None:
            assert resolve_attention("cudnn", site) == ("cudnn", ""), change
            continue
        with pytest.raises(ConfigError, match="model.attention") as e:
            resolve_attention("cudnn", site)
        assert refused in str(e.value), (change, str(e.value))


def test_the_capability_is_the_one_jax_checks(monkeypatch):
    """JAX checks cuDNN's head-dim limit against its own GPU backend: a GPU device's capability
    counts only where JAX runs on GPUs (not in a deviceless compile, nor on the CPU)."""
    h100 = SimpleNamespace(platform="gpu", compute_capability="9.0")
    assert checked_capability(jax.devices()[0]) is None and checked_capability(h100) is None  # JAX on the CPU
    monkeypatch.setattr(attention_choice.jax, "default_backend", lambda: "gpu")
    assert checked_capability(h100) == HOPPER

