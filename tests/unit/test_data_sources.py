"""Data sources and formats (train/data/sources.py): every file kind, glob, save_to_disk folder and
offline cached id gives the rows written here (by pyarrow / pandas / datasets' own writers);
Alpaca, ShareGPT and data.columns map onto the records built by hand; bad inputs are one line."""
from __future__ import annotations

import json

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardtune.config import DataConfig
from shardtune.errors import UserError
from shardtune.train.data.dataset import encode_example
from shardtune.train.data.sources import read_records
from shardtune.train.data.tokenizer import ByteTokenizer

ROWS = [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}, {"prompt": "p3", "response": "r3"}]
BOS, EOS = 256, 257


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def _table(rows):
    return pa.table({k: [r[k] for r in rows] for k in rows[0]})


def _read(path, **kw):
    return read_records(DataConfig(path=str(path), **kw))


def test_every_file_kind_and_glob_and_folder(tmp_path):
    pq.write_table(_table(ROWS), tmp_path / "d.parquet")
    _table(ROWS).to_pandas().to_csv(tmp_path / "d.csv", index=False)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    with pa.ipc.new_stream(tmp_path / "d.arrow", _table(ROWS).schema) as w:
        w.write_table(_table(ROWS))
    for name in ("d.parquet", "d.csv", "d.json", "d.arrow"):
        assert _read(tmp_path / name) == ROWS, name
    (tmp_path / "g").mkdir()
    pq.write_table(_table(ROWS[:2]), tmp_path / "g" / "a.parquet")
    pq.write_table(_table(ROWS[2:]), tmp_path / "g" / "b.parquet")
    assert _read(tmp_path / "g" / "*.parquet") == ROWS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                               "test": datasets.Dataset.from_list(ROWS[1:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert _read(tmp_path / "saved") == ROWS[:1]
    assert _read(tmp_path / "saved", split="test") == ROWS[1:]
    with pytest.raises(UserError, match="no split 'val'"):
        _read(tmp_path / "saved", split="val")


def test_cached_dataset_id_offline(tmp_path):
    repo = tmp_path / "hub" / "datasets--me--tiny"
    (repo / "snapshots" / "abc" / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    pq.write_table(_table(ROWS[:2]), repo / "snapshots" / "abc" / "data" / "train-00000-of-00001.parquet")
    pq.write_table(_table(ROWS[2:]), repo / "snapshots" / "abc" / "data" / "test-00000-of-00001.parquet")
    assert read_records(DataConfig(path="me/tiny")) == ROWS[:2]
    assert read_records(DataConfig(path="me/tiny", split="test")) == ROWS[2:]
    with pytest.raises(UserError, match="hf download --repo-type dataset me/absent") as e:
        read_records(DataConfig(path="me/absent"))
    assert "\n" not in str(e.value)


def test_alpaca_sharegpt_and_column_mapping(tmp_path):
    alpaca = [{"instruction": "Add", "input": "1 2", "output": "3"}, {"instruction": "Hi", "input": "", "output": "Yo"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    assert _read(tmp_path / "a.jsonl") == [{"prompt": "Add\n\n1 2", "response": "3"},
                                           {"prompt": "Hi", "response": "Yo"}]
    share = [{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                {"from": "gpt", "value": "A"}]}]
    (tmp_path / "s.jsonl").write_text(json.dumps(share[0]) + "\n")
    assert _read(tmp_path / "s.jsonl", format="sharegpt") == [{"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"], "id": [7]}), tmp_path / "m.parquet")
    assert _read(tmp_path / "m.parquet", columns={"prompt": "question", "response": "answer"}) == [
        {"prompt": "q", "response": "a"}]
    with pytest.raises(UserError, match=r"data.columns names \['answr'\] .* columns \['question', 'answer', 'id'\]"):
        _read(tmp_path / "m.parquet", columns={"prompt": "question", "response": "answr"})
    with pytest.raises(UserError, match=r"row 1: unknown format \(keys \['answer', 'id', 'question'\]\).*Alpaca"):
        _read(tmp_path / "m.parquet")


def test_empty_and_missing_are_one_line(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    for path, match in [(tmp_path / "e.parquet", "is empty"), (tmp_path / "nope.parquet", "does not exist")]:
        with pytest.raises(UserError, match=match) as e:
            _read(path)
        assert "\n" not in str(e.value)


def test_train_on_inputs_and_system_prompt():
    tok = ByteTokenizer()
    rec = {"prompt": "a\n", "response": "b"}
    ids, mask = encode_example(rec, tok, "plain")
    assert ids == [BOS, 97, 10, 98, EOS] and mask == [False, False, False, True, True]
    assert encode_example(rec, tok, "plain", train_on_inputs=True)[1] == [False, True, True, True, True]
    ids, mask = encode_example(rec, tok, "plain", system_prompt="S")
    hdr = [ord(c) for c in "<|system|>\n"], [ord(c) for c in "<|user|>\n"], [ord(c) for c in "<|assistant|>\n"]
    want = [BOS, *hdr[0], 83, 10, *hdr[1], 97, 10, 10, *hdr[2], 98, EOS]
    assert ids == want and mask == [False] * (len(want) - 2) + [True, True]


def test_chat_template_override_is_the_one_transformers_renders(tmp_path):
    from transformers import AutoTokenizer

    from shardtune.testing.smollm2 import cut_folder
    from shardtune.train.data.dataset import build_tokenizer

    folder = str(cut_folder(2))
    tpl = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "t.jinja").write_text(tpl)
    msgs = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    hf = AutoTokenizer.from_pretrained(folder)
    for spec in (tpl, str(tmp_path / "t.jinja")):
        tok = build_tokenizer(DataConfig(chat_template=spec), folder)
        ids, mask = encode_example({"messages": msgs}, tok, "auto")
        assert hf.decode(ids) == hf.apply_chat_template(msgs, chat_template=tpl, tokenize=False)
        assert hf.decode([i for i, m in zip(ids, mask) if m]) == "Paris.\n"  # "[assistant] " is the prompt
    with pytest.raises(UserError, match="needs the model folder's tokenizer"):
        build_tokenizer(DataConfig(chat_template=tpl, tokenizer="byte"), folder)
