"""Draft trees as a 1-D tensor of parent indices (`parents[0] == -1`, `parents[i] < i`).

Node 0 is the root: the last emitted token, not yet verified by the target. Everything else (depths, the
attention mask among nodes, root-to-node paths) is a pure function of `parents`. A chain of k drafts is
`[-1, 0, 1, ..., k-1]`, so chain and tree decoding share one code path.
"""

from __future__ import annotations

import torch


def chain(k: int) -> torch.Tensor:
    """Parents of a chain with k draft tokens after the root."""
    return torch.arange(-1, k, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] is True when j is i or one of i's ancestors (what node i may attend to)."""
    par = parents.tolist()
    n = len(par)
    if n <= 63:  # rows as bit sets in Python ints, unpacked at once (a torch op per node costs more)
        bits: list[int] = []
        for i, p in enumerate(par):  # parents[i] < i, so row parents[i] is already complete
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        return (torch.tensor(bits)[:, None] >> torch.arange(n)) & 1 == 1
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[par[i]]
    return mask


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node (root 0) = number of its ancestors."""
    return ancestor_mask(parents).sum(-1) - 1


def path_to(node_mask: torch.Tensor, node: int) -> torch.Tensor:
    """Node indices from the root to `node`, in order, read off the ancestor mask."""
    return node_mask[node].nonzero().flatten()  # ancestors have smaller indices: already ordered


def from_choices(choices: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-1 / Medusa choice lists -> (parents, rank among siblings), nodes sorted by depth then choice.

    A choice such as [0, 1] means: the top-1 child of the root, then that node's 2nd-best child. Every prefix of
    a choice must itself be a choice.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for p in paths:
        if p[:-1] not in index:
            raise ValueError(f"tree choice {list(p)} has no parent choice {list(p[:-1])}")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return torch.tensor(parents), torch.tensor(ranks)
