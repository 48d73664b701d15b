"""Model descriptions: Llama-family ModelSpec, presets, Hugging Face configs."""
