"""Offline tiny-model kit: a Hugging Face model directory made locally, with no network.

`make_tiny_model(dir)` writes a byte-level BPE tokenizer (trained here with `tokenizers` on generated text
covering arithmetic, the guess-the-number game, calculator tool calls and `\\boxed{}` answers; digits are
split one per token, Qwen2's pre-tokenizer), a ChatML chat template (`<|im_start|>role\\n...<|im_end|>\\n`;
tools rendered as Qwen2.5 does), and a random-init causal LM (Qwen2, Qwen3 or Llama architecture, ~0.6M
parameters by default; or a mixture of experts: Qwen3-MoE, GLM-4.5 MoE, with 4 experts and top-2 routing) saved
as safetensors. The GLM-4.5 MoE model has GLM's layout in small: one leading dense layer, one shared expert, RoPE
on half of each head, q/k/v biases, grouped top-k routing (2 groups of 2 experts, 1 group kept) and a random
nonzero `e_score_correction_bias`, so the experts a token is sent to differ from those with the largest weights.
`qwen2_5_vl` is a vision-language model: Qwen2.5-VL's layout in small (a 2-block vision tower with window and
full attention, its patch merger, a Qwen2 language model with multimodal RoPE) plus an image processor
(`preprocessor_config.json`: 14-pixel patches merged 2x2, images resized to between 56x56 and 112x112
pixels, so 4 to 16 tokens each) and the vision tokens `<|vision_start|><|image_pad|><|vision_end|>` in the
tokenizer; its chat template renders a message's image parts as those tokens (text parts as their text).
Invariants: the same `(arch, seed, sizes)` gives the same files; the tokenizer does not depend on `seed`
(models of every seed and arch share token ids); `AutoTokenizer` and
`AutoModelForCausalLM.from_pretrained(dir)` load the result; eos is `<|im_end|>`, pad is `<|endoftext|>`;
the model's vocab_size equals `len(tokenizer)`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

ARCHS = ("qwen2", "qwen3", "llama")  # dense
MOE_ARCHS = ("qwen3_moe", "glm4_moe")
VLM_ARCHS = ("qwen2_5_vl",)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PIXELS = (56 * 56, 112 * 112)  # the tiny VLM's image processor: min_pixels, max_pixels
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Qwen2's pre-tokenizer (one token per digit); transformers' Qwen2Tokenizer rebuilds exactly this pipeline, so
# every tokenizer class that may load the directory tokenizes the same way.
PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# ChatML for every role, plus tools the way Qwen2.5's template renders them: the function schemas in a system
# turn (merged with a leading system message), assistant `tool_calls` as `<tool_call>{json}</tool_call>` blocks
# and a tool result that answers a call (it has `tool_call_id`) inside `<tool_response>`. A conversation without
# tools renders exactly as plain ChatML.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(TOOLS_FORMAT) + " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{%- if message['role'] == 'tool' and message.tool_call_id is defined %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in (message.tool_calls or []) if message['role'] == 'assistant' %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n' if (message['content'] or not loop.first) else '' }}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# the same template, with a message's content either text or parts: an image part is the model's vision tokens
VLM_CHAT_TEMPLATE = (
    "{%- macro content(c) %}"
    "{%- if c is string or c is none %}{{- c or '' }}"
    "{%- else %}{%- for part in c %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}" + CHAT_TEMPLATE.replace("(message['content'] or '')", "content(message['content'])")
)

_WORD_TEXT = (
    "the a is of to and what number guess higher lower correct too high low your my answer think try "
    "again game between you have turns left win lose compute calculate add subtract multiply plus minus "
    "times equals result tool call use calculator question solve final step first then so sum difference "
    "product user assistant system please reply with only output format box boxed value i it be in on for "
    "yes no right wrong good done is not that this let me check hint secret pick"
)
_WORDS = _WORD_TEXT.split()


def _corpus(rng: random.Random, n_lines: int = 1500) -> list[str]:
    """Generated training text: arithmetic, game feedback, tool calls, chat markup and common words."""
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        guess, secret = rng.randint(1, 100), rng.randint(1, 100)
        fb = "higher" if guess < secret else "lower" if guess > secret else "correct"
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
        lines += [
            f"What is {a} {op} {b}? The answer is \\boxed{{{val}}}.",
            f"{a}{op}{b}={val}",
            f"<calc>{a}{op}{b}</calc>\n<result>{val}</result>",
            f"Guess the number between 1 and 100. My guess: {guess}. Feedback: {fb}.",
            f"{IM_START}user\n{words}{IM_END}\n{IM_START}assistant\n{words.capitalize()}.{IM_END}\n",
        ]
    return lines


def train_tokenizer(vocab_size: int = 1024, corpus_seed: int = 0, vision: bool = False):
    """Train a byte-level BPE (digits split individually) and wrap it as a `PreTrainedTokenizerFast`;
    `vision`: with the vision tokens and the template that renders image parts."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(corpus_seed)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, *(VISION_TOKENS if vision else [])],
    )
    fast.chat_template = VLM_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return fast


