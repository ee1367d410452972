"""Data pipeline: masking, packing, sharding, resume, validation, and no attention across examples.

Expected values are built by hand from the byte values of the strings (ord('a') = 97, ...).
"""
from __future__ import annotations

import json

import pytest
import torch

from shardtune.config import DataConfig, TrainConfig
from shardtune.errors import UserError
from shardtune.strategies import IGNORE_INDEX
from shardtune.train.data.dataset import (
    build_dataloader,
    build_tokenizer,
    check_dataset,
    encode_example,
    steps_for_epochs,
)
from shardtune.train.data.packing import build_row, pack_examples
from shardtune.train.data.tokenizer import ByteTokenizer

X = IGNORE_INDEX
BOS, EOS, PAD = 256, 257, 258


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(p)


def test_prompt_response_labels_only_on_response():
    tok = ByteTokenizer()
    ids, mask = encode_example({"prompt": "ab\n", "response": "c"}, tok)
    assert ids == [BOS, 97, 98, 10, 99, EOS]
    data = pack_examples([(ids, mask)], seq_len=8, packing=True, seed=0)
    inp, lab, pos = build_row(data, data.rows[0], PAD)
    assert inp == [BOS, 97, 98, 10, 99, EOS, PAD, PAD]
    # shifted: '\n' predicts 'c', 'c' predicts eos; nothing else (prompt, last token, padding)
    assert lab == [X, X, X, 99, EOS, X, X, X]
    assert pos == [0, 1, 2, 3, 4, 5, 0, 1]


def test_text_and_plain_chat_templates():
    tok = ByteTokenizer()
    ids, mask = encode_example({"text": "hi"}, tok)
    assert (ids, mask) == ([BOS, 104, 105, EOS], [False, True, True, True])
    ids, mask = encode_example({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}, tok)
    text = "<|user|>\na\n<|assistant|>\n"
    assert ids == [BOS] + list(text.encode()) + [98, EOS]
    assert mask == [False] * (1 + len(text)) + [True, True]


def test_packing_positions_restart_and_labels_never_cross():
    tok = ByteTokenizer()
    enc = [encode_example({"text": "abc"}, tok), encode_example({"text": "de"}, tok)]  # 5 and 4 tokens
    data = pack_examples(enc, seq_len=12, packing=True, seed=0)
    assert data.num_rows == 1
    inp, lab, pos = build_row(data, data.rows[0], PAD)
    first = data.rows[0][0]
    n1, n2 = (5, 4) if first == 0 else (4, 5)
    assert pos == list(range(n1)) + list(range(n2)) + [0, 1, 2]
    assert lab[n1 - 1] == X and inp[n1] == BOS  # last of example 1 does not predict example 2
    assert lab[n1 + n2 - 1] == X
    unpacked = pack_examples(enc, seq_len=12, packing=False, seed=0)
    assert unpacked.num_rows == 2


def test_truncation_and_dropping():
    tok = ByteTokenizer()
    enc = [encode_example({"prompt": "x" * 20, "response": "y"}, tok), encode_example({"text": "abcdef"}, tok)]
    data = pack_examples(enc, seq_len=6, packing=True, seed=0)
    assert (data.num_dropped, data.num_truncated, data.num_rows) == (1, 2, 1)


def _loader(tmp_path, micro, rank, size, seed=0, n=40, shuffle=True):
    tmp_path.mkdir(exist_ok=True)
    path = _write(tmp_path, [{"prompt": f"p{i}:", "response": "r" * (i % 7 + 1)} for i in range(n)])
    dcfg = DataConfig(path=path, shuffle=shuffle)
    return build_dataloader(dcfg, TrainConfig(micro_batch=micro, seq_len=16), ByteTokenizer(), rank, size, seed)


def _take(loader, k):
    return [next(loader) for _ in range(k)]


def test_rank_shards_are_disjoint_and_union_is_the_global_batch(tmp_path):
    single = _take(_loader(tmp_path, 4, 0, 1), 6)       # 1 process × micro-batch 4
    pairs = [_take(_loader(tmp_path, 2, r, 2), 6) for r in range(2)]   # 2 ranks × 2
    quads = [_take(_loader(tmp_path, 1, r, 4), 6) for r in range(4)]   # 4 ranks × 1
    accum = _take(_loader(tmp_path, 2, 0, 1), 12)        # 1 process × 2, accumulated 2 ×
    for s in range(6):
        for key in ("input_ids", "labels", "position_ids"):
            want = single[s][key]
            assert torch.equal(torch.cat([pairs[r][s][key] for r in range(2)]), want)
            assert torch.equal(torch.cat([quads[r][s][key] for r in range(4)]), want)
            assert torch.equal(torch.cat([accum[2 * s][key], accum[2 * s + 1][key]]), want)
    # rows of one step across ranks are distinct rows of the data
    rows = {tuple(x.tolist()) for r in range(2) for x in pairs[r][0]["input_ids"]}
    assert len(rows) == 4


