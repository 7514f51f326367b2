"""DeepSeek-V4 layers: attention (window + compressed branches), compressor, indexer, MoE."""
