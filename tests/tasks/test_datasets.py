"""JSONL loaders: round trip, key mapping, and errors that name the file and line."""
import json

import pytest

from trace.tasks import get_task
from trace.tasks.datasets import DatasetError, load_jsonl, save_jsonl


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p


def test_round_trip_of_generated_split(tmp_path):
    exs = get_task("coding", difficulty="easy").make_split("test", 20, seed=0)
    p = tmp_path / "c.jsonl"
    assert save_jsonl(p, exs) == 20
    assert load_jsonl(p) == exs


def test_custom_keys_numeric_label_meta_and_blank_lines(tmp_path):
    p = write(tmp_path, [
        json.dumps({"question": "Q: 1+1=\nA:", "answer": 2, "src": "reasoning", "level": 3}),
        "",
        json.dumps({"question": "Q: 2+2=\nA:", "answer": "4", "src": "reasoning"}),
    ])
    exs = load_jsonl(p, prompt_key="question", label_key="answer", datasource_key="src")
    assert [(e.prompt, e.label, e.datasource) for e in exs] == [("Q: 1+1=\nA:", "2", "reasoning"),
                                                                ("Q: 2+2=\nA:", "4", "reasoning")]
    assert exs[0].meta == {"level": 3} and exs[1].meta == {}
    assert load_jsonl(p, "question", "answer", "src", meta_keys=[])[0].meta == {}


def test_default_datasource(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": "p", "label": "l"})])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: missing key 'datasource'"):
        load_jsonl(p)
    assert load_jsonl(p, default_datasource="math")[0].datasource == "math"


@pytest.mark.parametrize("bad,match", [
    ('{"prompt": "p", "label": "l", "datasource": "x"', r":3: invalid JSON"),
    ('[1, 2]', r":3: expected a JSON object, got list"),
    ('{"label": "l", "datasource": "x"}', r":3: missing key 'prompt'"),
    ('{"prompt": "p", "datasource": "x"}', r":3: missing key 'label'"),
    ('{"prompt": 5, "label": "l", "datasource": "x"}', r":3: 'prompt' must be a string"),
    ('{"prompt": "p", "label": null, "datasource": "x"}', r":3: 'label' must be a string or number"),
    ('{"prompt": "p", "label": "l", "datasource": 1}', r":3: 'datasource' must be a string"),
])
def test_errors_name_the_line(tmp_path, bad, match):
    good = json.dumps({"prompt": "p", "label": "l", "datasource": "x"})
    p = write(tmp_path, [good, good, bad, good])
    with pytest.raises(DatasetError, match=match):
        load_jsonl(p)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_error_column_is_the_column_within_the_line(tmp_path):
    good = json.dumps({"prompt": "p", "label": "l", "datasource": "x"})
    bad = '{"prompt": "What is the sum of 17 and 25?", "label": 42, datasource: "x"}'
    col = bad.index("datasource") + 1  # 1-based column of the unquoted key
    assert col > 1
    p = write(tmp_path, [good, bad])
    with pytest.raises(DatasetError, match=rf"d\.jsonl:2: invalid JSON \(.* at column {col}\)"):
        load_jsonl(p)


def test_byte_order_mark_is_not_a_fault(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "p", "label": "l"}).encode() + b"\n")
    assert load_jsonl(p, default_datasource="math")[0].prompt == "p"


def test_config_jsonl_replaces_the_generated_splits(tmp_path):
    from trace import config as C
    from trace.episode import build_task
    rows = [json.dumps({"question": f"Q: {i}+1=\nA:", "answer": i + 1}) for i in range(5)]
    p = write(tmp_path, rows, name="train.jsonl")
    cfg = C.load_config(None, [f"task.train_jsonl={p}", "task.prompt_key=question", "task.label_key=answer"])
    task = build_task(cfg)
    train = task.make_split("train", 3, seed=0)
    assert [(e.prompt, e.label, e.datasource) for e in train] == [(f"Q: {i}+1=\nA:", str(i + 1), "reasoning-short")
                                                                  for i in range(3)]
    assert len(task.make_split("train", 100, seed=0)) == 5  # the file's examples, no repeats
    gen = get_task("reasoning-short", difficulty="easy")
    assert task.make_split("test", 4, seed=0) == gen.make_split("test", 4, seed=0)  # no test file: generated
    assert task.score(train[0], task._gold_response(train[0])) == 1.0  # scoring is the task's
