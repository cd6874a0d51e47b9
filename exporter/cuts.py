"""Choosing where to cut: explicit cuts named by the user, or cuts balanced by FLOPs.

A cut is identified by the index ``k`` of the block it comes before (1 <= k < blocks).
Users may name it by that index, by the block's name, or by the last node before it.
"""

from __future__ import annotations

from edgert.exporter.analyse import ModelAnalysis
from edgert.exporter.errors import CutError

MAX_LISTED_CUTS = 40


def legal_cuts_text(analysis: ModelAnalysis) -> str:
    """The legal cuts on one line, for error messages: ``index=block (after node)``."""
    cuts = [f"{c.index}={c.before_block} (after {c.after_node})" for c in analysis.cuts if c.legal]
    if not cuts:
        return "the model has a single block: no legal cut"
    if len(cuts) > MAX_LISTED_CUTS:
        cuts = cuts[:MAX_LISTED_CUTS] + [f"... {len(cuts) - MAX_LISTED_CUTS} more (edgert inspect MODEL)"]
    return "legal cuts: " + ", ".join(cuts)


def resolve_cuts(analysis: ModelAnalysis, specs: list[str]) -> list[int]:
    """Turn user cut specs (block index, block name, or node name) into sorted block indices."""
    by_block = {c.before_block: c.index for c in analysis.cuts}
    by_node = {c.after_node: c.index for c in analysis.cuts}
    node_names = set(analysis.node_block)
    indices = []
    for spec in specs:
        spec = spec.strip()
        if spec.isdigit():
            index = int(spec)
            if not 1 <= index < len(analysis.blocks):
                raise CutError(f"cut {spec}: block index must be in 1..{len(analysis.blocks) - 1}, "
                               f"or the stage before or after it would be empty; {legal_cuts_text(analysis)}")
        elif spec in by_node:
            index = by_node[spec]
        elif spec in by_block:
            index = by_block[spec]
        elif spec in node_names:
            block = analysis.blocks[analysis.node_block[spec]]
            raise CutError(f"cut {spec!r}: node is inside block {block.name!r}, not at its end; "
                           f"cuts fall between blocks; {legal_cuts_text(analysis)}")
        else:
            raise CutError(f"cut {spec!r}: no such node or block; {legal_cuts_text(analysis)}")
        indices.append(index)
    if len(set(indices)) != len(indices):
        raise CutError(f"cuts {', '.join(specs)} name the same cut twice, which would leave a stage empty")
    if indices != sorted(indices):
        raise CutError(f"cuts {', '.join(specs)} are not in pipeline order; list them from input to output")
    for index in indices:
        cut = analysis.cut_before(index)
        if not cut.legal:
            raise CutError(f"cut {index} (before block {cut.before_block!r}) {cut.why_illegal}; "
                           f"{legal_cuts_text(analysis)}")
    return indices


# A stage's training work in units of its forward FLOPs: every stage but the last runs its
# forward, then the backward call recomputes it and computes weight and input gradients
# (about 4x); the last stage's forward is folded into its backward (about 3x). With the
# backward split in two (edgert train --split-backward), a stage after the first computes its
# weight gradients once a step, off the pipeline's path: one forward's worth less.
PIPELINE_COST = {"other": 4, "last": 3}
WEIGHT_GRADIENTS = 1


def stage_cost(flops: int, last: bool, first: bool = False, split_backward: bool = False) -> int:
    """Estimated training work, on the pipeline's path, of a stage whose blocks have ``flops`` forward FLOPs."""
    deferred = WEIGHT_GRADIENTS if split_backward and not first else 0
    return flops * (PIPELINE_COST["last" if last else "other"] - deferred)


def balanced_cuts(analysis: ModelAnalysis, stages: int, split_backward: bool = False) -> list[int]:
    """Cuts that minimise the largest stage's training work (exact, by dynamic programming).

    Work is :func:`stage_cost`: forward FLOPs weighted by what a stage does with them on the
    pipeline's path (``split_backward``: every stage's but the first's weight gradients are not).
    """
    blocks = len(analysis.blocks)
    if stages < 1:
        raise CutError(f"--stages must be at least 1 (got {stages})")
    if stages > blocks:
        raise CutError(f"--stages {stages} is more than the model's {blocks} blocks; "
                       f"use at most {blocks} stages (or a deeper --block-depth)")
    legal = {c.index for c in analysis.cuts if c.legal}
    if stages - 1 > len(legal):
        raise CutError(f"--stages {stages} needs {stages - 1} cuts but only {len(legal)} are legal; "
                       f"{legal_cuts_text(analysis)}")
    prefix = [0]
    for block in analysis.blocks:
        prefix.append(prefix[-1] + block.flops)
    inf = float("inf")
    # best[s][j]: smallest bottleneck splitting blocks [0, j) into s stages; choice[s][j]: last cut
    best = [[inf] * (blocks + 1) for _ in range(stages + 1)]
    choice = [[0] * (blocks + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, blocks + 1):
            if j < blocks and j not in legal:
                continue
            for i in range(s - 1, j):
                if i > 0 and i not in legal:
                    continue
                cost = max(best[s - 1][i], stage_cost(prefix[j] - prefix[i], last=s == stages, first=s == 1,
                                                      split_backward=split_backward))
                if cost < best[s][j]:
                    best[s][j], choice[s][j] = cost, i
    if best[stages][blocks] == inf:
        raise CutError(f"no way to make {stages} stages from the legal cuts; {legal_cuts_text(analysis)}")
    cuts, j = [], blocks
    for s in range(stages, 0, -1):
        j = choice[s][j]
        cuts.append(j)
    return sorted(c for c in cuts if c > 0)
