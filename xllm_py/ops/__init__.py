"""Device kernels behind one narrow seam each: one module per operation, its pure-torch
reference beside its Triton kernel, and a test (run on CPU by Triton's interpreter,
`TRITON_INTERPRET=1`) that checks the two agree.

    paged_mla   absorbed MLA attention read in place from the paged latent cache
                (decode, verification, the MTP first pass; split-KV for long contexts)
    fused_moe   routed experts: assignments sorted and padded by expert on the device,
                grouped GEMMs with SiLU-and-mul and the top-k weights (bf16 / block FP8)
    fp8_gemm    block-FP8 GEMM for the dense linears (128x128 weight blocks, 1x128
                per-token-group activation scales)

Which implementation a layer calls is chosen once, at start-up, by `backends.py`
(`--attention_backend`, `--moe_backend`) and logged.
"""
