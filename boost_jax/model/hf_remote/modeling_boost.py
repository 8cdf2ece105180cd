"""transformers model of a boost_jax low-rank model (svd, cola, lax), written beside its weights by
`python -m boost_jax.export RUN_DIR OUT --format hf`; imports only torch and transformers.

Written to transformers' attention-interface contract (ALL_ATTENTION_FUNCTIONS picked by
`attn_implementation`, a standard DynamicCache of full keys and values, q/k/v/o modules), which is
what vLLM's Transformers backend serves. Each projection is `b(act(a(x)))`: svd act = identity,
cola act = SiLU, lax act = SiLU plus the previous layer's latent of the same projection (zero in
layer 0), a per-token quantity, so the K/V cache alone carries a sequence's state.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_boost import BoostConfig

ACTIVATIONS = {"svd": None, "cola": nn.functional.silu, "lax": nn.functional.silu}


class GroupedUp(nn.Module):
    """A block-diagonal B of `groups` blocks (latent heads): weight [g, out / g, r / g], block j maps
    latent columns j r/g .. (j+1) r/g to outputs j out/g .. (j+1) out/g."""

    def __init__(self, rank, out, groups, bias):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups, out // groups, rank // groups))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None

    def forward(self, h):
        z = h.reshape(*h.shape[:-1], self.groups, -1)
        y = torch.einsum("...gk,gnk->...gn", z, self.weight).reshape(*h.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class LowRank(nn.Module):
    """x -> b(act(a x) [+ the previous layer's latent]); `latents` (lax) receives this layer's."""

    def __init__(self, config, name, d_in, d_out, rank, groups=1, bias=False):
        super().__init__()
        self.name, self.act, self.carries = name, ACTIVATIONS[config.arch], config.arch == "lax"
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = GroupedUp(rank, d_out, groups, bias) if groups > 1 else nn.Linear(rank, d_out, bias=bias)

    def forward(self, x, latents):
        h = self.a(x)
        h = h if self.act is None else self.act(h)
        if self.carries:
            prev = latents.get(self.name)
            latents[self.name] = h
            h = h if prev is None else h + prev
        return self.b(h)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def inv_frequencies(dim, rope):
    """RoPE's frequencies [dim / 2], llama3-scaled as transformers' `_compute_llama3_parameters`."""
    freq = 1.0 / rope["theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope["type"] != "llama3":
        return freq.float()
    f, low, high, old = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings"))
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old / low, freq / f, freq)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled).float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Grouped-query softmax attention, the fallback of ALL_ATTENTION_FUNCTIONS (LLaMA's)."""
    n_rep = module.num_key_value_groups
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class BoostAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        d, dh, h, kv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_key_value_groups, self.scaling = dh, h // kv, dh**-0.5
        r, g, bias = config.attn_rank, config.attn_latent_heads, config.qkv_bias
        self.q_proj = LowRank(config, "q", d, h * dh, r, bias=bias)
        self.k_proj = LowRank(config, "k", d, kv * dh, r, groups=g, bias=bias)
        self.v_proj = LowRank(config, "v", d, kv * dh, r, groups=g, bias=bias)
        self.o_proj = LowRank(config, "o", h * dh, d, r)

    def forward(self, hidden_states, position_embeddings, attention_mask, latents, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states, latents).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states, latents).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states, latents).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous(), latents), weights


class BoostMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f, r = config.hidden_size, config.intermediate_size, config.mlp_rank
        self.gate_silu = config.mlp_gate_silu
        self.gate_proj, self.up_proj = LowRank(config, "gate", d, f, r), LowRank(config, "up", d, f, r)
        self.down_proj = LowRank(config, "down", f, d, r)

    def forward(self, x, latents):
        gate = self.gate_proj(x, latents)
        gate = nn.functional.silu(gate) if self.gate_silu else gate
        return self.down_proj(gate * self.up_proj(x, latents), latents)


class BoostDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn, self.mlp = BoostAttention(config, layer_idx), BoostMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, position_embeddings, attention_mask, latents, cache=None, **kwargs):
        """`latents`: the previous layer's (lax), replaced by this layer's as the projections run."""
        attn, _ = self.self_attn(self.input_layernorm(x), position_embeddings, attention_mask, latents, cache, **kwargs)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), latents)


class BoostPreTrainedModel(PreTrainedModel):
    config_class = BoostConfig
    base_model_prefix = "model"
    _no_split_modules = ["BoostDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class BoostModel(BoostPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BoostDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)
        mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids=position_ids)
        # RoPE's frequencies computed here, not held in a buffer: from_pretrained builds the model on the
        # meta device and leaves a non-persistent buffer uninitialised
        freq = inv_frequencies(self.config.head_dim, self.config.boost_rope).to(inputs_embeds.device)
        angles = position_ids[..., None].float() * freq  # [B, S, Dh / 2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # rotate-half, broadcast over heads
        rope = (angles.cos().to(inputs_embeds.dtype), angles.sin().to(inputs_embeds.dtype))
        x, latents = inputs_embeds, {}
        for layer in self.layers:
            x = layer(x, rope, mask, latents, cache, position_ids=position_ids, **kwargs)
        return BaseModelOutputWithPast(**{"last_hidden_state": self.norm(x), _cache_field(BaseModelOutputWithPast): cache})


class BoostForCausalLM(BoostPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = BoostModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep])
        field = _cache_field(CausalLMOutputWithPast)
        return CausalLMOutputWithPast(**{"logits": logits, field: getattr(out, field)})


def _cache_field(output_class):
    """The cache's field of a model output: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"
