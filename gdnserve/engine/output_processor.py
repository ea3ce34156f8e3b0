"""From a step's logits to outputs: sampling (one vectorised call, one device-to-host read), acceptance of
verified drafts, stop rules, append-only logprobs, incremental detokenization, prompt logprobs and score
results. The step's ``Processed`` holds the samples that finished this step (the scheduler publishes or frees
them), the requests it touched and the step's counts; a failure while processing one request is that request's
alone (``failed``).
"""
from __future__ import annotations

import torch

from gdnserve.engine.engine_api import CandidateScore, CompletionOutput, RequestOutput
from gdnserve.engine.execution.sampler import (
    Sampler,
    SamplingTensors,
    stop_check,
    stop_holdback,
    token_logprobs_rows,
)
from gdnserve.engine.scheduling.request import Request, Sample
from gdnserve.engine.scheduling.step_batch import Processed, Sampled, StepBatch
from gdnserve.speculative.acceptance import emitted_tokens, greedy_accept, rejection_sample


class OutputProcessor:
    def __init__(self, tokenizer, sampler: Sampler, max_model_len: int, spec_k: int) -> None:
        self.tokenizer, self.sampler = tokenizer, sampler
        self.eos = set(tokenizer.eos_token_ids)
        self.max_model_len, self.spec_k = max_model_len, spec_k

    # ------------------------------------------------------------------ batched, device side
    def sample(self, logits: torch.Tensor, rows: list[int], owners: list,
               steps: list[int] | None = None) -> list[tuple[int, float, dict | None]]:
        """Sample the step's rows; per owner (token, logprob, logprobs dict). The step's one device-to-host read."""
        return self.sample_async(logits, rows, owners, steps).result()

    def sample_async(self, logits: torch.Tensor, rows: list[int], owners: list,
                     steps: list[int] | None = None) -> Sampled:
        """Sample the step's rows on the device and start the one device-to-host copy (into pinned memory on
        CUDA, no host sync): the ids stay on the device to feed the next step (the overlapped loop).
        ``steps``: each row's generation step (default: its sample's tokens so far; seeded rows read it)."""
        if not rows:
            return Sampled([], None, None, None, 0)
        dev = logits.device
        ix = torch.tensor(rows, dtype=torch.int64)
        ix = ix.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else ix.to(dev)
        lg = logits[ix]
        params = [r.params for r, _ in owners]
        res = self.sampler.sample(lg, params, steps=steps if steps is not None else [len(s.token_ids) for _, s in owners],
                                  sample_indices=[s.index for _, s in owners])
        parts = [res.token_ids.double(), res.logprobs.double()]
        if res.top_ids is not None:
            parts += [res.top_ids.double().flatten(), res.top_logprobs.double().flatten()]
        flat = torch.cat(parts)
        event = None
        if dev.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flat = host
        k = res.top_ids.shape[1] if res.top_ids is not None else 0
        return Sampled(owners, res.token_ids, flat, event, k)


    def accept(self, logits: torch.Tensor, verified: list, drafts: torch.Tensor, generator_of) -> tuple:
        """Acceptance of the verify rows: greedy requests by exact match with the target's argmax, sampled ones by
        rejection sampling against the sampler's filtered distribution. Each row keeps its accepted drafts plus
        one target token, capped by what the sample may still emit (max_tokens, context length), so the state
        holds exactly the tokens the sample gets. Returns (device counts [B] int64, host token lists, per row
        None or each kept token's (logprob, logprobs dict) for a request that asked for logprobs: the raw logits'
        log-softmax at that verify position, as a decode step reports it)."""
        B, L, dev = len(verified), self.spec_k + 1, logits.device
        lg = logits.view(B, L, -1)
        num = torch.empty(B, dtype=torch.int64, device=dev)
        emitted = torch.empty(B, L, dtype=torch.int64, device=dev)
        greedy = [i for i, (r, _) in enumerate(verified) if r.params.greedy]
        sampled = [i for i, (r, _) in enumerate(verified) if not r.params.greedy]
        for rows, sample in ((greedy, False), (sampled, True)):
            if not rows:
                continue
            ix = torch.tensor(rows, device=dev)
            if sample:
                t = SamplingTensors.build([verified[i][0].params for i in rows for _ in range(L)], dev)
                probs = Sampler.probs(lg[ix].reshape(len(rows) * L, -1), t).view(len(rows), L, -1)
                n, e = rejection_sample(drafts[ix], None, probs, generator_of(dev))
            else:
                n, e = greedy_accept(drafts[ix], lg[ix].argmax(-1))
            num[ix], emitted[ix] = n, e
        room = torch.tensor([self._room(r, s) for r, s in verified], dtype=torch.int64).to(dev, non_blocking=True)
        num = torch.minimum(num, room - 1)           # tokens kept = num + 1 <= room
        want = [i for i, (r, _) in enumerate(verified) if r.params.logprobs is not None]
        lp = None
        if want:        # only the rows that asked, block by block (no [rows x L, vocab] gathered copy)
            ix = torch.tensor(want, device=dev)
            rows = (ix[:, None] * L + torch.arange(L, device=dev)).reshape(-1)
            top = max(verified[i][0].params.logprobs for i in want)
            lp = token_logprobs_rows(logits, rows, emitted[ix].clamp(min=0).reshape(-1), top)
        toks = emitted_tokens(num, emitted)
        return num + 1, toks, self._spec_logprobs(verified, want, toks, lp, L)

    @staticmethod
    def _spec_logprobs(verified: list, want: list[int], toks: list[list[int]], lp, L: int) -> list:
        """Per verify row None, or (logprob, {token: logprob, top ...}) for each token it keeps."""
        out: list = [None] * len(verified)
        if not want:
            return out
        chosen, ids, vals = lp
        chosen = chosen.tolist()
        ids, vals = (ids.tolist(), vals.tolist()) if ids is not None else (None, None)
        for w, i in enumerate(want):
            n = verified[i][0].params.logprobs
            row = []
            for j, tok in enumerate(toks[i]):
                f = w * L + j
                d = {tok: chosen[f]}
                if ids is not None and n:
                    d.update(zip(ids[f][:n], vals[f][:n]))
                row.append((chosen[f], d))
            out[i] = row
        return out

    def _room(self, req: Request, s: Sample) -> int:
        return max(1, min(req.params.max_tokens - len(s.token_ids),
                          self.max_model_len - len(req.prompt_ids) - len(s.token_ids)))

    # ------------------------------------------------------------------ per request, host side
    def append(self, req: Request, s: Sample, tok: int, lp: float | None, d: dict | None, out: Processed) -> None:
        """One generated token: logprobs (append-only), stop rules, new text."""
        p = req.params
        s.token_ids.append(tok)
        if lp is None:          # a verified token of a request without logprobs: the sum is no longer known
            s.cumulative_logprob = None
        elif s.cumulative_logprob is not None:
            s.cumulative_logprob += lp
        if p.logprobs is not None:
            if s.logprobs is None:
                s.logprobs = []
            s.logprobs.append(d)
        out.tokens += 1
        ended = tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos)
        full = len(s.token_ids) >= p.max_tokens or len(req.prompt_ids) + len(s.token_ids) >= self.max_model_len
        new = s.detok.step(s.token_ids, final=ended or full)
        stopped = False
        if p.stop:
            s.text, stopped = stop_check(s.text, new, p.stop)
        else:
            s.text += new
        if stopped or ended:
            s.finish_reason = "stop"
        elif full:
            s.finish_reason = "length"
        if s.finish_reason is not None:
            out.finished.append((req, s))

    def prompt_logprobs(self, batch: StepBatch, first: list[int], logits: torch.Tensor, i: int) -> None:
        """``prompt_logprobs`` of item i's request (it ran with all_logits): token j + 1 of the prompt from the row
        of token j; the first token has none, nor does a prefix read from a READY checkpoint (only its state is
        kept), nor the first token after it (its logits were the checkpoint's last row)."""
        it, (req, _) = batch.items[i], batch.owners[i]
        rows: list[int] = []
        if it.producer >= 0:                                   # the prefix's rows come from the producer
            prod = batch.items[it.producer]
            rows += range(first[it.producer], first[it.producer] + len(prod.tokens))
        rows += range(first[i], first[i] + len(it.tokens) - 1)
        lead = len(req.prompt_ids) - 1 - len(rows)             # positions covered only by a READY checkpoint
        out: list[dict[int, float] | None] = [None] * (lead + 1)
        if rows:                                               # a one-token prompt has nothing to score
            out += self._prompt_rows(logits, torch.tensor(rows, device=logits.device), req.prompt_ids[lead + 1:],
                                     req.params.prompt_logprobs)
        req.prompt_logprobs = out

    def prompt_logprobs_chunk(self, batch: StepBatch, first: list[int], logits: torch.Tensor, i: int, req: Request,
                              start: int, last: bool) -> None:
        """The ``prompt_logprobs`` of one chunk of a long prompt (item i: prompt positions start .. start + n - 1,
        every row's logits): row j predicts prompt token start + j + 1, the next chunk's first token included; the
        last chunk's last row predicts the first generated token instead. The first chunk starts the list (the
        first token has none), the others extend it: the same values as one unchunked step's, up to the GEMM
        shapes' rounding."""
        n = len(batch.items[i].tokens)
        rows = n - 1 if last else n
        out = [None] if start == 0 else list(req.prompt_logprobs or [])
        if rows:
            out += self._prompt_rows(logits, torch.arange(first[i], first[i] + rows, device=logits.device),
                                     req.prompt_ids[start + 1:start + 1 + rows], req.params.prompt_logprobs)
        req.prompt_logprobs = out

    @staticmethod
    def _prompt_rows(logits: torch.Tensor, rows: torch.Tensor, target: list[int], num_top: int) -> list[dict]:
        """Per row, {target token: its logprob, and the ``num_top`` largest}: one device-to-host read."""
        lp, ids, vals = token_logprobs_rows(logits, rows, torch.tensor(target, device=logits.device), num_top)
        lp = lp.tolist()
        top = (ids.tolist(), vals.tolist()) if ids is not None else None
        out = []
        for j, tok in enumerate(target):
            d = {tok: lp[j]}
            if top is not None:
                d.update(zip(top[0][j], top[1][j]))
            out.append(d)
        return out

    def output(self, req: Request) -> RequestOutput:
        stop = req.params.stop
        outs = [CompletionOutput(s.index, s.text if s.finish_reason or not stop
                                 else s.text[:len(s.text) - stop_holdback(s.text, stop)],
                                 list(s.token_ids), list(s.logprobs) if s.logprobs else None,
                                 s.cumulative_logprob, s.finish_reason) for s in req.samples]
        return RequestOutput(req.request_id, req.prompt_ids, outs, req.finished, req.checkpoint, req.prompt_logprobs,
                             error=req.error)

    # ------------------------------------------------------------------ score
    @staticmethod
    def score_results(batch: StepBatch, first: list[int], logits: torch.Tensor) -> None:
        """Each wave's candidates: row j of a candidate item ([last prefix token] + candidate) predicts candidate
        token j; its last row the label tokens. One device-to-host read for the step's waves."""
        rows, targets, seg, last, labels = [], [], [], [], []
        for w in batch.waves:
            for i, item in zip(w.cands, w.items):
                c = w.job.candidates[i]
                rows += range(first[item], first[item] + len(c))
                targets += c
                seg.append(len(c))
                last.append(first[item] + len(c))
        dev = logits.device
        R = torch.tensor(rows, device=dev)
        lp = token_logprobs_rows(logits, R, torch.tensor(targets, device=dev))[0]   # log-softmax at the targets
        idx = torch.repeat_interleave(torch.arange(len(seg), device=dev), torch.tensor(seg, device=dev))
        sums = torch.zeros(len(seg), dtype=lp.dtype, device=dev).index_add_(0, idx, lp)
        parts = [sums.double()]
        k = 0
        for w in batch.waves:
            ids = w.job.label_token_ids
            n = len(w.cands)
            if ids:
                probs = logits[torch.tensor(last[k:k + n], device=dev)].softmax(-1)
                parts.append(probs[:, torch.tensor(ids, device=dev)].double().flatten())
            labels.append((k, n, ids))
            k += n
        flat = torch.cat(parts).tolist()
        off = len(seg)
        for w, (k, n, ids) in zip(batch.waves, labels):
            for j, i in enumerate(w.cands):
                c = w.job.candidates[i]
                lab = None
                if ids:
                    lab = dict(zip(ids, flat[off + j * len(ids):off + (j + 1) * len(ids)]))
                s = flat[k + j]
                w.job.results[i] = CandidateScore(i, s, s / len(c), len(c), lab, w.job.provenance(i))
            if ids:
                off += n * len(ids)
