"""Hugging Face safetensors folders (dense and MoE families)."""
