"""The native engine: the Llama-family model (`llama`), its paged KV cache (`cache`), rotary
embeddings, the one-call decode step plans (`stack`), GGUF and safetensors reading, tokenizers,
and the transformers adapter (`hf_adapter`) that puts any causal LM behind the same protocol."""
