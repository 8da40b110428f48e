"""`python tools/convert.py verify`: a Megatron checkpoint's logits at a parallel layout against
transformers' model of the HF folder (a reward model: its sequence scores), the check
tools/convert.py's module docstring describes. Run under torchrun with tp x pp x dp ranks.
"""
from __future__ import annotations

from tools.convert_common import resolve_checkpoint, setup_layout


def verify(args) -> int:
    """`verify`: 1 (on every rank) when the checkpoint's logits at the layout (args.tp, pp,
    ep; args.dtype) differ from transformers' by more than the tolerance on a random batch
    (args.batch x args.seq_len, args.seed), else 0; a reward model compares its scores
    (tools.convert_reward.verify_scores). Collective over the launch's ranks."""
    import torch
    import torch.distributed as dist

    from models.bridge.checkpoint import load_model, read_hf_config
    from models.build.factory import build_model_chunks
    from models.build.forward import forward_logits

    from models.bridge.reward_model import is_reward_model_config
    from models.hf.config import check_config
    from models.layers.heads.value import attach_value_heads
    from tools.convert_reward import verify_scores

    ckpt = resolve_checkpoint(args.ckpt, getattr(args, "iteration", None))
    cfg = read_hf_config(ckpt)
    check_config(cfg)
    setup_layout(cfg, args.tp, args.pp, args.ep)
    dtype = getattr(torch, args.dtype)
    chunks = build_model_chunks(cfg, params_dtype=dtype)
    reward = is_reward_model_config(cfg)  # compares scores, not logits
    if reward:
        attach_value_heads(chunks, bias=False)
    load_model(chunks, ckpt)
    for chunk in chunks:  # inference (megatron's MoE layer refuses TP without SP in training)
        chunk.eval()
    if reward:
        ok = verify_scores(chunks, cfg, args)
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item() > 0)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq_len), generator=gen)
    logits = forward_logits(chunks, tokens, cfg["vocab_size"]).float().cpu()
    if dist.get_rank() == 0:
        import transformers

        from models.hf.conditional import reference_class
        from models.hf.io import read_config

        # as published: a conditional-generation checkpoint's own class (text input only)
        auto = getattr(transformers, reference_class(read_config(args.hf_dir)))
        hf = auto.from_pretrained(args.hf_dir, dtype=dtype)
        # transformers < 5.20 dequantizes published MXFP4 experts to bf16 whatever `dtype` is;
        # the values are bf16-exact (fp4 x power-of-two scales), so casting restores them
        hf = hf.to(dtype)
        if torch.cuda.is_available():
            hf = hf.cuda()
        with torch.no_grad():
            ref = hf(tokens.to(next(hf.parameters()).device)).logits.float().cpu()
        diff = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        tolerance = args.tolerance if args.tolerance is not None else (
            1e-4 if args.dtype == "float32" else 3e-2 * scale)
        print(f"reference: transformers {type(hf).__name__}")
        print(f"layout tp={args.tp} pp={args.pp} ep={args.ep} dtype={args.dtype} "
              f"max_abs_diff={diff:.3e} "
              f"(max |logit| {scale:.3e})")
        ok = diff <= tolerance
        print("verify: OK" if ok else f"verify: FAILED (tolerance {tolerance:.3e})")
    else:
        ok = True
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item() > 0)
