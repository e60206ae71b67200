"""Weights in: Hugging Face checkpoints, GGUF files in their own block formats (dense, Qwen MoE
and hybrid, Gemma 4, mmproj towers, on the GPU) and the packed copy later starts read."""
