"""What the frontend needs of a checkpoint without its weights (vLLM's
transformers_utils): the HF config, the tokenizer, and the lean GGUF reader they are
read from. Nothing here imports model code (lane.model_executor), so the API server
and the bench client use it without loading the engine's stack."""
