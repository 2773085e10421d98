"""Config of TinyLM, a hand-written remote-code causal LM used to test trust_remote_code."""

from transformers import PretrainedConfig


class TinyLMConfig(PretrainedConfig):
    model_type = "tinylm"

    def __init__(
        self,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        use_attention_interface=True,
        num_experts=0,
        num_experts_per_tok=2,
        mix_layer_outputs=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.use_attention_interface = use_attention_interface
        self.num_experts = num_experts  # > 0: sparse MoE blocks instead of the MLP
        self.num_experts_per_tok = num_experts_per_tok if num_experts else None  # SGLang reads it as "MoE"
        self.mix_layer_outputs = (
            mix_layer_outputs  # the output averages every layer's: reaches across the stack
        )
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
