"""Drafting: what proposes tokens for the target to verify, and the policy around it.

    mtp_proposer.py   MTPProposer: the model's own MTP layer(s) as the draft, batched over
                      requests, chained for k > 1 (worker-side: the model runner calls it)
    hot_vocab.py      HotVocabHead: drafts from the N most frequent target tokens only
    adaptive.py       AdaptiveSpeculation: the k per step (engine-side policy)
    confidence.py     ConfidencePolicy: how many of its drafts each request verifies
    gate.py           DraftGate: whether a step drafts at all (confidence "auto")
    metrics.py        SpecDecodeStats: drafts, accepted tokens, acceptance per position

Verification (accept, recover, bonus) is the worker's `rejection_sampler.py`. This package
imports the model and weight layers below it, never the worker or the engine.
"""
