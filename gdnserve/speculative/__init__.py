"""Speculative decoding: drafters propose k tokens per request, one verify step runs the target on the
K + 1 tokens (the last accepted token, then the k drafts), and acceptance decides how many drafts to keep.

- ``ngram.py``: host-side drafters that read only token ids: ``NgramDrafter`` (prompt lookup, no
  weights) and ``OracleDrafter`` (the target's own future with a chosen number of errors, for tests).
  ``propose_padded`` gives every request exactly k drafts, since the verify step has a fixed shape.
- ``mtp.py``: ``MTPDrafter``, the model's own MTP head (``models/mtp.py``) drafting k tokens per request on
  the device, k one-token steps batched over the step's verify requests; its KV cache is one more page-pool
  layer, written for every fed token by a feed pass after the target forward (driven by ``ModelRunner``).
- ``acceptance.py``: ``greedy_accept`` (exact match with the target's argmax) and ``rejection_sample``
  (speculative sampling: the emitted tokens follow the target's distribution exactly), both vectorised
  over the batch with no host sync; ``emitted_tokens`` is the step's one device-to-host copy.

Every emitted token is checked by the target, so a padded or wrong draft costs throughput, never
correctness.
"""
