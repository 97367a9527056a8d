"""The Llama-family decoder (Llama, Qwen2, Mistral) and its loaders."""
