"""Train / validation / test splits of every task: disjoint by the stable hash of the partition key whatever
the seed, coding split by gold function, long-horizon's held-out prompts, cluster keys and the clustered SE,
the JSONL validation file and the `eval.split` knob."""
import json
import warnings

import pytest

from trace.tasks import Example, get_task, task_names
from trace.tasks.base import SPLITS

KNOBS = {"reasoning": {}, "reasoning-short": {}, "coding": {}, "program": {}, "long_horizon": {"offset_max": 992}}


def _draw(task, split, seeds, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small spaces repeat (with a warning) to reach n
        return [e for s in seeds for e in task.make_split(split, n, seed=s)]


@pytest.mark.parametrize("name", sorted(KNOBS))
@pytest.mark.parametrize("difficulty", ["easy", "medium"])
def test_splits_disjoint_for_every_task(name, difficulty):
    assert set(KNOBS) == set(task_names())
    t = get_task(name, difficulty=difficulty, **KNOBS[name])
    keys = {split: {t.partition_key(e) for e in _draw(t, split, range(3), 120)} for split in SPLITS}
    assert all(keys.values()), keys
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    for split in SPLITS:  # the split follows from the example alone
        assert all(t.split_of(e) == split for e in _draw(t, split, [5], 20))


def test_shares_follow_the_fractions():
    t = get_task("reasoning", difficulty="medium")
    assert (t.test_fraction, t.val_fraction) == (0.2, 0.1)
    exs = [t._generate(__import__("random").Random(i)) for i in range(3000)]
    share = {s: sum(t.split_of(e) == s for e in exs) / len(exs) for s in SPLITS}
    assert share["test"] == pytest.approx(0.2, abs=0.03) and share["validation"] == pytest.approx(0.1, abs=0.03)
    # the test split does not depend on val_fraction; validation examples go back to train without it
    t0 = get_task("reasoning", difficulty="medium", val_fraction=0.0)
    assert all((t0.split_of(e) == "test") == (t.split_of(e) == "test") for e in exs)
    assert {t0.split_of(e) for e in exs if t.split_of(e) == "validation"} == {"train"}
    with pytest.raises(ValueError, match="val_fraction"):
        get_task("coding", val_fraction=0.8)
    with pytest.raises(ValueError, match="held-out split"):
        t.heldout(4, seed=0, split="train")


def test_coding_test_functions_never_in_train():
    t = get_task("coding", difficulty="easy")
    fn = {s: {t.partition_key(e) for e in _draw(t, s, range(4), 300)} for s in SPLITS}
    assert fn["test"] and fn["validation"] and not fn["test"] & fn["train"] and not fn["validation"] & fn["train"]
    # the key is the function, not its written form: (2*x+6)%5 and (2*x+1)%5 are one function
    from trace.tasks.coding import function_key
    assert function_key("(2*x+6)%5") == function_key("(2*x+1)%5") != function_key("(2*x+2)%5")
    gold = {s: {e.meta["gold"] for e in _draw(t, s, range(4), 300)} for s in SPLITS}
    assert not gold["test"] & gold["train"]
    # one function's prompts (different shown inputs) are one cluster
    held = t.heldout(200, seed=0)
    assert len({e.prompt for e in held}) > len({t.cluster_key(e) for e in held}) > 1


def test_long_horizon_has_at_least_100_distinct_test_prompts():
    """Three-digit ranges (offset_max 992): with n_test 256 the held-out set holds 150+ distinct prompts, and a
    prompt's secrets share one cluster (the prompt text)."""
    t = get_task("long_horizon", difficulty="easy", offset_max=992)
    held = t.heldout(256, seed=0)
    prompts = {e.prompt for e in held}
    assert len(held) == 256 and len(prompts) >= 100
    assert {t.cluster_key(e) for e in held} == prompts
    assert len(prompts & {e.prompt for e in t.heldout(256, seed=0, split="validation")}) == 0
    for e in held[:20]:  # three-digit guesses: the gold transcript still wins within the tries
        text, mask = t.sft_target_and_mask(e)
        guesses = [line.lstrip(">") for line in text.split("\n")[0::2] if line]
        assert t.score(e, text) == 1.0 and all(len(g) <= 3 for g in guesses)  # "999\n": 4 tokens a turn
    # the presets' two-digit space is small: that is why the knob exists
    assert len({e.prompt for e in get_task("long_horizon", difficulty="easy", offset_max=92).heldout(256, 0)}) < 100


def test_validation_heldout_is_deterministic_and_unique():
    for name in sorted(KNOBS):
        t = get_task(name, difficulty="easy", **KNOBS[name])
        v = t.heldout(64, seed=0, split="validation")
        assert v == t.heldout(64, seed=0, split="validation") and v
        assert len({t.unique_key(e) for e in v}) == len(v)
        assert {t.split_of(e) for e in v} == {"validation"}


def test_jsonl_validation_file(tmp_path):
    from trace import config as C
    from trace.episode import build_task, heldout_examples

    rows = [json.dumps({"prompt": f"Q: {i}+1=\nA:", "label": i + 1}) for i in (1, 2, 2, 3)]
    p = tmp_path / "val.jsonl"
    p.write_text("\n".join(rows) + "\n")
    cfg = C.load_config(None, ["task.name=reasoning-short", f"task.validation_jsonl={p}", "eval.split=validation"])
    task = build_task(cfg)
    assert [e.label for e in task.make_split("validation", 10, seed=0)] == ["2", "3", "3", "4"]
    assert [e.label for e in heldout_examples(cfg, task)] == ["2", "3", "4"]  # each prompt once
    gen = get_task("reasoning-short", difficulty="easy")
    assert heldout_examples(C.load_config(None, ["task.name=reasoning-short", f"task.validation_jsonl={p}"]),
                           task) == gen.heldout(128, seed=0)  # eval.split defaults to test: generated


def test_eval_split_knob():
    from trace import config as C
    from trace.episode import eval_settings, heldout_examples

    base = ["task.name=reasoning", "task.difficulty=medium", "task.n_test=32"]
    test_cfg, val_cfg = C.load_config(None, base), C.load_config(None, base + ["eval.split=validation"])
    assert test_cfg["eval"]["split"] == "test" and eval_settings(test_cfg)["split"] == "test"  # the default
    assert eval_settings(val_cfg)["split"] == "validation"
    task = get_task("reasoning", difficulty="medium")
    val, test = heldout_examples(val_cfg, task), heldout_examples(test_cfg, task)
    assert len(val) == len(test) == 32 and not {e.prompt for e in val} & {e.prompt for e in test}
    assert {task.split_of(e) for e in val} == {"validation"}
    with pytest.raises(C.ConfigError, match="eval.split"):
        C.load_config(None, ["eval.split=train"])
    assert C.load_config(None, ["task.name=reasoning-short"])["task"]["name"] == "reasoning-short"


def test_clustered_se():
    from trace.episode import cluster_ids, clustered_se

    p = [0.0, 0.5, 1.0, 1.0]
    # one example per cluster: sd / sqrt(n), as before clusters existed
    assert clustered_se(p) == pytest.approx(0.47871 / 2, rel=1e-4)
    assert clustered_se(p, [0, 1, 2, 3]) == pytest.approx(clustered_se(p))
    # equal clusters: the SE of the cluster means
    assert clustered_se(p, [0, 0, 1, 1]) == pytest.approx(clustered_se([0.25, 1.0]))
    # correlated examples in a cluster: larger than treating them as independent
    q = [0.0, 0.0, 1.0, 1.0, 0.5, 0.5]
    assert clustered_se(q, [0, 0, 1, 1, 2, 2]) > clustered_se(q)
    assert clustered_se(p, [0, 0, 0, 0]) != clustered_se(p, [0, 0, 0, 0])  # NaN: one cluster
    with pytest.raises(ValueError, match="cluster ids"):
        clustered_se(p, [0, 1])
    t = get_task("long_horizon", difficulty="easy")
    exs = [Example(f"Guess n in {lo}..{lo + 6}, 4 tries\n>", json.dumps(
        {"secret": lo + s, "lo": lo, "hi": lo + 6, "max_turns": 4}), "long_horizon") for lo, s in
        ((3, 0), (5, 1), (3, 2), (9, 0), (5, 5))]
    assert cluster_ids(t, exs) == [0, 1, 0, 2, 1]
