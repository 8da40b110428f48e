"""The training core: TrainEngine (model chunks, DDP, optimizer, schedule; train_engine.py), this
rank's batch (rank_batch.py: DP plan, GlobalLossNormalizer weights over the DP group, micro-batches,
CP shards), balancing and packing (plan, partition, batching, micro_batches), the loss contract
(loss.py, token_losses.py, router_losses.py), the megatron schedule (schedule.py), the
non-finite guard (nonfinite.py), the DDP communication overlap (comm_overlap.py) and prefix sharing
(prefix_tree.py: rows merged into a trie; tree_batch.py: the tree's micro-batch and the one gather
back to the rows; tree_routing.py: MoE routing replay on the tree).

May import: engine.errors, models, parallel. Never imports data, run, sft, rl or checkpoint.
Entry points: train_engine.TrainEngine, loss.GlobalLossNormalizer.
"""
