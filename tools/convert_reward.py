"""Reward-model parts of tools/convert.py (docs/checkpoints.md#reward-models).

A reward model is transformers' <Family>ForSequenceClassification with num_labels 1
(models.bridge.reward_model): the trunk under the causal LM's names without `lm_head.weight`,
plus `score.weight` [1, h] and no bias. Its score of a sequence is score.weight . h_last, the
final-norm hidden state of the sequence's last token (transformers: the last non-pad token).
A checkpoint is a reward model's when its own config.json (models.bridge.checkpoint.source_dir)
is one (`is_reward_model_config`):
`hf-to-mcore` of such a folder and the engine's reward-model runs (engine.rm) write it so.

- `reward_folder_problem(hf_dir, cfg, reader, adapter)`: why hf-to-mcore refuses a
  sequence-classification folder (None: it converts);
- `reward_to_mcore(cfg, hf_dir, out)`: hf-to-mcore of such a folder (collective);
- `export_reward_lora(...)`: a LoRA reward model's checkpoint (adapters + the score head,
  trained in full) as peft writes a `task_type=SEQ_CLS, modules_to_save=["score"]` adapter,
  or with `--merge` the merged sequence-classification folder;
- `verify_scores(chunks, cfg, args)`: `verify` for a reward model: last-token scores of
  right-padded test sequences, half of them ending on the end-of-turn id, against
  transformers' AutoModelForSequenceClassification; and two chats rendered by --hf-dir's own
  `apply_chat_template` (as transformers' docs call a model) against the checkpoint's scores of
  their end-of-turn token (tools/convert_reward_template.py: the export's chat template).

The export's config.json (`export_config`), its scoring chat template and README, and
`pad_problem` (why an export would be scored at the wrong token; mcore-to-hf refuses it by
name) are engine.rm.export's, which a `checkpoint.save_hf` run of engine.rm writes too.
"""
from __future__ import annotations

from pathlib import Path

from models.bridge.critic import LM_HEAD, TrunkReader
from models.bridge.reward_model import (CLASSIFIER_SUFFIX, num_labels, reward_model_hf_config,
                                        reward_model_problem)
from engine.rm.export import end_of_turn_id, tokenizer_in
from tools.convert_reward_template import (chat_inputs, checkpoint_chat_scores,  # verify's chats
                                           report_chats)


def is_sequence_classifier(cfg: dict) -> bool:
    """Whether an HF config names a *ForSequenceClassification architecture (any labels)."""
    return any(a.endswith(CLASSIFIER_SUFFIX) for a in cfg.get("architectures") or [])


def trunk_reader(reader, cfg: dict) -> TrunkReader:
    """`reader` without the score head, as the bridge reads a causal LM (models.bridge.critic)."""
    return TrunkReader(reader, bool(cfg.get("tie_word_embeddings")))


def reward_folder_problem(hf_dir: str, cfg: dict, reader, adapter: str | None) -> str | None:
    """Why hf-to-mcore refuses the sequence-classification folder `hf_dir` (config `cfg`,
    tensors `reader`); None: it converts. Nothing it holds may be left behind."""
    labels = num_labels(cfg)
    if labels != 1:
        return (f"--hf-dir {hf_dir} is a sequence classifier with num_labels={labels} "
                f"(config.json's num_labels / id2label); only reward models (num_labels 1: "
                "one score per sequence) convert")
    problem = reward_model_problem(hf_dir)
    if problem:
        return f"--hf-dir {hf_dir} is not a reward model this engine converts: {problem}"
    if LM_HEAD in reader:
        return (f"--hf-dir {hf_dir} holds {LM_HEAD}, which transformers' "
                f"{cfg['architectures'][0]} does not have; the conversion would drop it")
    if adapter:
        return (f"--adapter {adapter}: hf-to-mcore reads adapters of causal LMs only, and "
                f"--hf-dir {hf_dir} is a reward model (*{CLASSIFIER_SUFFIX}); convert a "
                "merged model instead (mcore-to-hf --merge writes one)")
    return None