def model_config(arch: str, vocab_size: int, hidden: int = 128, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, intermediate: int | None = None, max_position: int = 2048,
                 rope_theta: float = 10000.0, tie_embeddings: bool = True, init_std: float = 0.02,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 head_dim: int | None = None, experts: int = 4, experts_per_token: int = 2,
                 moe_intermediate: int | None = None,
                 vision_token_ids: list[int] | None = None):  # fmt: skip
    """The transformers config for `arch` with the given sizes (head_dim defaults to hidden // heads; the MoE
    archs' experts have `moe_intermediate` (default hidden) units, their dense layers `intermediate`)."""
    from transformers import Glm4MoeConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch not in ARCHS + MOE_ARCHS + VLM_ARCHS:
        from agentrl.errors import ConfigError

        raise ConfigError(f"arch must be one of {', '.join(ARCHS + MOE_ARCHS + VLM_ARCHS)}, got {arch!r}")
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig,
           "glm4_moe": Glm4MoeConfig}.get(arch)  # fmt: skip
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate or 4 * hidden,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        head_dim=head_dim or hidden // heads,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    if arch in VLM_ARCHS:
        return _vlm_config(kwargs | {"vision_token_ids": vision_token_ids})
    moe = dict(num_experts_per_tok=experts_per_token, moe_intermediate_size=moe_intermediate or hidden)
    if arch == "qwen3_moe":
        kwargs |= moe | dict(
            num_experts=experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]
        )
    elif arch == "glm4_moe":
        kwargs |= moe | dict(
            n_routed_experts=experts, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=False,
        )  # fmt: skip
        kwargs["rope_parameters"] |= {"partial_rotary_factor": 0.5}
    return cls(**kwargs)


def _vlm_config(text: dict[str, Any]):
    """Qwen2.5-VL in small: `text` is the language model's config (a Qwen2's); the vision tower has 2 blocks
    (the first with window attention, the second full), 32 wide, and multimodal RoPE splits each head's
    frequencies 1:1.5:1.5 between time, height and width, as Qwen2.5-VL's [16, 24, 24] does."""
    from transformers import Qwen2_5_VLConfig

    half = text["head_dim"] // 2
    hw = (half - half // 4) // 2
    text["rope_parameters"] |= {"mrope_section": [half - 2 * hw, hw, hw]}
    text.pop("head_dim")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  fullatt_block_indexes=[1], window_size=56, initializer_range=text["initializer_range"])  # fmt: skip
    ids = text.pop("vision_token_ids")
    tie = text["tie_word_embeddings"]
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie,
                            **dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                        "video_token_id"), ids, strict=True)))  # fmt: skip


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab_size: int = 1024,
    init_std: float = 0.02,
    tie_embeddings: bool = True,
    max_position: int = 2048,
    head_dim: int | None = None,
) -> Path:
    """Write tokenizer + random-init causal LM to `path` (created if missing) and return the path.

    The files are written to a private directory next to `path` and moved in one by one, `config.json` last:
    a reader that finds `config.json` (as `agentrl run` checks) finds a whole model, even while other processes
    write the same model (two runs started at once on the default `runs/tiny-model`) or after a writer died."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        dims = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                    max_position=max_position, tie_embeddings=tie_embeddings, init_std=init_std, head_dim=head_dim)  # fmt: skip
        _write_tiny_model(tmp, arch, seed, vocab_size, dims)
        path.mkdir(exist_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_tiny_model(path: Path, arch: str, seed: int, vocab_size: int, dims: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    vision = arch in VLM_ARCHS
    # one tokenizer for every seed: models of any seed share ids
    tokenizer = train_tokenizer(vocab_size, vision=vision)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    extra = {"vision_token_ids": tokenizer.convert_tokens_to_ids(VISION_TOKENS)} if vision else {}
    config = model_config(arch, len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id, **dims, **extra)
    saved_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers starts the correction bias at 0: then it would not change a choice
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    torch.random.set_rng_state(saved_rng)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if vision:
        from transformers import Qwen2VLImageProcessorPil

        low, high = IMAGE_PIXELS
        Qwen2VLImageProcessorPil(size={"shortest_edge": low, "longest_edge": high}).save_pretrained(path)
    meta = {"arch": arch, "seed": seed, "params": sum(p.numel() for p in model.parameters())}
    (path / "agentrl_tiny.json").write_text(json.dumps(meta) + "\n")
