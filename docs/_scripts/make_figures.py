"""Draw the figures of the documentation into docs/_static/ (run by hand, output committed).

    python docs/_scripts/make_figures.py

Needs matplotlib (not a dependency of cupyflash or of the docs build: the SVG
files are committed).  The output is deterministic (fixed hash salt, no date),
so rerunning without changes leaves the files byte-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATIC = Path(__file__).resolve().parents[1] / "_static"

# Colours: query side blue, key/value side orange, the current block red.
Q_COLOUR, K_COLOUR, CUR_COLOUR = "#4c72b0", "#dd8452", "#c44e52"
FULL_COLOUR, PARTIAL_COLOUR, EMPTY_COLOUR = "#8fbf8f", "#f2d48f", "#ffffff"


def _grid(ax, x0, y0, rows, cols, cell, **kw):
    """Draw a rows x cols grid of square cells whose top-left corner is (x0, y0)."""
    from matplotlib.patches import Rectangle

    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((x0 + j * cell, y0 - (i + 1) * cell), cell, cell, **kw))


def _algorithm1(ax):
    """Panel (a): FlashAttention (v1), K/V blocks outer, Q blocks inner."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    t_r, t_c, cell = 4, 5, 1.0
    i_cur, j_cur = 2, 1
    x0, y0 = 2.0, 6.0                      # top-left of the score matrix S
    # S = Q K^T: the T_r x T_c blocks; blocks already visited (j' < j, or j' = j and i' < i) shaded
    for i in range(t_r):
        for j in range(t_c):
            done = j < j_cur or (j == j_cur and i < i_cur)
            ax.add_patch(Rectangle((x0 + j * cell, y0 - (i + 1) * cell), cell, cell,
                                   facecolor="#e6e6e6" if done else "white", edgecolor="black", lw=0.8))
    ax.add_patch(Rectangle((x0 + j_cur * cell, y0 - (i_cur + 1) * cell), cell, cell,
                           facecolor=CUR_COLOUR, edgecolor="black", lw=1.2, alpha=0.85))
    ax.text(x0 + (j_cur + 0.5) * cell, y0 - (i_cur + 0.5) * cell, r"$S_{ij}$", ha="center",
            va="center", color="white", fontsize=10)
    # Q on the left, split into T_r blocks of B_r rows
    qx = x0 - 1.4
    for i in range(t_r):
        ax.add_patch(Rectangle((qx, y0 - (i + 1) * cell), 0.8, cell,
                               facecolor=Q_COLOUR if i == i_cur else "white", edgecolor=Q_COLOUR,
                               lw=1.0, alpha=0.8 if i == i_cur else 1.0))
    ax.text(qx + 0.4, y0 + 0.25, "Q", ha="center", va="bottom", color=Q_COLOUR, fontsize=11)
    ax.text(qx - 0.15, y0 - (i_cur + 0.5) * cell, r"$Q_i$", ha="right", va="center", fontsize=9)
    # K^T on top, split into T_c blocks of B_c columns
    ky = y0 + 1.4
    for j in range(t_c):
        ax.add_patch(Rectangle((x0 + j * cell, ky - 0.8), cell, 0.8,
                               facecolor=K_COLOUR if j == j_cur else "white", edgecolor=K_COLOUR,
                               lw=1.0, alpha=0.8 if j == j_cur else 1.0))
    ax.text(x0 - 0.15, ky - 0.4, r"$K^T$", ha="right", va="center", color=K_COLOUR, fontsize=11)
    ax.text(x0 + (j_cur + 0.5) * cell, ky + 0.1, r"$K_j, V_j$", ha="center", va="bottom", fontsize=9)
    # loop arrows: outer j (left to right), inner i (top to bottom)
    ax.add_patch(FancyArrowPatch((x0, y0 - t_r * cell - 0.45), (x0 + t_c * cell, y0 - t_r * cell - 0.45),
                                 arrowstyle="-|>", mutation_scale=12, color=K_COLOUR, lw=1.5))
    ax.text(x0 + t_c * cell / 2, y0 - t_r * cell - 0.6, "outer loop: K/V block j  (line 5)",
            ha="center", va="top", fontsize=9, color=K_COLOUR)
    ax.add_patch(FancyArrowPatch((x0 + t_c * cell + 0.35, y0), (x0 + t_c * cell + 0.35, y0 - t_r * cell),
                                 arrowstyle="-|>", mutation_scale=12, color=Q_COLOUR, lw=1.5))
    ax.text(x0 + t_c * cell + 0.5, y0 - t_r * cell / 2, "inner loop:\nQ block i\n(line 7)",
            ha="left", va="center", fontsize=9, color=Q_COLOUR)
    ax.text(x0 + t_c * cell / 2, y0 - t_r * cell - 1.35,
            "grey: blocks done; O_i, l_i, m_i go to HBM and back on every (i, j)", ha="center", va="top",
            fontsize=8.5, style="italic")
    ax.set_title("(a) FlashAttention, Algorithm 1", fontsize=11)


