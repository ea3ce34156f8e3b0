"""Tensor parallelism: the parallel linears' shards reassemble the full layer (ranks simulated in one
process), the loader gives each rank its own heads of every fused block, and TP=2 as two CPU processes
over gloo gives TP=1's logits through the ModelRunner (prefill, teacher-forced decode, a grouped
prefix/suffix step)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gdnserve.engine.cache.sequence import PrefillItem
from gdnserve.engine.execution.model_runner import ModelRunner, RunnerConfig
from gdnserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from gdnserve.models.builtin import builtin_config
from gdnserve.models.loader import CheckpointError, load_model
from gdnserve.models.qwen3_5 import HybridLM
from gdnserve.ops.numerics import rel_rms

TOL = 1e-5
TP = 2


# --- single process: shards of the parallel linears ------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 3])
def test_merged_column_and_row_parallel_shards_reassemble_the_full_linear(tp):
    torch.manual_seed(0)
    blocks = (6 * tp, 1 * tp, 5 * tp)                 # odd per-rank sizes, like [q | k | v] heads
    n_in, n_out, T = 13, sum(blocks), 7
    x = torch.randn(T, n_in)
    W = torch.randn(n_out, n_in)
    full = x @ W.T
    parts = []
    for r in range(tp):
        col = MergedColumnParallelLinear(n_in, blocks, tp_rank=r, tp_size=tp)
        col.weight.data = col.weight_loader(W)
        parts.append(torch.split(col(x), list(col.local_blocks), dim=1))
    # block by block, the ranks' outputs in rank order are the full block
    got = torch.cat([torch.cat([parts[r][b] for r in range(tp)], 1) for b in range(len(blocks))], 1)
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)

    W2 = torch.randn(5, n_out)
    partial = torch.zeros(T, 5)
    for r in range(tp):
        row = RowParallelLinear(n_out, 5, reduce_results=False, tp_rank=r, tp_size=tp)
        row.weight.data = row.weight_loader(W2)
        partial += row(full[:, r * n_out // tp:(r + 1) * n_out // tp])   # column-parallel output feeds it
    torch.testing.assert_close(partial, full @ W2.T, rtol=1e-5, atol=1e-5)


def test_parallel_linear_errors():
    with pytest.raises(ValueError, match=r"block 1 of size 3 is not divisible by tp_size=2"):
        MergedColumnParallelLinear(8, (4, 3), tp_rank=0, tp_size=2)
    col = ColumnParallelLinear(8, 6, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \[3, 8\], expected \[6, 8\]"):
        col.weight_loader(torch.zeros(3, 8))
    row = RowParallelLinear(6, 4, tp_rank=0, tp_size=2)
    row.weight.data = row.weight_loader(torch.randn(4, 6))
    # sharded for 2 ranks but no process group: refuse instead of returning a partial sum
    with pytest.raises(RuntimeError, match="sharded for tp_size=2"):
        row(torch.randn(3, 3))
    with pytest.raises(ValueError, match="config linear_num_key_heads = 2 is not divisible by tp_size = 4"):
        HybridLM(builtin_config(), tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank=2, tp_size=2"):
        HybridLM(builtin_config(), tp_rank=2, tp_size=2)


def test_loader_gives_each_rank_its_heads_of_every_block(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.test_hf_parity import tiny_qwen3_next
    tiny_qwen3_next(tmp_path, HV=6, num_experts=8)      # r = 3, interleaved in_proj, dense/MoE mix
    full, cfg = load_model(tmp_path, dtype=torch.float32)
    g, a, m = cfg.gdn, cfg.attn, cfg.mlp
    H, HV, K, V = g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim
    QH, KVH, Dh = a.num_heads, a.num_kv_heads, a.head_dim

    def part(t, blocks, r, dim=0):     # rank r's part of each block, concatenated
        return torch.cat([b.chunk(TP, dim)[r] for b in torch.split(t, blocks, dim)], dim)

    for r in range(TP):
        shard, _ = load_model(tmp_path, dtype=torch.float32, tp_rank=r, tp_size=TP)
        fg, sg = full.layers[0].mixer, shard.layers[0].mixer
        assert (sg.H, sg.HV) == (H // TP, HV // TP)
        assert torch.equal(sg.in_proj.weight, part(fg.in_proj.weight, [H * K, H * K, HV * V, HV * V, HV, HV], r))
        assert torch.equal(sg.conv_weight, part(fg.conv_weight, [H * K, H * K, HV * V], r))
        assert torch.equal(sg.A_log, fg.A_log.chunk(TP)[r]) and torch.equal(sg.dt_bias, fg.dt_bias.chunk(TP)[r])
        assert torch.equal(sg.norm.weight, fg.norm.weight)
        assert torch.equal(sg.out_proj.weight, fg.out_proj.weight.chunk(TP, 1)[r])
        fa, sa = full.layers[1].mixer, shard.layers[1].mixer
        assert torch.equal(sa.qkv_proj.weight, part(fa.qkv_proj.weight, [2 * QH * Dh, KVH * Dh, KVH * Dh], r))
        assert torch.equal(sa.o_proj.weight, fa.o_proj.weight.chunk(TP, 1)[r])
        fm, sm = full.layers[1].mlp, shard.layers[1].mlp     # layer 1 is sparse
        I = m.moe_intermediate_size
        assert torch.equal(sm.experts_gate_up, part(fm.experts_gate_up, [I, I], r, dim=1))
        assert torch.equal(sm.experts_down, fm.experts_down.chunk(TP, 2)[r])
        assert torch.equal(sm.gate.weight, fm.gate.weight)
        S = m.intermediate_size
        assert torch.equal(shard.layers[0].mlp.gate_up_proj.weight, part(full.layers[0].mlp.gate_up_proj.weight,
                                                                         [S, S], r))
        assert torch.equal(shard.embed_tokens.weight, full.embed_tokens.weight)
    # errors name the tensor and its full (checkpoint) shape
    from safetensors.torch import load_file, save_file
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 3)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mixer\.o_proj\.weight: checkpoint tensor has shape "
                                              r"\[64, 3\], expected \[64, 64\]"):
        load_model(tmp_path, dtype=torch.float32, tp_rank=1, tp_size=TP)


# --- two processes over gloo -------------------------------------------------------------------------------

def _run(folder, work) -> torch.Tensor:
    """The same steps on whichever shard this process holds; every step's logits, concatenated."""
    ids, P, prefix, suffixes = work
    model, _ = load_model(folder, dtype=torch.float32)     # tp_rank / tp_size from torch.distributed
    runner = ModelRunner(model, RunnerConfig(backend="torch", page_size=8, num_slots=16, num_pages=64))
    seq = runner.new_seq()
    out = [runner.step([PrefillItem(seq, ids[:P])], [])]
    for t in range(P, P + 3):                               # teacher-forced decode
        out.append(runner.step([], [(seq, ids[t])]))
    # a prefix + suffixes as one grouped step (copy-on-write tail page), with a decode in the same step
    items = [PrefillItem(runner.new_seq(), prefix)] + [PrefillItem(runner.new_seq(), s, producer=0) for s in suffixes]
    out.append(runner.step(items, [(seq, ids[P + 3])]))
    assert runner.state.check_integrity() == [] and runner.pages.check_integrity() == []
    return torch.cat(out)


