"""Prefill-decode disaggregation: moving a request's KV cache from a prefill instance to a decode instance.

`transfer_engine`: the transfer engine interface and its Mooncake backend. `rank_mapping`: which prefill rank sends
which KV heads to which decode rank when the two sides shard attention differently. `block_transfer`: the byte
ranges of a request's blocks between two paged caches. `digest`: a digest of the transferred KV keyed by logical
coordinate, compared on both sides.
"""
