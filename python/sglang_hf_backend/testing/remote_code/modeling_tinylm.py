"""TinyLM: a small Llama-like model written the way the HF docs ask remote code to be.

Attention goes through ``ALL_ATTENTION_FUNCTIONS.get_interface``; the model has no
tensor-parallel plan, so serving it with TP exercises plan inference. RoPE frequencies
are computed in forward (a non-persistent buffer would be left uninitialised by
transformers 5.x ``from_pretrained``). With ``use_attention_interface=False`` in the
config, a subclass with plain eager attention stands in for incompatible remote code.
With ``num_experts > 0`` the MLPs are sparse MoE blocks in transformers 5's layout whose
router squares its top-k probabilities: routing SGLang's TopK cannot reproduce.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_tinylm import TinyLMConfig


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, positions, theta):
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float) / dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def eager_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    q_len, k_len = scores.shape[-2:]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class TinyLMRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class TinyLMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.wq = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_ids, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.wq(hidden_states).view(shape).transpose(1, 2)
        k = self.wk(hidden_states).view(shape).transpose(1, 2)
        v = self.wv(hidden_states).view(shape).transpose(1, 2)
        q = rope(q, position_ids, self.config.rope_theta)
        k = rope(k, position_ids, self.config.rope_theta)
        attention = eager_attention
        if self.config.use_attention_interface:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention
            )
        # Unpadded, causal batches only: no mask is built (sdpa and ours mask causally).
        out, _ = attention(self, q, k, v, None, scaling=self.scaling, **kwargs)
        return self.wo(out.reshape(*hidden_states.shape[:-1], -1))


class TinyLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TinyLMSquaredRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states, self.weight)
        probs, indices = torch.topk(logits.softmax(dim=-1, dtype=torch.float), self.top_k, dim=-1)
        return logits, (probs * probs).to(logits.dtype), indices


class TinyLMExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        size = (config.num_experts, 2 * config.intermediate_size, config.hidden_size)
        self.gate_up_proj = nn.Parameter(torch.empty(size))
        self.down_proj = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, config.intermediate_size)
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[-1]):
            for expert in range(self.num_experts):
                rows = (top_k_index[:, slot] == expert).nonzero().squeeze(-1)
                gate, up = nn.functional.linear(hidden_states[rows], self.gate_up_proj[expert]).chunk(
                    2, dim=-1
                )
                y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[expert])
                out.index_add_(0, rows, y * top_k_weights[rows, slot, None])
        return out


class TinyLMSparseBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = TinyLMSquaredRouter(config)
        self.experts = TinyLMExperts(config)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, indices = self.gate(flat)
        return self.experts(flat, indices, weights).reshape(shape)


class TinyLMBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn_norm = TinyLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = TinyLMAttention(config, layer_idx)
        self.mlp_norm = TinyLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TinyLMSparseBlock(config) if config.num_experts else TinyLMMLP(config)

    def forward(self, hidden_states, position_ids, **kwargs):
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), position_ids, **kwargs)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class TinyLMPreTrainedModel(PreTrainedModel):
    config_class = TinyLMConfig
    base_model_prefix = "model"
    _supports_attention_backend = True
    _supports_sdpa = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding, TinyLMSquaredRouter)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, TinyLMExperts):
            nn.init.normal_(module.gate_up_proj, std=0.02)
            nn.init.normal_(module.down_proj, std=0.02)
        elif isinstance(module, TinyLMRMSNorm):
            nn.init.ones_(module.weight)


class TinyLMModel(TinyLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(TinyLMBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = TinyLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, attention_mask=None, **kwargs):
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        for unused in ("use_cache", "return_dict", "past_key_values", "cache_position"):
            kwargs.pop(unused, None)
        layer_outputs = []
        for block in self.blocks:
            hidden_states = block(hidden_states, position_ids, **kwargs)
            layer_outputs.append(hidden_states)
        if self.config.mix_layer_outputs:
            hidden_states = torch.stack(layer_outputs).mean(0)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))


class TinyLMForCausalLM(TinyLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        outputs = self.model(
            input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, **kwargs
        )
        return CausalLMOutputWithPast(logits=self.lm_head(outputs.last_hidden_state))


class TinyLMEagerForCausalLM(TinyLMForCausalLM):
    """The same model with plain eager attention: what incompatible remote code looks like."""

    _supports_attention_backend = False
