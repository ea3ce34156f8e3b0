"""The program -> (row block, N tile) map shared by the grouped GEMM kernels (``grouped_triton``,
``grouped_tma_triton``)."""
import triton
import triton.language as tl


@triton.jit
def _tile(n_out, NUM_N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_FAST: tl.constexpr):
    """This program's row block and N tile, its row and N / K offsets (1-D grid). N_FAST: consecutive programs
    walk the N tiles of one row block (its rows and its expert's weights stay in L2) instead of the row blocks of
    one N tile."""
    if N_FAST:
        pid_m = tl.program_id(0) // NUM_N
        pid_n = tl.program_id(0) % NUM_N
    else:
        pid_m = tl.program_id(0) % (tl.num_programs(0) // NUM_N)
        pid_n = tl.program_id(0) // (tl.num_programs(0) // NUM_N)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return pid_m, pid_n, offs_m, offs_n, offs_n < n_out, tl.arange(0, BK)