def test_deterministic_and_seeded(tmp_path):
    a, b, c = (_take(_loader(tmp_path, 2, 0, 1, seed=s), 5) for s in (3, 3, 4))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))


def test_epochs_cover_every_row_and_reshuffle(tmp_path):
    loader = _loader(tmp_path, 1, 0, 1)
    r = loader.num_rows
    seen = [tuple(next(loader)["input_ids"][0].tolist()) for _ in range(2 * r)]
    assert sorted(seen[:r]) == sorted(seen[r:]) and len(set(seen[:r])) == r
    assert seen[:r] != seen[r:]
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["index"] == 0


def test_no_shuffle_keeps_file_order_across_rows_and_epochs(tmp_path):
    """data.shuffle false: the stream is the file's examples in order, packed next-fit (the file
    is the reference: its prompts p0:, p1:, ... read back from the rows)."""
    loader = _loader(tmp_path, 1, 0, 1, shuffle=False)
    text = []
    for _ in range(loader.num_rows):
        ids = next(loader)["input_ids"][0].tolist()
        text.append(bytes(i for i in ids if i < 256).decode())
    prompts = "".join(text).replace("r", "").split(":")[:-1]
    assert prompts == [f"p{i}" for i in range(40)]
    again = [bytes(i for i in next(loader)["input_ids"][0].tolist() if i < 256).decode() for _ in text]
    assert again == text  # the next epoch: the same order


def test_state_dict_resume_continues_identically(tmp_path):
    ref = _loader(tmp_path, 2, 1, 2)
    ref_batches = _take(ref, 9)
    run = _loader(tmp_path, 2, 1, 2)
    _take(run, 4)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON round trip
    resumed = _loader(tmp_path, 2, 1, 2)
    resumed.load_state_dict(state)
    for want, got in zip(ref_batches[4:], _take(resumed, 5)):
        assert torch.equal(want["input_ids"], got["input_ids"]) and torch.equal(want["labels"], got["labels"])
    # resuming at another world size continues the same global stream: 1 rank × 4 = rows of both ranks
    whole = _loader(tmp_path, 4, 0, 1)
    whole.load_state_dict(state)
    other = _loader(tmp_path, 2, 0, 2)
    other.load_state_dict(state)
    nxt = next(whole)["input_ids"]
    assert torch.equal(nxt[:2], next(other)["input_ids"]) and torch.equal(nxt[2:], ref_batches[4]["input_ids"])


def test_dataset_smaller_than_a_global_batch_is_refused(tmp_path):
    with pytest.raises(UserError, match="fewer than one global batch"):
        _loader(tmp_path, 4, 0, 2, n=3, shuffle=False)


def test_tokenizer_must_fit_the_model_vocabulary(tmp_path):
    assert build_tokenizer(DataConfig(), "tiny-llama").vocab_size == 259  # fits 264
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 200}')
    with pytest.raises(UserError, match="has 259 ids but model .* has vocab_size 200"):
        build_tokenizer(DataConfig(), str(tmp_path))


def test_resume_refuses_other_data(tmp_path):
    state = _loader(tmp_path, 2, 0, 1).state_dict()
    with pytest.raises(UserError, match="same data"):
        _loader(tmp_path / "other", 2, 0, 1, n=90).load_state_dict(state)


def test_steps_for_epochs():
    assert steps_for_epochs(100, 1.0, 8) == 13  # ceil(100 / 8)
    assert steps_for_epochs(100, 0.5, 8) == 7    # ceil(50 / 8)
    assert steps_for_epochs(3, 0.01, 8) == 1


@pytest.mark.parametrize("lines,match", [
    ([{"text": "a"}, {"text": "b"}, "{not json", {"text": "c"}], "line 3: malformed JSON"),
    ([{"text": "a"}, {"question": "x"}], "line 2: unknown format"),
    ([{"text": 5}], "line 1: 'text' must be a string"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([{"messages": [{"role": "user", "content": "x"}]}], "line 1: chat example has no assistant"),
    ([{"messages": [{"role": "bot", "content": "x"}]}], "line 1: each message needs a 'role'"),
    ([], "is empty"),
    (["", "  "], "is empty"),
])
def test_bad_datasets_are_one_line_user_errors(tmp_path, lines, match):
    with pytest.raises(UserError, match=match) as e:
        check_dataset(DataConfig(path=_write(tmp_path, lines)))
    assert "\n" not in str(e.value)


def test_missing_and_unsupported_and_format_mismatch(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_dataset(DataConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(UserError, match=r"files must be one of .*got \['.xml'\]"):
        check_dataset(DataConfig(path=_write(tmp_path, ["<a/>"], name="d.xml")))
    with pytest.raises(UserError, match="line 2: is 'text' but data.format=prompt_response"):
        check_dataset(DataConfig(path=_write(tmp_path, [{"prompt": "a", "response": "b"}, {"text": "c"}]),
                                 format="prompt_response"))
    assert check_dataset(DataConfig(path=None, generated_examples=17)) == 17


def test_byte_tokenizer_export_loads_back_with_transformers(tmp_path):
    from transformers import AutoTokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    s = "héllo\n\t日本 <x>"
    assert hf(s)["input_ids"] == [BOS] + list(s.encode("utf-8"))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS, EOS, PAD)
    # the folder's tokenizer, through data.tokenizer=auto, renders chat with its (Jinja) template;
    # marking assistant turns incrementally must give what the plain template gives directly
    (tmp_path / "config.json").write_text("{}")
    tok = build_tokenizer(DataConfig(tokenizer="auto"), str(tmp_path))
    assert tok.name == "hf" and tok.chat_template
    msgs = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                         {"role": "assistant", "content": "dé"}]}
    assert encode_example(msgs, tok) == encode_example(msgs, ByteTokenizer())


