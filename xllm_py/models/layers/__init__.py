"""Building blocks of the DeepSeek-V3 model: norm, rope, linear, mlp, moe, mla."""
