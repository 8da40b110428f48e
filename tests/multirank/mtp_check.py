"""MTP checks on the rank pool (launched by tests/test_mtp.py).

`reference_parity(model_dir, detach)` (one rank): one SFT step of the engine with the MTP
layer trained (engine.training.mtp) against a plain PyTorch loop written from DeepSeek-V3's
formula on transformers' own modules and the same weights: the trunk's final normed hidden
state h_t and the embedding of token t+1, each RMS-normed, concatenated [e; h], projected by
eh_proj, one decoder layer (transformers' own layer of the family, GLM-4.5 or DeepSeek-V3 with
the weights of index N, run as a one-layer model whose final norm is shared_head.norm; Qwen3.5's
full-attention layer with mtp.layers.0's weights and mtp.norm, its norms zero-centred: `_layout`),
the model's lm_head; the loss is main + scale x MTP, both
weighted by the token-mean weights 1/N_tokens, the MTP term on the targets labels[t+1] where
loss_mask[t+1]. Compared: loss, mtp/loss, mtp/accuracy, grad norm (all parameters, the shared
embedding and head once; detached: the trunk's only, engine.training.mtp). Negative controls on the reference side: the trunk's hidden state
before the final norm, [h; e] instead of [e; h], and (Qwen3.5) enorm / hnorm as plain RMSNorms.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

SCALE = 0.3


def _batch(vocab: int):
    from engine.training.micro_batches import SequenceData

    gen = torch.Generator().manual_seed(5)
    seqs = []
    for n, start in ((12, 3), (9, 0), (15, 14), (7, 2)):
        ids = torch.randint(4, vocab, (n + 1,), generator=gen).tolist()
        mask = [0] * start + [1] * (n - start)
        seqs.append(SequenceData(ids[:-1], ids[1:], mask))
    return seqs


def _layout(hf) -> dict:
    """How the checkpoint stores its MTP layer, written from the published layouts: DeepSeek-V3's
    (GLM-4.5, DeepSeek-V3: decoder layer N under model.layers.N with enorm, hnorm, eh_proj,
    shared_head.norm; plain RMSNorms) or Qwen3.5's (vLLM's qwen3_5_mtp: mtp.layers.0, mtp.fc,
    mtp.pre_fc_norm_embedding / _hidden, mtp.norm; zero-centred norms y = norm(x) * (1 + w),
    `offset` 1)."""
    layer = _text_config(hf).num_hidden_layers
    if _text_config(hf).model_type.startswith("qwen3_5"):
        return dict(prefix="mtp.layers.0.", offset=1.0, one_layer=dict(
            num_hidden_layers=1, layer_types=["full_attention"]),
            own={"enorm": "mtp.pre_fc_norm_embedding.weight",
                 "hnorm": "mtp.pre_fc_norm_hidden.weight", "eh_proj": "mtp.fc.weight"},
            norm="mtp.norm.weight")
    prefix = f"model.layers.{layer}."
    return dict(prefix=prefix, offset=0.0, one_layer=dict(
        num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0),
        own={k: prefix + k + ".weight" for k in ("enorm", "hnorm", "eh_proj")},
        norm=prefix + "shared_head.norm.weight")


def _mtp_model(model_dir: str, hf, layout: dict):
    """transformers' one-layer model of the family holding the MTP layer's decoder layer (as
    layer 0: a MoE layer, Qwen3.5's full-attention layer) and the MTP final norm as its final
    norm (saved and loaded through from_pretrained, so transformers converts the experts as for
    any checkpoint), and the MTP layer's own enorm, hnorm, eh_proj as parameters."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    text = "model.language_model." if _is_wrapper(hf) else "model."
    prefix = layout["prefix"]
    own_names = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    state = {"model.layers.0." + k[len(prefix):]: v for k, v in tensors.items()
             if k.startswith(prefix) and not k[len(prefix):].startswith(own_names)}
    state["model.norm.weight"] = tensors[layout["norm"]]
    state["model.embed_tokens.weight"] = tensors[text + "embed_tokens.weight"]
    state["lm_head.weight"] = tensors["lm_head.weight"]
    config = _text_config(hf).to_dict()
    config.update(layout["one_layer"])
    with tempfile.TemporaryDirectory() as tmp:
        _text_config(hf).__class__(**config).save_pretrained(tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).model
    own = {k: torch.nn.Parameter(tensors[name].float().clone())
           for k, name in layout["own"].items()}
    return model, own


def _is_wrapper(hf) -> bool:
    """A conditional-generation model (Qwen3.5 as published: text model + vision tower)."""
    return hasattr(hf.config, "text_config")


def _text_config(hf):
    return hf.config.text_config if _is_wrapper(hf) else hf.config


def _load(model_dir: str):
    """transformers' model of the folder, fp32 (a wrapper's vision tower frozen, as the engine
    keeps it by default), its text trunk (the module whose output is the final normed state)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    wrapper = hasattr(AutoConfig.from_pretrained(model_dir), "text_config")
    hf = (AutoModelForImageTextToText if wrapper else AutoModelForCausalLM).from_pretrained(
        model_dir, dtype=torch.float32)
    if wrapper:
        hf.model.visual.requires_grad_(False)
    return hf, (hf.model.language_model if wrapper else hf.model)


def _trunk_pass(hf, trunk, s):
    """(the trunk's output with hidden states, the MTP layer's position ids of positions
    0 .. n-2) for sequence `s`: with images through the wrapper (pixels, grids) and its M-RoPE
    positions from transformers' own get_rope_index ([3, 1, n-1]), else through `trunk` (the
    text model, `_load`) with [1, n-1] 0 .. n-2."""
    tokens = torch.tensor([s.tokens])
    n = len(s.tokens)
    vision = getattr(s, "vision", None)
    if vision is None:
        return trunk(tokens, output_hidden_states=True), torch.arange(n - 1)[None]
    images = vision.images
    image = hf.config.image_token_id
    kinds = (tokens == image).int()   # mm_token_type_ids: 1 at image placeholders
    out = hf.model(tokens, pixel_values=images.pixel_values, image_grid_thw=images.grid_thw,
                   mm_token_type_ids=kinds, output_hidden_states=True)
    positions, _ = hf.model.get_rope_index(tokens, kinds, image_grid_thw=images.grid_thw)
    return out, positions[:, :, :n - 1]


def _rms(x, w, eps, offset=0.0):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)) * (offset + w)


def _reference(model_dir: str, seqs, detach: bool, variant: str = "") -> dict:
    """{"loss", "mtp_loss", "mtp_accuracy", "grad_norm"} of the plain loop (module docstring)."""
    hf, trunk = _load(model_dir)
    layout = _layout(hf)
    mtp, own = _mtp_model(model_dir, hf, layout)
    eps, offset = _text_config(hf).rms_norm_eps, layout["offset"]
    if variant == "plainnorm":   # control: enorm / hnorm as plain RMSNorms (w, not 1 + w)
        offset = 0.0
    total_tokens = sum(sum(s.loss_mask) for s in seqs)
    w = 1.0 / total_tokens
    main, extra, right, targets = 0.0, 0.0, 0, 0
    embed, head = trunk.embed_tokens.weight, hf.lm_head.weight
    for s in seqs:
        tokens = torch.tensor([s.tokens])
        out, positions = _trunk_pass(hf, trunk, s)
        logits = hf.lm_head(out.last_hidden_state).float()
        nll = -torch.log_softmax(logits[0], -1).gather(1, torch.tensor(s.labels)[:, None])[:, 0]
        main = main + (nll * torch.tensor(s.loss_mask, dtype=torch.float32)).sum() * w
        n = len(s.tokens)
        h = out.hidden_states[-2] if variant == "prenorm" else out.last_hidden_state
        h = h[0, :n - 1]
        e_w, head_w = (embed.detach(), head.detach()) if detach else (embed, head)
        if detach:
            h = h.detach()
        e = torch.nn.functional.embedding(tokens[0, 1:], e_w)
        parts = [_rms(e, own["enorm"], eps, offset), _rms(h, own["hnorm"], eps, offset)]
        if variant == "swapped":
            parts.reverse()
        u = torch.nn.functional.linear(torch.cat(parts, -1), own["eh_proj"])
        if variant == "textpos":   # control: 1-D positions where the trunk used M-RoPE's
            positions = torch.arange(n - 1)[None]
        g = mtp(inputs_embeds=u[None], position_ids=positions).last_hidden_state
        z = torch.nn.functional.linear(g[0], head_w).float()
        labels = torch.tensor(s.labels[1:])
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        logp = torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0]
        extra = extra + -(logp * mask).sum() * w
        right += int(((z.argmax(-1) == labels).float() * mask).sum())
        targets += int(mask.sum())
    (main + SCALE * extra).backward()
    # detached: the MTP layer is left out of the grad norm; a frozen vision tower always is
    params = [p for p in hf.parameters() if p.requires_grad]
    if not detach:
        params += list(mtp.layers.parameters()) + [mtp.norm.weight] + list(own.values())
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
    return {"loss": float(main), "mtp_loss": float(extra), "mtp_accuracy": right / targets,
            "grad_norm": float(norm)}


def reference_parity(model_dir: str, detach: bool = False) -> dict:
    """{"ours": engine metrics, "ref": the plain loop's, "prenorm"/"swapped" (and "plainnorm"
    for zero-centred families): the controls'}."""
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.mtp import MTPTraining
    from engine.training.train_engine import TrainEngine
    from models.hf.io import read_config
    from models.vision.spec import vision_spec
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel
    from tests.multirank.vision_batches import vision_batches

    cfg = read_config(model_dir)
    images = vision_spec(cfg) is not None
    # images of up to 16 tokens: M-RoPE positions then differ from 1-D ones by up to 12 across
    # an image (the `textpos` control; with 1-4 token images it moved mtp/loss by only 5e-6)
    seqs = vision_batches(cfg, 1, 6, sides=(4, 8))[0] if images else _batch(cfg["vocab_size"])
    setup_model_parallel(ParallelLayout(1))
    optim = SimpleNamespace(lr=1e-3, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=0.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=True)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    engine = TrainEngine.build(cfg, optim, torch.float32, 1, train, weights_dir=model_dir,
                               loss_chunk_tokens=8, mtp=MTPTraining(SCALE, detach))
    m = train_step(engine, seqs, GlobalLossNormalizer("token-mean"))
    engine.release()
    ours = {"loss": m["loss"], "mtp_loss": m["mtp/loss"], "mtp_accuracy": m["mtp/accuracy"],
            "grad_norm": m["grad_norm"]}
    controls = ("prenorm", "swapped") + (("plainnorm",) if _zero_centred(model_dir) else ()) \
        + (("textpos",) if images else ())
    return {"ours": ours, "ref": _reference(model_dir, seqs, detach),
            **{c: _reference(model_dir, seqs, detach, c) for c in controls}}


