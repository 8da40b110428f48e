"""`python -m tools.bench spec`'s report names the model it measured truthfully (issue 76): with
--quick it built a tiny model in a temporary folder it deletes, so it says so instead of
printing that folder's path; with --model-dir it names the folder. The engines are replaced by
a stand-in (the vLLM runs are the GPU benchmark's and docs/benchmarks.md's), in-process."""
from __future__ import annotations

import json
import os
import re

from tools.bench import spec


def _fake_run(monkeypatch) -> list[str]:
    measured: list[str] = []

    def tiny(out_dir: str) -> str:
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"vocab_size": 200}, f)
        return out_dir

    def measure(model_dir, config, prompts, new, reps):
        assert os.path.isdir(model_dir)   # the model exists while it is measured
        measured.append(model_dir)
        counters = {"drafts": 4.0, "proposed": 8.0, "accepted": 2.0, "enabled": 1.0} \
            if config.method else {}
        return {"load_s": 1.0, "tokens_per_s": 100.0 if config.method else 80.0, "tokens": 64,
                "counters": counters, "greedy": [[1, 2]]}

    monkeypatch.setattr(spec, "tiny_mtp_model", tiny)
    monkeypatch.setattr(spec, "_measure", measure)
    return measured


def test_quick_says_its_model_was_temporary_instead_of_printing_a_deleted_folder(monkeypatch):
    measured = _fake_run(monkeypatch)
    result = spec.run_spec(quick=True)
    (note,) = result.tables[0].notes
    assert len(measured) == 2 and not os.path.exists(measured[0])   # deleted after the run
    assert measured[0] not in note and not re.search(r"/tmp\w*/", note), note
    assert note.endswith("model: a tiny random GLM-4.5 MoE with an MTP layer (--quick; built "
                         "in a temporary folder, deleted after the run)"), note
    assert note.startswith("speedup 1.250x; greedy ids equal both ways: True")


def test_a_given_model_folder_is_named(monkeypatch, tmp_path):
    measured = _fake_run(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 200}))
    (note,) = spec.run_spec(quick=True, model_dir=str(tmp_path)).tables[0].notes
    assert measured == [str(tmp_path)] * 2 and note.endswith(f"model: {tmp_path}")


def test_demo_model_mtp_writes_a_glm_with_its_mtp_layer(tmp_path):
    """`demo model DIR --mtp` (docs/mtp.md's CPU example): a tiny GLM-4.5 MoE whose config
    declares one MTP layer and whose weights hold it (model.layers.2.*, after 2 trunk layers),
    with the word-level tokenizer. Without --mtp the folder is the plain Qwen3 (control)."""
    from safetensors import safe_open

    from tools import demo

    def layout(path):
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        return config, names

    assert demo.main(["model", str(tmp_path / "mtp"), "--mtp"]) == 0
    config, names = layout(tmp_path / "mtp")
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
            "model.layers.2.shared_head.head.weight"} <= set(names)
    assert (tmp_path / "mtp" / "tokenizer.json").exists()
    assert demo.main(["model", str(tmp_path / "plain")]) == 0
    config, names = layout(tmp_path / "plain")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert not any(n.startswith("model.layers.2.") for n in names)
