"""Prefix sharing's CUDA attention (parallel.tree_attention_flex) checked on the CPU: the block
mask the CUDA kernel reads (its blocks equal FlexAttention's create_block_mask of the tree
rule, and full blocks + the mask_mod on partial blocks give exactly dense_tree_mask, padding
tail included), the forward through eager flex_attention against dense_tree_attention (GQA and
a value head dim unlike q/k's, as MLA), the mask built once per micro-batch on the inputs'
device, and the dispatch of parallel.tree_attention (a faked CUDA device check)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from engine.training.prefix_tree import build_prefix_tree
from parallel import tree_attention as tree_attention_module
from parallel import tree_attention_flex as flex_module
from parallel.tree_attention import dense_tree_attention, dense_tree_mask, tree_attention
from parallel.tree_attention_flex import (_ordered, flex_block_mask, flex_tree_attention, row_block_mask,
                                          tree_block_mask, uses_flex)
from tests.test_prefix_tree import _params, random_rows

BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def visible_pairs(block_mask, n: int) -> torch.Tensor:
    """[n, n] bool: the pairs a block-sparse FlexAttention kernel attends with `block_mask`:
    every pair of a full block, the mask_mod's pairs of a partial block, none elsewhere."""
    size = block_mask.BLOCK_SIZE[0]
    nb = block_mask.kv_num_blocks.shape[-1]
    kinds = torch.zeros(nb, nb, dtype=torch.long)   # 0 skipped, 1 partial, 2 full
    for num, idx, kind in ((block_mask.kv_num_blocks, block_mask.kv_indices, 1),
                           (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 2)):
        for i in range(nb):
            kinds[i, idx[0, 0, i, :int(num[0, 0, i])].long()] = kind
    per_pair = kinds.repeat_interleave(size, 0).repeat_interleave(size, 1)[:n, :n]
    qi, ki = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    by_rule = block_mask.mask_mod(0, 0, qi, ki)
    return (per_pair == 2) | ((per_pair == 1) & by_rule)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [4, 8, 16])
def test_block_mask_is_flexs_own_and_the_tree_rule(seed, block):
    tree = build_prefix_tree(random_rows(seed + 20, groups=4))
    for pad in (0, 3):
        params = _params(tree, pad)
        n = len(params.subtree_end)
        ours = tree_block_mask(params.subtree_end, n, "cpu", block)
        reference = flex_block_mask(params, "cpu", block)
        for name in BLOCK_FIELDS:
            assert torch.equal(getattr(ours, name), getattr(reference, name)), name
        assert ours.seq_lengths == (n, n)
        dense = dense_tree_mask(params.subtree_end)
        assert torch.equal(visible_pairs(ours, n), dense)
        # the padding tail given by the row length alone (subtree_end without it)
        short = tree_block_mask(tree.subtree_end, n, "cpu", block)
        assert torch.equal(visible_pairs(short, n), dense)
        # negative control: every block with a visible pair marked full (mask_mod skipped)
        any_block = (ours.to_dense()[0, 0] > 0).to(torch.int32)   # partial or full
        reads_all = BlockMask.from_kv_blocks(
            *_ordered(torch.zeros_like(any_block)), *_ordered(any_block),
            BLOCK_SIZE=block, mask_mod=ours.mask_mod, seq_lengths=(n, n))
        assert not torch.equal(visible_pairs(reads_all, n), dense)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_flex_forward_equals_dense_tree_attention(dtype, tol):
    """Eager flex_attention (its CPU forward) with the tree's block mask: padding tail, GQA
    (enable_gqa, 8 query heads over 2 KV heads) and a value head dim of 24 against q/k's 16."""
    tree = build_prefix_tree(random_rows(31, groups=5))
    params = _params(tree, pad=5)
    n = len(params.subtree_end)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, h, 16, generator=gen, dtype=dtype) for h in (8, 2))
    v = torch.randn(n, 2, 24, generator=gen, dtype=dtype)
    ours = flex_tree_attention(q, k, v, params, 0.3)
    assert ours.shape == (n, 8, 24) and ours.dtype == dtype
    rep = [x.repeat_interleave(4, dim=1) for x in (k, v)]
    dense = dense_tree_attention(q, *rep, params.subtree_end, 0.3)
    assert float((ours - dense).abs().max()) < tol
    assert torch.equal(flex_tree_attention(q, *rep, params, 0.3), ours)   # K/V repeated
    # negative control: causal attention over the whole tree row (siblings visible)
    leaky = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, *rep)),
                                           is_causal=True, scale=0.3)[0].transpose(0, 1)
    assert float((leaky - dense).abs().max()) > 1e-2


