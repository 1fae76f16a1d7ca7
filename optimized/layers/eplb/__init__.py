"""Expert load balancing (parallel_config.enable_eplb): redundant expert slots, placed from measured routing.

- `placement`: the logical-to-physical expert map of one MoE layer and the replica rule;
- `policy`: the greedy rebalance (replicate the heaviest, pack by load);
- `rearrange`: moving expert weights (and their scales, in whatever runtime layout) between EP ranks;
- `controller`: the per-model state that counts routed tokens and rebalances between engine steps.
"""
