"""A tiny Qwen3.6-family model made here: random weights, a locally trained tokenizer, no hub.

    python tiny_model.py OUT_DIR

Run with the served image's own Python (``/opt/venv/bin/python``: transformers, tokenizers,
torch and safetensors are vLLM's dependencies), so the config is the one that transformers
release knows. The model is ``Qwen3NextForCausalLM``: the hybrid Qwen3.5/3.6 carry on from
Qwen3-Next (three Gated DeltaNet layers, then one gated full-attention layer; experts with a
shared one), shrunk to ~10 M parameters. Not ``Qwen3_5MoeForConditionalGeneration`` itself:
vLLM's qwen3_5 module imports its vision model, which needs torchvision, and the only
torchvision on PyPI is a CUDA build that fails to load beside the CPU torch (the CPU build is on
download.pytorch.org; docs/SERVE_CHECK.md). Choices the CPU backend needs: linear key/value head dims of 128 (its Gated DeltaNet kernel), untied embeddings (a tied
lm_head is left unloaded). The tokenizer is a byte-level BPE trained on a few sentences with
Qwen's special tokens; the chat template is Qwen-style (``<|im_start|>``, ``<think>``, tools as
``<tool_call><function=…><parameter=…>``, which the ``qwen3_coder`` parser reads). Same
seed, same files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VOCAB = 2048

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the weather in Paris today? It is sunny and warm, about 24 degrees.",
    "Call the function get_weather with the city and the unit of temperature.",
    "def add(a, b):\n    return a + b\n",
    "kiln builds patched vLLM images at build time; the server answers on port 8000.",
    "Tool calls: search the web, read a file, write a file, run a command, list a directory.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\", \"unit\": \"celsius\"}}",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n</function>\n</tool_call>",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, letters abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.",
    "Summarise the text in one sentence. Explain step by step. Translate to French: bonjour, merci.",
]

CHAT_TEMPLATE = r"""{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}

# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

If you choose to call a function, reply with:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.reasoning_content %}
<think>
{{ message.reasoning_content }}
</think>
{%- endif %}
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
<function={{ fn.name }}>
{%- set args = fn.arguments if fn.arguments is mapping else {} %}
{%- for key, value in args.items() %}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{%- endif %}
{% endif %}"""


def tokenizer_files(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False} for t in SPECIALS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    return tokenizer.get_vocab_size()


def model_files(out: Path, token_id) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, decoder_sparse_step=1, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=token_id("<|im_end|>"), pad_token_id=token_id("<|endoftext|>"),
        # partial rotary: a quarter of head_dim 128, as Qwen3-Next and Qwen3.5/3.6 do
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [token_id("<|im_end|>"), token_id("<|endoftext|>")], "do_sample": False}))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    model_files(out, tokenizer.token_to_id)
    print(json.dumps({"model": str(out), "files": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