def _worker(rank: int, world: int, init_file: str, folder: str, work, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # loopback: CI containers may not resolve their hostname
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_run(folder, work), f"{out_dir}/logits_{rank}.pt")
        dist.barrier()            # no rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


FAMILIES = {"qwen3_5": lambda p, hf: hf.tiny_qwen35(p),                                # dense, r = 2
            "qwen3_next_moe": lambda p, hf: hf.tiny_qwen3_next(p, HV=6, num_experts=8),  # r = 3, MoE/dense mix
            "qwen3_5_moe": lambda p, hf: hf.tiny_qwen35_moe(p),
            "qwen3_5_moe_folded": lambda p, hf: hf.tiny_qwen35_moe(p, shared=24)}          # shared expert = expert E


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_over_gloo_equals_tp1(tmp_path, family):
    pytest.importorskip("transformers")
    from tests.models import test_hf_parity
    ckpt = tmp_path / "ckpt"
    FAMILIES[family](ckpt, test_hf_parity)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (30,), generator=g).tolist()
    prefix = torch.randint(0, 97, (13,), generator=g).tolist()    # ends inside a page of 8
    suffixes = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 1, 9)]
    work = (ids, 23, prefix, suffixes)
    ref = _run(ckpt, work)                                          # TP = 1, in this process
    try:
        mp.spawn(_worker, args=(TP, str(tmp_path / "rendezvous"), str(ckpt), work, str(tmp_path)), nprocs=TP,
                 join=True)
    except mp.ProcessExitedException as e:
        # gloo occasionally aborts a process while tearing down ("terminate called without an active
        # exception", SIGABRT) after it has done its work; the outputs decide, so only a crash BEFORE both
        # ranks wrote their logits fails the test.
        if not all((tmp_path / f"logits_{r}.pt").exists() for r in range(TP)):
            raise
        print(f"ignored a teardown crash after both ranks finished: {e}")
    got = [torch.load(tmp_path / f"logits_{r}.pt") for r in range(TP)]
    assert got[0].shape == ref.shape == (1 + 3 + 1 + len(suffixes) + 1, 97)
    # replicated hidden states: every rank ends with the same logits, bit for bit
    assert torch.equal(got[0], got[1])
    for i in range(ref.shape[0]):
        assert rel_rms(got[0][i], ref[i]) <= TOL, f"logits row {i}"