def _zero_centred(model_dir: str) -> bool:
    """Whether the family's MTP norms are zero-centred (Qwen3.5: the `plainnorm` control)."""
    from models.hf.io import read_config
    return read_config(model_dir)["model_type"].startswith("qwen3_5")


def trunk_gradients(model_dir: str) -> dict:
    """Max relative difference of every non-MTP parameter's gradient (main_grad after one
    step) between a run without the MTP layer and runs with it: detached (RL's setting: must be
    0 up to float rounding of the same sums) and not detached (control); and the three grad
    norms (detached: the MTP layer is left out, so it equals the run without MTP)."""
    from engine.sft.training import train_step
    from engine.training.loss import GlobalLossNormalizer
    from engine.training.mtp import MTPTraining
    from engine.training.train_engine import TrainEngine
    from parallel.wrappers import unwrap
    from models.hf.io import read_config
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    cfg = read_config(model_dir)
    seqs = _batch(cfg["vocab_size"])
    setup_model_parallel(ParallelLayout(1))
    optim = SimpleNamespace(lr=0.0, min_lr=0.0, warmup_steps=0, weight_decay=0.0,
                            clip_grad=1.0, betas=[0.9, 0.95], eps=1e-8, schedule="constant",
                            distributed_optimizer=False)
    train = SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None,
                            balance_dp=True, packing=False)
    grads, norms = {}, {}
    for name, mtp in (("off", None), ("detached", MTPTraining(SCALE, True)),
                      ("attached", MTPTraining(SCALE, False))):
        engine = TrainEngine.build(cfg, optim, torch.float32, 1, train, weights_dir=model_dir,
                                   loss_chunk_tokens=8, mtp=mtp)
        norms[name] = train_step(engine, seqs, GlobalLossNormalizer("token-mean"))["grad_norm"]
        grads[name] = {n: p.main_grad.clone() for n, p in
                       unwrap(engine.chunks[0]).named_parameters() if not n.startswith("mtp.")}
        engine.release()

    def worst(other):
        return max(float((other[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
                   for n, g in grads["off"].items())
    return {"detached": worst(grads["detached"]), "attached": worst(grads["attached"]),
            "tensors": len(grads["off"]), "grad_norm": norms}


def export_round_trip(model_dir: str) -> dict:
    """HF -> megatron (the MTP layer trained: mapped, not carried) -> HF at one rank:
    {"missing", "extra"}: checkpoint tensors the export lacks / adds (names as stored, e.g.
    Qwen3.5's mtp.*), "max_abs": the largest difference, "passthrough": tensors still carried."""
    from safetensors.torch import load_file

    from models.bridge.weights import export_hf_weights, load_hf_weights
    from models.build.factory import build_model_chunks
    from models.families.mtp import with_trained_mtp
    from models.hf.io import SafetensorsReader, read_config
    from models.hf.passthrough import passthrough_names
    from parallel.layout import ParallelLayout
    from parallel.process_groups import setup_model_parallel

    setup_model_parallel(ParallelLayout(1))
    cfg = with_trained_mtp(read_config(model_dir))
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, SafetensorsReader(model_dir), cfg)
    out = dict(export_hf_weights(chunks, cfg))
    stored = load_file(os.path.join(model_dir, "model.safetensors"))
    return {"missing": sorted(set(stored) - set(out)), "extra": sorted(set(out) - set(stored)),
            "max_abs": max(float((out[k] - stored[k]).abs().max()) for k in out),
            "mtp": sorted(k for k in out if k.startswith("mtp.")),
            "passthrough": passthrough_names(cfg, stored.keys())}