def reward_to_mcore(cfg: dict, hf_dir: str, out: Path) -> None:
    """Collective: a Megatron checkpoint of the reward model in `hf_dir` (trunk and score
    head), its hf_source/config.json the one-label sequence classifier's."""
    from models.bridge.checkpoint import model_sharded_state_dict, save_checkpoint
    from models.bridge.reward_model import load_reward_model
    from models.build.factory import build_model_chunks

    chunks = build_model_chunks(cfg)
    load_reward_model(chunks, hf_dir, cfg)
    save_checkpoint(model_sharded_state_dict(chunks), out, reward_model_hf_config(cfg), hf_dir)


def load_reward_lora(ckpt: Path, cfg: dict, spec, base: str) -> list:
    """Chunks (world 1) of a LoRA reward model: the base's trunk from `base` (a causal LM or
    a sequence classifier: its score row is not used), the adapters and the trained score
    head from `ckpt`."""
    from models.bridge.checkpoint import load_model
    from models.bridge.weights import load_hf_weights
    from models.build.factory import build_model_chunks
    from models.hf.io import SafetensorsReader
    from models.layers.heads.value import attach_value_heads

    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"the LoRA checkpoint's base model folder {base!r} is not readable; "
                         "pass --base HF_DIR")
    chunks = build_model_chunks(cfg, lora=spec)
    load_hf_weights(chunks, trunk_reader(SafetensorsReader(base), cfg), cfg)
    attach_value_heads(chunks, bias=False)
    load_model(chunks, ckpt)
    return chunks


def export_reward_lora(ckpt: Path, cfg: dict, found, out: Path, merge: bool, dtype,
                       write_hf) -> int:
    """A LoRA reward model's checkpoint as a peft adapter (task_type SEQ_CLS, the score head
    in modules_to_save: engine.checkpoint.hf_export.export_adapter_folder, which a
    checkpoint.save_hf run of engine.rm writes too), or with `merge` the merged
    sequence-classification model via `write_hf(tensors)`; returns the number of tensors
    written."""
    import torch

    from engine.checkpoint.hf_export import export_adapter_folder
    from models.bridge.reward_model import export_reward_model
    from models.lora.sites import merged_weight

    spec, base = found
    chunks = load_reward_lora(ckpt, cfg, spec, base)
    if merge:
        cast = (lambda t: t.to(getattr(torch, dtype))) if dtype else (lambda t: t)
        tensors = {n: cast(t).clone()
                   for n, t in export_reward_model(chunks, cfg, transform=merged_weight)}
        write_hf(tensors)
        return len(tensors)
    n = export_adapter_folder(chunks, cfg, spec, base, out, getattr(torch, dtype) if dtype
                              else None)
    print(f"[convert] peft loads it on the base as a one-label sequence classifier: "
          f"PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained("
          f"{str(base)!r}, num_labels=1), {str(out)!r})", flush=True)
    return n


def score_batch(cfg: dict, batch: int, seq_len: int, seed: int, eot: int | None = None):
    """(tokens [batch, seq_len], lengths [batch]) of `verify`'s test sequences: seeded ids
    that are never the pad id, lengths seq_len, seq_len - 3, ... (at least 2), right-padded
    with pad_token_id (0 without one), so transformers' last-non-pad rule is exercised. With
    `eot` (the end-of-turn id the model scores, `end_of_turn_id`), every even row ends on it,
    as RL's stopped responses and engine.rm's sides do (a pad id equal to it then shows)."""
    import torch

    pad = cfg.get("pad_token_id")
    pad = 0 if pad is None else int(pad)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab_size"] - 1, (batch, seq_len), generator=gen)
    tokens = tokens + (tokens >= pad).long()          # every id but the pad id
    lengths = torch.tensor([max(seq_len - 3 * i, 2) for i in range(batch)])
    if eot is not None:
        rows = torch.arange(0, batch, 2)
        tokens[rows, lengths[rows] - 1] = int(eot)
    tokens[torch.arange(seq_len).unsqueeze(0) >= lengths.unsqueeze(1)] = pad
    return tokens, lengths


