"""A tiny Qwen3.6-family model made here: random weights, a locally trained tokenizer, no hub.

    python tiny_model.py [--family qwen3_next|qwen3_5] OUT_DIR

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

``--family qwen3_5`` (the GPU serve bundle, ``ci/gpu_serve_bundle.py``; the GPU machine has
torchvision): ``Qwen3_5ForConditionalGeneration``, Qwen3.6-27B's own architecture, dense. The
attention shape is the 27B's where kiln's kernels and vLLM's KV-cache sizing read it: gated
full attention with 24 query heads, 4 KV heads, head dim 256 (what the image's
``[model.kernels]`` preset compiles ahead of time, and a head dim TurboQuant k8v4 takes), and
Gated DeltaNet layers with 16 key / 48 value heads of dim 128 (the Mamba page the block size is
derived from). Everything else is shrunk: hidden size 128, three GDN layers then one full one
(the 27B's 3:1), a one-layer vision tower, and an MTP head (``mtp.*``, one full-attention layer,
the weights vLLM's ``qwen3_5_mtp`` loads, which transformers does not make) for
``--speculative-config '{"method": "mtp"}'``. float16, as the image serves it.
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


QWEN35_TEXT = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, attn_output_gate=True,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6, mtp_num_hidden_layers=1,
    tie_word_embeddings=False, dtype="float16",
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
QWEN35_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=256)


def qwen35_model_files(out: Path, token_id) -> dict:
    """Qwen3_5ForConditionalGeneration, dense, with an MTP head; returns what the config says."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    specials = {name: token_id(name) for name in ("<|im_end|>", "<|endoftext|>", "<|vision_start|>",
                                                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    config = AutoConfig.for_model(
        "qwen3_5", text_config={**QWEN35_TEXT, "eos_token_id": specials["<|im_end|>"],
                                "pad_token_id": specials["<|endoftext|>"]},
        vision_config=QWEN35_VISION, image_token_id=specials["<|image_pad|>"],
        video_token_id=specials["<|video_pad|>"], vision_start_token_id=specials["<|vision_start|>"],
        vision_end_token_id=specials["<|vision_end|>"], tie_word_embeddings=False)
    # transformers' own initialisation (seeded): each norm as its class expects it
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    shards = sorted(out.glob("*.safetensors"))
    if len(shards) != 1:
        raise SystemExit(f"{out}: expected one safetensors file, found {len(shards)}")
    weights = load_file(str(shards[0]))
    # The MTP head: a full-attention decoder layer shaped like the model's own, fc over
    # [embedding; hidden], and its three norms: the names vLLM's qwen3_5_mtp loads.
    full = QWEN35_TEXT["layer_types"].index("full_attention")
    prefix = next(k for k in weights if k.endswith(f"layers.{full}.self_attn.q_proj.weight")).rsplit(
        f"layers.{full}.", 1)[0]
    hidden = QWEN35_TEXT["hidden_size"]
    generator = torch.Generator().manual_seed(1)
    for key, value in list(weights.items()):
        if key.startswith(f"{prefix}layers.{full}."):
            rest = key[len(f"{prefix}layers.{full}."):]
            fresh = value.clone() if value.dim() < 2 else \
                (torch.randn(value.shape, generator=generator) * 0.02).to(value.dtype)  # norms: the layer's own
            weights[f"mtp.layers.0.{rest}"] = fresh
    weights["mtp.fc.weight"] = (torch.randn((hidden, 2 * hidden), generator=generator) * 0.02).half()
    final_norm = weights[f"{prefix}norm.weight"]  # the model's last norm: the same kind of RMSNorm
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        weights[norm] = final_norm.clone()
    save_file(weights, str(shards[0]), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]], "do_sample": False}))
    text = json.loads((out / "config.json").read_text())
    return {"architectures": text.get("architectures"), "model_type": text.get("model_type"),
            "parameters": sum(v.numel() for v in weights.values()),
            "mtp_tensors": sorted(k for k in weights if k.startswith("mtp."))}


def main(out: Path, family: str = "qwen3_next") -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    made = {}
    if family == "qwen3_5":
        made = qwen35_model_files(out, tokenizer.token_to_id)
    else:
        model_files(out, tokenizer.token_to_id)
    print(json.dumps({"model": str(out), "family": family, **made,
                      "files": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = "qwen3_next"
    if args[:1] == ["--family"]:
        chosen, args = args[1], args[2:]
    if chosen not in ("qwen3_next", "qwen3_5") or len(args) != 1:
        raise SystemExit("usage: tiny_model.py [--family qwen3_next|qwen3_5] OUT_DIR")
    main(Path(args[0]), chosen)
