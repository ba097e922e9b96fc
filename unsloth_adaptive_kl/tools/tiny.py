"""A tiny character-level causal LM and tokenizer built in-process (no download), shared by the tests, the demo
and the benchmarks."""

from __future__ import annotations

import string
from typing import Any, Optional

import torch

PAD, EOS = "<pad>", "<eos>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " #:.,!?+-=*/()"
# Every printable ASCII character and the newline: what chat prompts in English (and a chat template) are written in.
CHAT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
# Messages as '<role>content'; an assistant turn ends with the end-of-sequence token.
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}"
                 "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat_template: Optional[str] = None,
                    vocab_size: Optional[int] = None, pad_is_eos: bool = False) -> Any:
    """A WordLevel tokenizer with one token per character of `alphabet`, plus pad and end-of-sequence (a fast
    tokenizer, left padding). `chat_template`: a Jinja chat template (e.g. `CHAT_TEMPLATE`). `vocab_size`: pad the
    vocabulary up to this size with `<unusedN>` tokens that no text encodes to (GPU kernels like a multiple of 64).
    `pad_is_eos`: no pad token of its own, EOS pads (id 0), so the vocabulary is EOS and the alphabet alone.
    A character outside `alphabet` encodes to the pad id (the unknown token): give prompts and rewards' texts from
    the alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = [EOS] if pad_is_eos else [PAD, EOS]
    vocab = {token: index for index, token in enumerate([*special, *dict.fromkeys(alphabet)])}
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size={vocab_size} is invalid: the alphabet needs {len(vocab)} tokens")
        vocab.update({f"<unused{index}>": index for index in range(len(vocab), vocab_size)})
    pad = EOS if pad_is_eos else PAD
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, newlines too
    backend.decoder = decoders.Fuse()
    # A causal LM's inputs, as Llama's and Qwen's tokenizers name them: transformers 4.x's fast tokenizer adds
    # token_type_ids by default, which its generate() refuses for Llama (the demo's --model path with trl 1.9.1).
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token=EOS, padding_side="left",
                                        model_input_names=["input_ids", "attention_mask"])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(tokenizer: Any, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                     num_heads: int = 4, max_position_embeddings: int = 256) -> Any:
    """A randomly initialised Llama with `num_layers` layers of width `hidden_size` (`num_heads` heads of
    hidden_size / num_heads) over the tokenizer's vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
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


def as_unsloth_model(model: Any) -> Any:
    """A transformers `model` made acceptable to Unsloth's generated trainer without `FastLanguageModel` (which loads
    on CUDA only): the two methods its models have, and float32 kept where the device has no bf16 (Unsloth would
    switch such a model to fp16; where it has bf16, Unsloth autocasts bf16 unless the model is marked
    `_unsloth_forced_float32`, as the trainer lab marks it)."""
    for name in ("for_training", "for_inference"):
        setattr(model, name, lambda *a, **k: None)
    model._unsloth_user_float32 = True
    return model


def verl_micro_batch(responses: int = 4, response_length: int = 8, prompt_length: int = 4,
                     seed: int = 0) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One micro-batch as verl's actor update sees it (needs verl): (TensorDict of nested prompts, responses, mask,
    old / reference log-probs and advantages, with verl's global batch info; the flat policy log-probs of every
    prompt + response token, as the model outputs them; their jagged offsets). Response lengths run from half to all
    of `response_length`, so that the reductions see unequal completions."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(max(response_length // 2, 1), response_length, responses).long().tolist()

    def jagged(make: Any, sizes: list[int]) -> torch.Tensor:
        return torch.nested.as_nested_tensor([make(size) for size in sizes], layout=torch.jagged)

    data = TensorDict({
        "prompts": jagged(lambda k: torch.randint(0, 1000, (k,), generator=g), [prompt_length] * responses),
        "responses": jagged(lambda k: torch.randint(0, 1000, (k,), generator=g), lengths),
        "response_mask": jagged(lambda k: torch.ones(k, dtype=torch.int64), lengths),
        "old_log_probs": jagged(lambda k: -torch.rand(k, generator=g) * 2, lengths),
        "ref_log_prob": jagged(lambda k: -torch.rand(k, generator=g) * 2, lengths),
        "advantages": jagged(lambda k: torch.randn(1, generator=g).expand(k).clone(), lengths),
    }, batch_size=[responses])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(lengths), global_batch_size=responses)
    totals = [prompt_length + length for length in lengths]
    offsets = torch.tensor([0, *torch.tensor(totals).cumsum(0).tolist()])
    return data, -torch.rand(sum(totals), generator=g) * 2, offsets


def verl_loss_and_grad(loss_fn: Any, data: Any, values: torch.Tensor,
                       offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """verl's loss call on a micro-batch from `verl_micro_batch`, forward and backward: (loss, the gradient of the
    flat log-probs, the loss's metrics)."""
    leaf = values.detach().requires_grad_(True)
    loss, metrics = loss_fn(model_output={"log_probs": torch.nested.nested_tensor_from_jagged(leaf, offsets)},
                            data=data)
    loss.backward()
    return loss.detach(), leaf.grad, metrics
