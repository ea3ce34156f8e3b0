"""The MTP head: ``mtp.*`` tensors load from HF-format checkpoints (tiny models saved by transformers' own
classes, random ``mtp.*`` added), loader errors name the tensor, checkpoints without MTP still load, and the
drafter's draft logits equal a float64 reference written from the checkpoint tensors — after prompts fed in
chunks, decodes, verify steps with every acceptance count (rejected drafts rolled back), and for consumers of
a same-step producer and of a READY checkpoint (prefixes ending inside a KV page and on its boundary)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from gdnserve.engine.llm_engine import LLMEngine  # noqa: E402
from gdnserve.models.loader import CheckpointError, load_model  # noqa: E402
from gdnserve.models.tokenizer import ByteTokenizer  # noqa: E402
from gdnserve.ops.numerics import rel_rms  # noqa: E402
from tests.models.mtp_reference import (  # noqa: E402
    add_mtp,
    reference_draft_logits,
    reference_weights,
)
from tests.models.test_hf_parity import tiny_qwen3_next, tiny_qwen35, tiny_qwen35_moe  # noqa: E402

TOL = 1e-4
FAMILIES = {"qwen3_5": tiny_qwen35, "qwen3_next": lambda p: tiny_qwen3_next(p, num_experts=8),
            "qwen3_5_moe": tiny_qwen35_moe}


def _rewrite(folder, fn):
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mtp_tensors_load(tmp_path, family):
    FAMILIES[family](tmp_path)
    mtp = add_mtp(tmp_path, seed=1, count_in_config=family != "qwen3_next")   # Qwen3-Next: counted from tensors
    model, cfg = load_model(tmp_path, dtype=torch.float32)
    assert cfg.mtp.num_layers == 1 and model.mtp is not None and model.mtp_unavailable is None
    h = model.mtp
    assert torch.equal(h.fc.weight, mtp["mtp.fc.weight"])
    assert torch.equal(h.pre_fc_norm_hidden.weight, mtp["mtp.pre_fc_norm_hidden.weight"])
    a = "mtp.layers.0.self_attn."
    assert torch.equal(h.layers[0].mixer.qkv_proj.weight,
                       torch.cat([mtp[a + "q_proj.weight"], mtp[a + "k_proj.weight"], mtp[a + "v_proj.weight"]]))
    moe = "mtp.layers.0.mlp.gate.weight" in mtp
    assert moe == cfg.is_moe_layer(0) == hasattr(h.layers[0].mlp, "experts_down")
    if moe:
        assert torch.equal(h.layers[0].mlp.gate.weight, mtp["mtp.layers.0.mlp.gate.weight"])
    else:
        assert torch.equal(h.layers[0].mlp.down_proj.weight, mtp["mtp.layers.0.mlp.down_proj.weight"])


def test_loader_errors_name_the_mtp_tensor(tmp_path):
    tiny_qwen35(tmp_path)
    add_mtp(tmp_path, seed=1)
    name = "mtp.layers.0.self_attn.k_proj.weight"
    _rewrite(tmp_path, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor {name}"):
        load_model(tmp_path, dtype=torch.float32)
    tiny_qwen35(tmp_path)
    add_mtp(tmp_path, seed=1)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("mtp.fc.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight: checkpoint tensor has shape \[3, 3\]"):
        load_model(tmp_path, dtype=torch.float32)
    tiny_qwen35(tmp_path)
    add_mtp(tmp_path, seed=1)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("mtp.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors in checkpoint: \['mtp.layers.0.mystery.weight'\]"):
        load_model(tmp_path, dtype=torch.float32)


def test_checkpoint_without_mtp_loads_and_the_mtp_drafter_says_why(tmp_path):
    tiny_qwen35(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, mtp_num_hidden_layers=1)))
    model, mcfg = load_model(tmp_path, dtype=torch.float32)     # the config promises MTP, the tensors are absent
    assert model.mtp is None and mcfg.mtp.num_layers == 0
    assert "mtp_num_hidden_layers = 1 but the checkpoint has no mtp.* tensors" in model.mtp_unavailable
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="spec_draft='mtp'.*no mtp.\\* tensors"):
        LLMEngine(model, tok, spec_k=2, spec_draft="mtp")
    with pytest.raises(ValueError, match="spec_draft must be 'ngram' or 'mtp'"):
        LLMEngine(model, tok, spec_k=2, spec_draft="eagle")
    assert LLMEngine(model, tok, spec_k=2).drafter is not None    # n-gram drafts still work


def _target_hidden(folder):
    """tokens -> our target's final hidden states [n, H] (float64) from a plain prefill on a second copy of
    the model: the reference MTP gets the same target states as the drafter, so only the MTP math and its
    bookkeeping are compared (a random MoE target is itself ill-conditioned: fp32 vs fp64 differ ~1e-4)."""
    model, _ = load_model(folder, dtype=torch.float32)
    runner = ModelRunner(model, RunnerConfig(backend="torch", page_size=8, num_pages=64))
    forward, box = model.forward, {}

    def capture(ids, rows=None):
        logits, box["h"] = forward(ids, rows, return_hidden=True)
        return logits

    model.forward = capture

    def hidden(tokens: list[int]) -> torch.Tensor:
        seq = runner.new_seq()
        runner.step([PrefillItem(seq, tokens)], [])
        runner.free_seq(seq)
        return box["h"].double()
    return hidden


def _check_drafts(runner, b, hidden, W, cfg, hist, nxt, what, tol=TOL):
    drafts = runner.drafts[b].tolist()
    ref = reference_draft_logits(W, cfg, hidden(hist), hist + [nxt], drafts)
    for j in range(len(drafts)):
        err = rel_rms(runner.mtp.logits[j][b], ref[j])
        assert err < tol, f"{what}: draft step {j + 1} rel-RMS {err:.3g}"
    return drafts


@pytest.mark.parametrize("family,mode,backend", [(f, m, "torch") for f in FAMILIES for m in ("replay", "intermediate")]
                         + [("qwen3_5", "replay", "triton")])
def test_draft_logits_match_float64_reference(tmp_path, family, mode, backend):
    """Prompt in two chunks, a decode, then verify steps keeping 1..L tokens: every draft step's logits equal
    the reference over the full history (so no rejected draft's KV or hidden state is ever read). Also once
    through the Triton kernels (the interpreter on CPU)."""
    hf = FAMILIES[family](tmp_path)
    add_mtp(tmp_path, seed=2)
    # The reference's target hidden states come from a separate fp32 prefill, the drafter's from the chunked /
    # decode / verify path: on a random MoE target the two summation orders differ by up to ~1e-4 (8e-5 on the
    # CI machine, 1.8e-4 on the H200 host's 16-thread CPU BLAS), so MoE families get 3e-4 (dense keep 1e-4); a
    # sharper router (x4) keeps top-k away from near-ties.
    if family != "qwen3_5":
        _rewrite(tmp_path, lambda sd: [sd[n].mul_(4) for n in list(sd) if n.endswith("mlp.gate.weight")])
    tol = TOL if family == "qwen3_5" else 3 * TOL
    # the Triton case runs the real kernels on a GPU host (the interpreter serves CPU-only machines)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model, cfg = load_model(tmp_path, dtype=torch.float32, device=device)
    W, hidden = reference_weights(tmp_path, cfg), _target_hidden(tmp_path)
    k = 3
    runner = ModelRunner(model, RunnerConfig(backend=backend, page_size=8, spec_mode=mode, spec_tokens=k + 1,
                                             spec_draft="mtp"))
    runner.mtp.keep_logits = True
    hist = torch.randint(0, 97, (29,)).tolist()
    seq = runner.new_seq()
    runner.step([PrefillItem(seq, hist[:13])], [])
    runner.step([PrefillItem(seq, hist[13:])], [])                    # a continuation of its own slot
    nxt = int(torch.randint(0, 97, ()))
    runner.step([], [(seq, nxt)])                                      # a plain decode
    hist.append(nxt)
    nxt = int(torch.randint(0, 97, ()))
    for rnd, keep in enumerate([1, 4, 2, 3, 1]):
        logits = runner.step([], [], verifies=[(seq, [nxt])])
        drafts = _check_drafts(runner, 0, hidden, W, cfg, hist, nxt, f"round {rnd}", tol)
        if family == "qwen3_5":            # the hidden the head reads is HF's last_hidden_state (after the norm)
            with torch.no_grad():
                want = hf.model(torch.tensor([hist])).last_hidden_state[0, -1]
            assert rel_rms(runner.mtp.hidden[seq.slot], want) < TOL
        runner.accept([(seq, keep)])
        hist += ([nxt] + drafts)[:keep]
        nxt = int(logits[keep - 1].argmax())
    assert runner.pages.check_integrity() == [] and runner.state.check_integrity() == []


@pytest.mark.parametrize("prefix_len", [16, 21])                   # on a page boundary, inside a page
def test_consumers_of_a_producer_and_of_a_ready_checkpoint_draft_like_the_reference(tmp_path, prefix_len):
    tiny_qwen35(tmp_path)
    add_mtp(tmp_path, seed=3)
    model, cfg = load_model(tmp_path, dtype=torch.float32)
    W, hidden = reference_weights(tmp_path, cfg), _target_hidden(tmp_path)
    k = 2
    runner = ModelRunner(model, RunnerConfig(backend="torch", page_size=8, spec_mode="replay", spec_tokens=k + 1,
                                             spec_draft="mtp"))
    runner.mtp.keep_logits = True
    prefix = torch.randint(0, 97, (prefix_len,)).tolist()
    suffixes = [torch.randint(0, 97, (n,)).tolist() for n in (5, 1, 9)]
    prod = runner.new_seq()
    cons = [runner.new_seq() for _ in suffixes]
    runner.step([PrefillItem(prod, prefix)] + [PrefillItem(c, s, producer=0) for c, s in zip(cons, suffixes[:2])], [])
    # a later consumer of the (now final) producer state and pages, read in place as a READY checkpoint
    runner.step([PrefillItem(cons[2], suffixes[2], start_from=(prod.slot, prod.pages))], [],
                ready={prod.slot})
    nxt = torch.randint(0, 97, (3,)).tolist()
    runner.step([], [], verifies=[(c, [t]) for c, t in zip(cons, nxt)])
    for b, s in enumerate(suffixes):
        _check_drafts(runner, b, hidden, W, cfg, prefix + s, nxt[b], f"consumer {b}")
    runner.accept([(c, 2) for c in cons])
    assert runner.pages.check_integrity() == []
