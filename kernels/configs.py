"""Launch configs of the Triton kernels: a table measured per (kernel, row width), a heuristic
for the widths it lacks.

Two families, two kinds of config (plain dicts, so that the table is JSON):

- norms (rms_norm, add_rms_norm, layer_norm, add_layer_norm) reduce whole rows inside a program:
  BLOCK_N is the width padded to a power of two; `{"rows": 2, "warps": 4}` is 2 rows per
  program on 4 warps;
- elementwise kernels (swiglu, gelu_bias, gated_residual) take `[rows, BLOCK_N]` tiles of
  `block` elements; BLOCK_N is the widest power of two up to 1024 that divides the width (pads
  it by at most 1/16): 576 -> 64, 384 -> 128, 768 -> 256, so no lane is padded; strided rows,
  broadcast rows and per-row gates stay plain 2-D indexing. `{"block": 2048, "warps": 4}`;
  rotary's tiles are rows x half the head dimension (not in the table yet: the heuristic's
  until a GPU sweep times it).

`TABLE[kernel][str(width)]` is benchmarks/tune_kernels.py's `--json` output from one H200
(2026-12-04, torch 2.11, Triton 3.6, bf16, 4096 rows; `STEPS=tune_kernels
benchmarks/gpu_check.sh OUT`): paste a new sweep over it. Widths
not in the table take `heuristic()`. The configs are for many rows; with few (decode) a norm
takes fewer rows per program, to keep MIN_PROGRAMS programs (one row each below that), a tile
no more rows than there are, and the warps shrink with the block.

Triton's interpreter ignores the table: each interpreted program costs milliseconds whatever
its size, so it takes whole rows in blocks of about INTERPRETER_BLOCK elements.
`override(config)` makes every lookup use `config`, interpreter included: the tuner times
candidates through the real launchers, the tests run the GPU configs in the interpreter.
"""
import contextlib

from rbcompile.kernels._triton import interpreting

NORMS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")
ELEMENTWISE = ("swiglu", "gelu_bias", "gated_residual")
MAX_HIDDEN = 65536  # a norm's program holds a whole row (Liger-Kernel's MAX_FUSED_SIZE)
MAX_TILE_N = 1024  # widest column tile of the elementwise kernels
MIN_PROGRAMS = 256  # about two per SM on an H100 / H200 (132 SMs)
INTERPRETER_BLOCK = 1 << 17

TABLE = {
    "rms_norm": {
        "384": {"rows": 2, "warps": 2}, "576": {"rows": 1, "warps": 2},
        "768": {"rows": 2, "warps": 4}, "2048": {"rows": 2, "warps": 8},
        "4096": {"rows": 1, "warps": 8}},
    "add_rms_norm": {
        "384": {"rows": 2, "warps": 2}, "576": {"rows": 1, "warps": 4},
        "768": {"rows": 2, "warps": 4}, "2048": {"rows": 1, "warps": 4},
        "4096": {"rows": 1, "warps": 8}},
    "layer_norm": {
        "384": {"rows": 4, "warps": 4}, "576": {"rows": 2, "warps": 4},
        "768": {"rows": 1, "warps": 2}, "2048": {"rows": 1, "warps": 4},
        "4096": {"rows": 1, "warps": 16}},
    "add_layer_norm": {
        "384": {"rows": 2, "warps": 4}, "576": {"rows": 1, "warps": 4},
        "768": {"rows": 2, "warps": 4}, "2048": {"rows": 1, "warps": 4},
        "4096": {"rows": 1, "warps": 8}},
    "swiglu": {
        "384": {"block": 2048, "warps": 4}, "576": {"block": 512, "warps": 1},
        "768": {"block": 4096, "warps": 16}, "2048": {"block": 2048, "warps": 4},
        "4096": {"block": 512, "warps": 2}},
    "gelu_bias": {
        "384": {"block": 2048, "warps": 4}, "576": {"block": 512, "warps": 2},
        "768": {"block": 512, "warps": 1}, "2048": {"block": 1024, "warps": 4},
        "4096": {"block": 1024, "warps": 4}},
    "gated_residual": {
        "384": {"block": 4096, "warps": 16}, "576": {"block": 2048, "warps": 4},
        "768": {"block": 2048, "warps": 4}, "2048": {"block": 2048, "warps": 8},
        "4096": {"block": 2048, "warps": 4}},
}

_override = None


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextlib.contextmanager
def override(config: dict):
    """Every lookup inside the `with` block uses `config` (one kernel's kind of config)."""
    global _override
    previous, _override = _override, config
    try:
        yield
    finally:
        _override = previous


def heuristic(kernel: str, width: int) -> dict:
    """Norms: about 2048 elements per program, 16 per thread (one row per program from 2048
    wide, as Liger-Kernel and inductor's persistent reductions do); elementwise: 2048-element
    tiles on 4 warps."""
    if kernel in NORMS:
        block_n = pow2(width)
        rows = max(1, 2048 // block_n)
        return {"rows": rows, "warps": min(16, max(1, rows * block_n // 512))}
    return {"block": 2048, "warps": 4}


def config(kernel: str, width: int) -> dict:
    """`kernel`'s GPU config for rows of `width`: the override, else the table's, else the
    heuristic's."""
    if _override is not None:
        return _override
    return TABLE.get(kernel, {}).get(str(width)) or heuristic(kernel, width)


def blocks(kernel: str, n_rows: int, n_cols: int) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK_ROWS, BLOCK_N, num_warps, grid) of the norm `kernel` for `n_rows` x `n_cols`."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"hidden size {n_cols} > {MAX_HIDDEN}: not supported by the Triton norms")
    block_n = pow2(n_cols)
    if interpreting() and _override is None:
        rows, warps = max(1, min(INTERPRETER_BLOCK // block_n, pow2(n_rows))), 4
    else:
        cfg = config(kernel, n_cols)
        rows = min(cfg["rows"], pow2(cdiv(n_rows, MIN_PROGRAMS)))
        warps = max(1, cfg["warps"] * rows // cfg["rows"])
    return rows, block_n, warps, (cdiv(n_rows, rows),)


def column_tile(n_cols: int, widest: int) -> int:
    """The widest power of two <= `widest` that pads `n_cols` by at most 1/16 (down to 16
    columns); else the width's power of two, capped at `widest`."""
    block_n = min(widest, pow2(n_cols))
    while block_n >= 16:
        if (-n_cols) % block_n * 16 <= n_cols:
            return block_n
        block_n //= 2
    return min(widest, pow2(n_cols))


def tiles(kernel: str, n_rows: int, n_cols: int) -> tuple[int, int, int, tuple[int]]:
    """(BLOCK_ROWS, BLOCK_N, num_warps, grid) of the elementwise `kernel` for `n_rows` x
    `n_cols`: one program per tile, a row's column tiles next to each other in the grid."""
    if interpreting() and _override is None:
        block, warps = INTERPRETER_BLOCK, 4
        block_n = min(pow2(n_cols), MAX_HIDDEN)
    else:
        cfg = config(kernel, n_cols)
        block, warps = cfg["block"], cfg["warps"]
        block_n = column_tile(n_cols, min(MAX_TILE_N, block))
    rows = max(1, min(block // block_n, pow2(n_rows)))
    warps = max(1, warps * rows * block_n // block)
    return rows, block_n, warps, (cdiv(n_rows, rows) * cdiv(n_cols, block_n),)