def test_packed_rows_do_not_attend_across_examples():
    """Loss of a packed row == sum of the examples' losses run alone (transformers' packed mask)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.catalog.models import resolve_model_config

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**resolve_model_config("tiny-llama"), "num_hidden_layers": 2})
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    model.config.use_cache = False
    tok = ByteTokenizer()
    enc = [encode_example({"prompt": "reverse: abc\n", "response": "cba"}, tok),
           encode_example({"text": "hello world"}, tok)]
    data = pack_examples(enc, seq_len=40, packing=True, seed=0)
    assert data.num_rows == 1

    def loss_sum(row_ids, labels, pos, mask=None):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row_ids]), position_ids=torch.tensor([pos]),
                           attention_mask=mask).logits[0]
        return torch.nn.functional.cross_entropy(logits, torch.tensor(labels), ignore_index=X, reduction="sum")

    packed = loss_sum(*build_row(data, data.rows[0], PAD))
    alone = sum(loss_sum(*build_row(data, [k], PAD)) for k in data.rows[0])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # the check can fail: an explicit all-ones 2-D mask switches packing detection off → leakage
    row = build_row(data, data.rows[0], PAD)
    leaky = loss_sum(*row, mask=torch.ones(1, 40, dtype=torch.long))
    assert (leaky - alone).abs() > 1e-3


def test_generated_dataset_is_seeded_and_correct(tmp_path):
    from shardtune.train.data.datagen import generate_examples, main

    a, b, c = generate_examples(200, 7), generate_examples(200, 7), generate_examples(200, 8)
    assert a == b and a != c
    for ex in a:
        task, arg = ex["prompt"].rstrip("\n").split(": ")
        want = {"reverse": lambda w: w[::-1], "upper": str.upper, "sort": lambda w: "".join(sorted(w)),
                "add": lambda s: str(sum(int(x) for x in s.split("+")))}[task](arg)
        assert ex["response"] == want
    assert {ex["prompt"].split(":")[0] for ex in a} == {"reverse", "upper", "sort", "add"}
    main([str(tmp_path / "g.jsonl"), "--examples", "25", "--seed", "7"])
    written = DataConfig(path=str(tmp_path / "g.jsonl"), format="prompt_response")
    assert check_dataset(written) == 25
    from shardtune.train.data.dataset import read_records

    assert read_records(written) == a[:25]


def test_chat_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from shardtune.train.data.tokenizer import HFTokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    hf.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(UserError, match="rewrites earlier turns"):
        encode_example(msgs, HFTokenizer(hf))
    assert encode_example(msgs, HFTokenizer(hf), template="plain") == encode_example(msgs, ByteTokenizer())
    with pytest.raises(UserError, match="has no chat template"):
        encode_example(msgs, ByteTokenizer(), template="chat")


def test_completion_is_an_alias_of_response(tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "completion": "b"}])
    from shardtune.train.data.dataset import read_records

    assert read_records(DataConfig(path=path)) == [{"prompt": "a", "response": "b"}]


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% for m in messages %}{% set c = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set c = bos_token + c %}"
          "{% endif %}{{ c }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


@pytest.mark.parametrize("template,targets", [
    (CHATML, ["hi<|im_end|>\n", "ok<|im_end|>\n"]),   # Qwen2's ChatML: the turn's end is learned
    (LLAMA3, ["hi<|eot_id|>", "ok<|eot_id|>"]),        # Llama-3 instruct: content + <|eot_id|>
])
def test_real_chat_templates_mark_exactly_the_assistant_turns(tmp_path, template, targets):
    from transformers import AutoTokenizer

    from shardtune.train.data.tokenizer import HFTokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    hf.chat_template = template
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"}]
    ids, mask = encode_example({"messages": msgs}, HFTokenizer(hf))
    # the whole rendering is what the template gives in one go
    assert ids == HFTokenizer(hf).encode(hf.apply_chat_template(msgs, tokenize=False))
    spans, cur = [], []
    for i, t in zip(ids, mask):
        if t:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    assert [ByteTokenizer().decode(s, skip_special_tokens=False) for s in spans] == targets