def hf_scores(hf_dir: str, tokens, lengths, dtype, chats: list[list[int]] = ()):
    """transformers' AutoModelForSequenceClassification scores [b] (float32) of the
    right-padded `tokens`: one padded batch when the config has a pad_token_id, else one
    unpadded sequence at a time (transformers scores no batch of several without it); and
    [len(chats)] of the id lists `chats`, one at a time. Returns (scores, chat scores, the
    model's class name)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=dtype).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf.to(device)
    with torch.no_grad():
        if hf.config.pad_token_id is not None:
            scores = hf(tokens.to(device)).logits[:, 0]
        else:
            scores = torch.cat([hf(tokens[i:i + 1, :int(n)].to(device)).logits[:, 0]
                                for i, n in enumerate(lengths)])
        chat = [hf(torch.tensor([ids], device=device)).logits[0, 0] for ids in chats]
    chat = torch.stack(chat).float().cpu() if chat else torch.zeros(0)
    return scores.float().cpu(), chat, type(hf).__name__


def verify_scores(chunks: list, cfg: dict, args) -> bool:
    """Collective: the checkpoint's last-token scores (models.build.forward.forward_values) of
    score_batch's sequences against transformers' scores of --hf-dir; rank 0 prints
    max_abs_diff and returns whether it is within the tolerance (fp32 default: 1e-4 x
    max(1, max |score|); bf16: 3e-2 x max |score|), for those and for the chats of
    convert_reward_template.chat_inputs (transformers on --hf-dir's apply_chat_template ids,
    the checkpoint on the ids the engine scores)."""
    import torch
    import torch.distributed as dist

    from models.build.forward import forward_values
    from models.hf.io import read_config

    tokenizer = tokenizer_in(Path(args.hf_dir))
    eot = end_of_turn_id(tokenizer) if tokenizer is not None else None
    tokens, lengths = score_batch(cfg, args.batch, args.seq_len, args.seed, eot)
    values = forward_values(chunks, tokens).float().cpu()
    scores = values[torch.arange(len(lengths)), lengths - 1]
    engine_ids, called_ids = chat_inputs(tokenizer) if tokenizer is not None else ([], [])
    chat_scores = checkpoint_chat_scores(chunks, engine_ids)
    if dist.get_rank() != 0:
        return True
    if not is_sequence_classifier(read_config(args.hf_dir)):
        print(f"verify: FAILED (--hf-dir {args.hf_dir} is not a *{CLASSIFIER_SUFFIX} folder; "
              "the checkpoint is a reward model)")
        return False
    ref, chat_ref, name = hf_scores(args.hf_dir, tokens, lengths, getattr(torch, args.dtype),
                                    called_ids)
    diff = (scores - ref).abs().max().item()
    scale = ref.abs().max().item()
    tolerance = args.tolerance if args.tolerance is not None else (
        1e-4 * max(1.0, scale) if args.dtype == "float32" else 3e-2 * scale)
    ends = f", even rows ending on the end-of-turn id {eot}" if eot is not None else ""
    print(f"reference: transformers {name} (last-token scores, lengths {lengths.tolist()}"
          f"{ends})")
    print(f"layout tp={args.tp} pp={args.pp} ep={args.ep} dtype={args.dtype} "
          f"max_abs_diff={diff:.3e} (max |score| {scale:.3e})")
    ok = diff <= tolerance
    ok = report_chats(engine_ids, called_ids, chat_scores, chat_ref, tolerance,
                      tokenizer.chat_template if tokenizer is not None else None) and ok
    print("verify: OK" if ok else f"verify: FAILED (tolerance {tolerance:.3e})")
    return ok
