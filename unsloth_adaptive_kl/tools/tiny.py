"""A tiny character-level causal LM and tokenizer built in-process (no download), shared by the tests, the demo
and the benchmarks."""

from __future__ import annotations

import string
from typing import Any

import torch

PAD, EOS = "<pad>", "<eos>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " #:.,!?+-=*/()"


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """A WordLevel tokenizer with one token per character of `alphabet`, plus pad and end-of-sequence."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{char: index + 2 for index, char in enumerate(dict.fromkeys(alphabet))}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS)
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(tokenizer: Any, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Any:
    """A randomly initialised Llama with `num_layers` layers of width `hidden_size` over the tokenizer's vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def lora_config(rank: int = 8) -> Any:
    """LoRA adapters of rank `rank` on the attention and MLP projections."""
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)


def add_lora(model: Any, rank: int = 8, seed: int = 0) -> Any:
    """Wrap the model with the LoRA adapters of `lora_config`."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, lora_config(rank))
