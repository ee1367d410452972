"""`data.chat_template` by name: each named template renders the prompt format its model card
publishes (expected strings written here from those cards, not from the templates), the loss lands
on the assistant turns, and a bad name or a conversation the template refuses is one line, exit 2,
before any process starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.config.data import DataConfig
from shardtune.errors import UserError
from shardtune.train.data.dataset import _override_template, encode_example
from shardtune.train.data.tokenizer import ByteTokenizer, HFTokenizer

REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
# the prompt formats as the model cards print them (bos/eos: this tokenizer's <s> and </s>)
CARDS = {
    "llama-3": ("<s><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nA2<|eot_id|>", ["A<|eot_id|>", "A2<|eot_id|>"]),
    "chatml": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
               "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
               ["A<|im_end|>\n", "A2<|im_end|>\n"]),
    "zephyr": ("<|system|>\nS</s>\n<|user|>\nQ</s>\n<|assistant|>\nA</s>\n<|user|>\nQ2</s>\n<|assistant|>\nA2</s>\n",
               ["A</s>\n", "A2</s>\n"]),
    "gemma": ("<s><start_of_turn>user\nQ<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
              "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>\n",
              ["A<end_of_turn>\n", "A2<end_of_turn>\n"]),
}


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bytetok")
    ByteTokenizer().save_pretrained(folder)  # a real transformers tokenizer: bos <s>, eos </s>
    return folder


def _tok(folder: Path, name: str) -> HFTokenizer:
    from transformers import AutoTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    _override_template(tok, name)
    return tok


def _spans(ids, mask, tok) -> list[str]:
    out, cur = [], []
    for i, t in zip(ids + [0], mask + [False]):
        if t:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    return out


@pytest.mark.parametrize("name", sorted(CARDS))
def test_named_template_renders_the_model_cards_format(byte_folder, name):
    from shardtune.catalog.chat_templates import CHAT_TEMPLATES

    text, targets = CARDS[name]
    msgs = MSGS[1:] if name == "gemma" else MSGS  # Gemma's template has no system role
    tok = _tok(byte_folder, name)
    assert tok.chat_template == CHAT_TEMPLATES[name].jinja and DataConfig(chat_template=name).chat_template == name
    ids, mask = encode_example({"messages": msgs}, tok)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert _spans(ids, mask, tok) == targets  # the loss is on the assistant turns and their end marker


def test_a_conversation_the_template_refuses_is_one_line(byte_folder):
    tok = _tok(byte_folder, "gemma")
    with pytest.raises(UserError, match=r"refuses a conversation \(system/user/assistant\).*System role not supp"):
        encode_example({"prompt": "Q", "response": "A"}, tok, system_prompt="be brief")


def test_unknown_name_is_one_line_exit_2_before_any_process(monkeypatch, capsys, tmp_path):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    def no_torchrun(*a, **k):
        raise AssertionError("torchrun was started for bad input")

    monkeypatch.setattr(commands, "run_process_group", no_torchrun)
    rc = cli.main(["train", str(REPO / "recipes" / "tiny-cpu.yaml"), "--nproc", "2", "--output-dir",
                   str(tmp_path / "run"), "data.chat_template=chatlm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "'chatlm'" in err[0] and all(n in err[0] for n in CARDS), err[0]
    with pytest.raises(UserError, match="not a named template"):  # a DataConfig built without validation
        _override_template(ByteTokenizer(), "chatlm")