def test_block_mask_built_once_per_micro_batch_on_the_inputs_device(monkeypatch):
    built = []
    real = flex_module.tree_block_mask

    def counting(subtree_end, n, device, block_size=flex_module.BLOCK_SIZE):
        built.append((n, str(device)))
        return real(subtree_end, n, device, block_size)
    monkeypatch.setattr(flex_module, "tree_block_mask", counting)
    tree = build_prefix_tree(random_rows(2))
    first, second = _params(tree, pad=2), _params(tree, pad=2)
    n = len(first.subtree_end)
    q, k, v = (torch.randn(n, 2, 16) for _ in range(3))
    layers = [flex_tree_attention(q, k, v, first, 0.25) for _ in range(3)]   # three layers
    assert built == [(n, "cpu")]
    assert all(torch.equal(x, layers[0]) for x in layers)
    mask = row_block_mask(first, n, "cpu")
    assert mask is first.__dict__["_flex_block_masks"][(n, "cpu")]
    assert mask.kv_indices.device.type == "cpu"
    flex_tree_attention(q, k, v, second, 0.25)   # a new micro-batch: its own mask
    assert built == [(n, "cpu")] * 2
    on_meta = row_block_mask(first, n, torch.device("meta"))   # another device: built there
    assert built[-1] == (n, "meta") and on_meta.kv_indices.device.type == "meta"
    ends = on_meta.mask_mod.__closure__[0].cell_contents   # the mask_mod's subtree_end
    assert ends.device.type == "meta" and ends.shape == (-(-n // flex_module.BLOCK_SIZE) * 128,)


@pytest.mark.parametrize("cuda", [True, False])
def test_dispatch_by_device_dtype_and_head_dims(cuda, monkeypatch):
    """With a (faked) CUDA device check, tree_attention runs FlexAttention for fp32/bf16/fp16
    and head dims 16-256 (MLA's 192/128 included), and its other paths for fp64 or head dims
    outside that range; without CUDA never. Every path's output equals the dense reference."""
    monkeypatch.setattr(flex_module, "on_cuda", lambda x: cuda)
    tree = build_prefix_tree(random_rows(5))
    params = _params(tree, pad=1)
    n = len(params.subtree_end)
    cases = {(torch.float32, 16, 16): True, (torch.float32, 192, 128): True,
             (torch.bfloat16, 32, 32): True, (torch.float64, 16, 16): False,
             (torch.float32, 8, 8): False, (torch.float32, 16, 512): False}
    for (dtype, d, dv), flex in cases.items():
        gen = torch.Generator().manual_seed(d + dv)
        q, k = (torch.randn(n, 2, d, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(n, 2, dv, generator=gen).to(dtype)
        assert uses_flex(q, k, v) == (flex and cuda), (dtype, d, dv)
        before = dict(tree_attention_module.PATHS_RUN)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = tree_attention(q, k, v, params, 0.2)
        ran = {p for p, c in tree_attention_module.PATHS_RUN.items() if c > before.get(p, 0)}
        assert ran == {"flex"} if flex and cuda else ran <= {"split", "per_run"}, ran
        ref = dense_tree_attention(*(x.double() for x in (q, k, v)), params.subtree_end, 0.2)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert float((out.double() - ref).abs().max()) < tol, (dtype, d, dv)


def test_gpu_report_says_which_attention_ran(tmp_path):
    """tools.bench.gpu's prefix_sharing item: its digest names the tree attention each shared
    workload ran, and on CUDA a shared workload that did not run FlexAttention alone is a
    problem (the short workload runs unshared: ratio 1, no tree attention)."""
    import json

    from tools.bench.gpu.items import Item
    from tools.bench.gpu.report import key_numbers, read_prefix

    def workload(ratio, attention):
        return dict(speedup=2.0, ratio=ratio, loss_rel=0.0, grad_norm_rel=0.0,
                    attention=attention)
    result = tmp_path / "prefix_sharing.json"
    item = Item("prefix_sharing", "prefix", [], 1, result, tmp_path)
    for device, grpo, problems in (("cuda", {"flex": 16}, 0), ("cuda", {"per_run": 16}, 1),
                                   ("cpu", {"split": 16}, 0)):
        result.write_text(json.dumps({"prefix_sharing_device": device,
                                      "prefix_sharing_grpo": workload(0.27, grpo),
                                      "prefix_sharing_short": workload(1.0, {})}))
        metrics = read_prefix(item)
        assert len(metrics["problems"]) == problems, metrics
        line = key_numbers({"metrics": metrics})
        assert line == f"grpo x2.00 (ratio 0.27; {next(iter(grpo))}); short x2.00 (ratio 1.00; " \
                       "unshared)", line


def test_compiled_flex_does_not_recompile_for_new_micro_batches():
    """torch.compile(flex_attention, dynamic=True) (dynamo's guards; the aot_eager backend runs
    on the CPU) over four micro-batches' block masks of new lengths and new mask_mod closures:
    one graph for one-block rows (dynamo specializes a size of 1) and one for every longer row,
    each equal to the dense reference."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, backend="aot_eager", dynamic=True)
    graphs = []
    for seed in (1, 2, 3, 4):
        params = _params(build_prefix_tree(random_rows(seed, groups=6 * seed, per_group=6)), 3)
        n = len(params.subtree_end)
        q, k, v = (torch.randn(n, 2, 16) for _ in range(3))
        out = compiled(*(x.transpose(0, 1)[None] for x in (q, k, v)),
                       block_mask=row_block_mask(params, n, "cpu"), scale=0.3)[0].transpose(0, 1)
        dense = dense_tree_attention(q, k, v, params.subtree_end, 0.3)
        assert float((out - dense).abs().max()) < 2e-6
        graphs.append((n > flex_module.BLOCK_SIZE, counters["stats"]["unique_graphs"]))
    assert graphs == [(False, 1), (True, 2), (True, 2), (True, 2)], graphs
    torch._dynamo.reset()
