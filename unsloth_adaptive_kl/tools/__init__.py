"""What ships beside the library: the demo, the self-check (`python -m unsloth_adaptive_kl`) and the tiny in-process
model and tokenizer the tests, demo and docs train (no download)."""
