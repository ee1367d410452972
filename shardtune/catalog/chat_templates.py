"""Named chat templates for `data.chat_template`: Jinja text as the model families publish it.

Each is the `chat_template` of the named model's tokenizer_config.json on the Hugging Face Hub
(copied as published; only ChatML is written out here from its spec, without Qwen2's default
system turn and tool-call branches). `apply_chat_template` renders them (train/data/tokenizer.py
marks the assistant turns by rendering turn by turn). A template only writes text: its markers
(`<|im_start|>`, `<|eot_id|>`, ...) are single tokens only where the tokenizer has them as special
tokens. Imports nothing heavy.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    jinja: str
    source: str  # where the text comes from


_LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
_GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
CHAT_TEMPLATES = {t.name: t for t in (
    ChatTemplate("chatml", _CHATML, "ChatML (OpenAI), as Qwen2/Qwen2.5 and SmolLM2 use it: "
                                    "<|im_start|>role\\ncontent<|im_end|>\\n"),
    ChatTemplate("llama-3", _LLAMA3, "meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json"),
    ChatTemplate("zephyr", _ZEPHYR, "HuggingFaceH4/zephyr-7b-beta tokenizer_config.json"),
    ChatTemplate("gemma", _GEMMA, "google/gemma-2b-it tokenizer_config.json (no system role)"),
)}


def is_template_name(spec: str) -> bool:
    """A `data.chat_template` value that is neither Jinja text nor a .jinja/.j2 file names a template."""
    return "{" not in spec and not spec.endswith((".jinja", ".j2"))


def unknown_template_message(spec: str) -> str:
    return (f"data.chat_template {spec!r} is not a named template ({', '.join(CHAT_TEMPLATES)}), Jinja text or a "
            ".jinja file; give one of those")
