"""Unpaired preference data for KTO (engine.data.preference_unpaired*): both TRL formats render
as SFT renders prompt + completion, the dataset's labels and prompt lengths, every refusal named
by file and line, truncation; and the mismatched (KL) sequences of a batch
(engine.kto.training.kl_sequences: TRL's shift of the completions by one). Single process,
rendering in process."""
from __future__ import annotations

import json

import pytest

from engine.data.datasets import render_sft_row
from engine.data.files import DataError
from engine.data.preference_unpaired import render_unpaired_row
from engine.data.preference_unpaired_dataset import load_unpaired_dataset
from tools.char_tokenizer import build_char_tokenizer

USER = {"role": "user", "content": "Sky colour?"}
BLUE = {"role": "assistant", "content": "It is blue."}
CONVERSATIONAL = {"prompt": [USER], "completion": [BLUE], "label": True}
TEXT = {"prompt": "Sky colour?", "completion": "Green.", "label": False}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(None, "qwen3")


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_both_formats_render_as_sft_and_load(tok, tmp_path):
    """A row's (ids, trained) are render_sft_row of prompt + completion; the dataset keeps the
    labels, the prompt lengths (the first trained label at prompt_length - 1) and counts."""
    conv = render_unpaired_row(CONVERSATIONAL, tok, "x:1")
    ids, trained = render_sft_row({"messages": [USER, BLUE]}, tok, "x:1")
    assert conv.side.ids == list(ids) and list(conv.side.trained) == list(trained)
    assert conv.label is True and conv.form == "conversational"
    assert conv.prompt_length == int(list(trained).index(1))
    text = render_unpaired_row(TEXT, tok, "x:2")
    assert text.label is False and text.form == "text"
    path = write_jsonl(tmp_path / "kto.jsonl", [CONVERSATIONAL, TEXT])
    ds = load_unpaired_dataset(path, tok, 256, cache_dir=str(tmp_path / "cache"), num_workers=0)
    assert len(ds) == 2 and list(ds.labels) == [1, 0]
    assert ds.stats["desirable"] == 1 and ds.stats["undesirable"] == 1
    first = ds[0]
    assert first.sample.loss_mask.index(1) == first.prompt_length - 1
    assert first.sample.tokens + [first.sample.labels[-1]] == conv.side.ids
    assert "2 unpaired examples (1 desirable, 1 undesirable" in ds.describe()


REFUSALS = [
    ({"prompt": "hi", "completion": "yes"}, "missing field 'label'"),
    ({"prompt": "hi", "completion": "yes", "label": 1}, "field 'label' must be a boolean"),
    ({"prompt": "hi", "completion": "yes", "label": "true"}, "field 'label' must be a boolean"),
    ({"prompt": "hi", "completion": "  ", "label": True}, "field 'completion' is empty"),
    ({"prompt": [USER], "completion": [], "label": True}, "'completion' is an empty list"),
    ({"prompt": [USER], "completion": [{"role": "assistant", "content": ""}], "label": False},
     "empty reply"),
    ({"prompt": [USER], "completion": [USER], "label": False}, "no assistant message"),
    ({"completion": "yes", "label": True}, "missing field 'prompt'"),
    ({"prompt": "hi", "label": True}, "missing field 'completion'"),
    ({"prompt": "hi", "chosen": "a", "rejected": "b"}, "a paired row"),
    ({"prompt": "hi", "completion": [BLUE], "label": True}, "both must be strings or both"),
]


@pytest.mark.parametrize("row,message", REFUSALS)
def test_refusals_name_file_and_line(tok, tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [CONVERSATIONAL, row])
    with pytest.raises(DataError) as e:
        load_unpaired_dataset(path, tok, 256, cache_dir=str(tmp_path / "c"), num_workers=0)
    assert str(e.value).startswith(f"{path}:2: "), str(e.value)
    assert message in str(e.value), str(e.value)


def test_truncation_keeps_the_prompt_or_refuses(tok, tmp_path):
    long = {"prompt": "Sky colour?", "completion": "It is blue, " * 20, "label": True}
    path = write_jsonl(tmp_path / "long.jsonl", [long])
    full = render_unpaired_row(long, tok, "x:1")
    ds = load_unpaired_dataset(path, tok, 40, cache_dir=str(tmp_path / "c"), num_workers=0)
    assert ds.stats["truncated"] == 1 and len(ds[0].sample.tokens) == 40
    assert ds[0].prompt_length == full.prompt_length
    with pytest.raises(DataError, match=f"{path}:1: .*data.truncation=error"):
        load_unpaired_dataset(path, tok, 40, "error", cache_dir=str(tmp_path / "c"),
                              num_workers=0)
    with pytest.raises(DataError, match=f"{path}:1: the prompt renders to"):
        load_unpaired_dataset(path, tok, full.prompt_length - 1, cache_dir=str(tmp_path / "c"),
                              num_workers=0)


def test_kl_sequences_shift_completions_by_one():
    """Example i's prompt with example i-1's completion (example 0 with the last one's), the
    completion's trained flags kept, cut to seq_length + 1 ids."""
    from engine.data.datasets import Sample
    from engine.data.preference_unpaired_dataset import UnpairedExample
    from engine.kto.training import kl_sequences

    def example(prompt, completion, trained):
        ids = prompt + completion
        mask = [0] * len(prompt) + trained
        return UnpairedExample(Sample(ids[:-1], ids[1:], mask[1:]), len(prompt), True)

    batch = [example([1, 2], [10, 11, 12], [1, 1, 0]), example([3], [20], [1]),
             example([4, 5, 6], [30, 31], [1, 1])]
    seqs = kl_sequences(batch, 64)
    wanted = [([1, 2, 30, 31], [0, 0, 1, 1]), ([3, 10, 11, 12], [0, 1, 1, 0]),
              ([4, 5, 6, 20], [0, 0, 0, 1])]
    for s, (ids, trained) in zip(seqs, wanted):
        assert s.tokens + s.labels[-1:] == ids and s.loss_mask == trained[1:]
    cut = kl_sequences(batch, 2)[1]   # 3 ids allowed
    assert cut.tokens + cut.labels[-1:] == [3, 10, 11] and cut.loss_mask == [1, 1]