def _flash2(ax):
    """Panel (b): FlashAttention-2, one CTA per Q block, causal blocks bottom-right aligned."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from cupyflash._cpu import block_bounds

    t_r, t_c, cell = 4, 6, 1.0
    b_r = b_c = 16
    lq, lk = t_r * b_r, t_c * b_c           # Lq < Lk, as when decoding with a KV cache
    x0, y0 = 2.0, 6.0
    fill = {"full": FULL_COLOUR, "partial": PARTIAL_COLOUR, "empty": EMPTY_COLOUR}
    for i in range(t_r):
        kinds = [block_bounds(i * b_r, (i + 1) * b_r, j * b_c, (j + 1) * b_c, lk - lq, None, 0)
                 for j in range(t_c)]
        for j, kind in enumerate(kinds):
            ax.add_patch(Rectangle((x0 + j * cell, y0 - (i + 1) * cell), cell, cell,
                                   facecolor=fill[kind], edgecolor="black", lw=0.8,
                                   hatch="//" if kind == "empty" else None))
        last = max(j for j, kind in enumerate(kinds) if kind != "empty")
        ax.add_patch(FancyArrowPatch((x0 + 0.1, y0 - (i + 0.5) * cell),
                                     (x0 + (last + 0.9) * cell, y0 - (i + 0.5) * cell),
                                     arrowstyle="-|>", mutation_scale=10, color="black", lw=1.0))
        ax.text(x0 - 0.15, y0 - (i + 0.5) * cell, f"CTA {i}", ha="right", va="center", fontsize=9,
                color=Q_COLOUR)
    # the bottom-right aligned diagonal: query row r sees keys up to r + Lk - Lq
    ax.plot([x0 + (lk - lq) / b_c * cell, x0 + t_c * cell], [y0, y0 - t_r * cell], color=CUR_COLOUR,
            lw=1.5)
    ax.text(x0 + t_c * cell / 2, y0 + 0.3, f"keys (Lk = {lk}), streamed in blocks of {b_c}",
            ha="center", va="bottom", fontsize=9, color=K_COLOUR)
    legend = [(FULL_COLOUR, None, "no mask needed"), (PARTIAL_COLOUR, None, "masked in the kernel"),
              (EMPTY_COLOUR, "//", "skipped")]
    for n, (colour, hatch, label) in enumerate(legend):
        ly = y0 - t_r * cell - 0.6 - 0.45 * n
        ax.add_patch(Rectangle((x0, ly - 0.3), 0.3, 0.3, facecolor=colour, edgecolor="black", lw=0.6,
                               hatch=hatch))
        ax.text(x0 + 0.45, ly - 0.15, label, ha="left", va="center", fontsize=8.5)
    ax.text(x0 + 3.7, y0 - t_r * cell - 0.55, f"causal, Lq = {lq} < Lk:\nthe diagonal ends\n"
            "in the bottom-right corner", ha="left", va="top", fontsize=8.5, color=CUR_COLOUR)
    ax.set_title("(b) FlashAttention-2: one CTA per Q block", fontsize=11)


def tiling(path: Path) -> None:
    import matplotlib

    matplotlib.use("svg")
    matplotlib.rcParams["svg.hashsalt"] = "cupyflash-docs"
    matplotlib.rcParams["svg.fonttype"] = "none"      # text stays text: small, searchable
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    _algorithm1(axes[0])
    _flash2(axes[1])
    for ax in axes:
        ax.set_xlim(0, 9.5)
        ax.set_ylim(0, 8)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None, "Creator": None})
    plt.close(fig)


def main() -> None:
    sys.path.insert(0, str(ROOT))          # the checkout's cupyflash, installed or not
    STATIC.mkdir(exist_ok=True)
    tiling(STATIC / "tiling.svg")
    print(f"wrote {STATIC / 'tiling.svg'}")


if __name__ == "__main__":
    main()
