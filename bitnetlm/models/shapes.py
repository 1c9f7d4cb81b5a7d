"""Real models' shapes, for random-weight benchmarks and tuning when the checkpoints are not at hand."""

SHAPES = {
    "2b4t": dict(arch="bitnet"),  # ModelConfig defaults are BitNet b1.58 2B4T
    "large": dict(  # 1bitLLM/bitnet_b1_58-large (0.7B)
        arch="1bitllm",
        vocab_size=32002,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
