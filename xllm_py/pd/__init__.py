"""Prefill/decode disaggregation: the pieces built so far.

- `transfer`: Mooncake's transfer engine as the KV data plane. Each instance registers its
  KV cache tensors; a prefill instance writes whole cache blocks straight into the blocks a
  decode instance reserved (TCP here, RDMA/NVLink with Mooncake's CUDA builds).
- `compat`: the compatibility record two instances compare before any KV moves (model,
  dtype, KV layout, block size, MLA dims, indexer, speculative method); a mismatch names
  the field.
- The decode side receives a prompt's full blocks through the block manager
  (`BlockManager.reserve_prefix` / `commit_prefix`): once written, they are prefix-cache
  entries, so the request is admitted like any prefix-cache hit and computes only its last
  partial block (which also gives its first token and the hidden state MTP drafts from).

- `roles`: the engine core's part of `--pd_role=prefill` (write a finished prompt's blocks
  to the decode instance) and `--pd_role=decode` (reserve, ask, wait, commit; on any
  failure compute the prompt here). `route`: the prefill instance's `POST /pd/prefill`.

Not built yet: the router, PD instances that are clusters, transfer metrics, launchers
(docs/pd.md lists what is there and what is not).
"""
