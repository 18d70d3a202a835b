"""Distributions and acceptance: greedy tokens and matching, and lossless rejection sampling over chains and trees.

Paper notation: p is the target, q the draft. `process` turns logits into the sampling distribution (temperature,
top-k, top-p), applied alike to p and q. `accept_greedy` keeps the deepest node whose root path agrees with the
target's argmax. `accept_sampled` walks the tree from the root with recursive rejection sampling: the children of
a node are tried in the order they were drawn; child c_i, drawn from q_i (q without the siblings drawn before it,
renormalised; a point mass when the drafts were deterministic top-k), is accepted with probability
min(1, p(c_i) / q_i(c_i)); on rejection p becomes norm(max(0, p - q_i)). When no child is accepted the next token
is drawn from what is left of p, so every emitted token is distributed exactly as the target's (Leviathan et al.
2023; Chen et al. 2023; the multi-candidate form as in SpecInfer).
A prompt-lookup child (a token fixed by the text, not drawn from q) is tried first as a point mass: accepted with
probability p(x), else x leaves p. The drafted children then face what is left of p as usual; each step hands the
next one exactly the distribution it must reproduce, so the node's emitted token still follows p.
"""

from __future__ import annotations

import torch

from eagle import TargetModel


def process(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering; rows of `logits` are independent."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # drop a token when the mass strictly before it (largest first) already reaches top_p; the top token always
        # stays. Every token past the k largest is dropped once their mass reaches top_p, so the k largest are
        # enough: the 64 largest, else the 1,024 largest, else all (sorting all 49,152 of SmolLM2's took 2.8 ms a row,
        # the 64 largest 0.1)
        for k in (64, 1024, probs.shape[-1]):
            if k >= probs.shape[-1]:  # a flat distribution: all of them
                sorted_p, order = probs.sort(dim=-1, descending=True)
            else:
                sorted_p, order = probs.topk(k, dim=-1)
            mass = sorted_p.cumsum(-1)
            if bool((mass[..., -1] >= top_p).all()):
                break
        kept = sorted_p.masked_fill(mass - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, kept)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def uniform(shape, generator: torch.Generator | None, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform draws in [0, 1) of `shape` on `device`, taken from `generator` on its own device (so a CPU generator
    serves CUDA tensors and the other way round; None: the global generator of `device`)."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=where, dtype=dtype).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from `probs` [V] (non-negative, not necessarily normalized) by inverting its cumulative sum in
    float64: a uniform u picks the first token whose cumulative mass exceeds u times the total, so a token of zero
    probability is never drawn. The distribution of `torch.multinomial`, at a fraction of its cost over SmolLM2's
    49,152 tokens (0.05 against 0.85 ms: it draws a random number per token)."""
    c = probs.double().cumsum(-1)
    i = int(torch.searchsorted(c, uniform(1, generator, c.device, torch.float64) * c[-1], right=True))
    return i if i < c.shape[-1] else int((probs > 0).nonzero()[-1])  # u * total rounded up to the total


def gumbel_top(logq: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    """m draws without replacement from softmax(logq), in the order drawn (the Gumbel-top-k trick); [..., m]."""
    u = uniform(logq.shape, generator, logq.device).clamp_(1e-20, 1.0)
    keys = logq.float() - torch.log(-torch.log(u))
    return keys.topk(m, dim=-1).indices


def greedy_tokens(model: TargetModel, feats: torch.Tensor, screen=None) -> torch.Tensor:
    """`model`'s greedy tokens for features [..., hidden]: through `screen` (the CPU backend's `Screen` of its
    lm_head: the same tokens, bit for bit, reading a quarter of the bytes) where it takes these rows, else the argmax
    of the logits."""
    best = None if screen is None else screen.argmax(feats)
    return best if best is not None else model.logits(feats).argmax(-1)


def accept_greedy(tokens: torch.Tensor, predicted: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> int:
    """Deepest node whose whole root path agrees with the target's argmax (the first such node at that depth);
    returns its index (0: none accepted). In Python lists: a round's tree has a few nodes, and each torch op costs
    more than the whole walk. The tensors are on the CPU (the caller's copy of the target's argmax there is the
    round's one host sync)."""
    tok, pred, par, dep = tokens.tolist(), predicted.tolist(), parents.tolist(), depth.tolist()
    ok, best = [True] * len(tok), 0
    for i in range(1, len(tok)):  # parents[i] < i: a node's path is settled once its parent's is
        ok[i] = ok[par[i]] and tok[i] == pred[par[i]]
        if ok[i] and dep[i] > dep[best]:
            best = i
    return best


def accept_sampled(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                   generator: torch.Generator | None, lookup: torch.Tensor | None = None,
                   drafted: torch.Tensor | None = None) -> tuple[int, int]:
    """Recursive rejection sampling down the tree. `p[n]` is the target's distribution after node n, `q[n]` the
    draft distribution node n's children were drawn from, in drawing order (None: deterministic drafts, a point
    mass each). `lookup` [N] marks the prompt-lookup chain's nodes (each tried first among its siblings, as a point
    mass), `drafted` [N] the nodes the draft drew (None: all). Returns (deepest accepted node, the token the target
    emits after it)."""
    children: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for n, par in enumerate(parents.tolist()[1:], start=1):
        if drafted is None or drafted[n]:
            children.setdefault(par, []).append(n)
        if lookup is not None and lookup[n]:
            first[par] = n
    node = 0
    while True:
        nxt = _try_children(node, first.get(node), children.get(node, []), tokens, p[node].clone(),
                            None if q is None else q[node].clone(), generator)
        if isinstance(nxt, tuple):
            return nxt
        node = nxt


def _try_children(node, first, kids, tokens, p_left, q_left, generator):
    """One node's recursive rejection: the accepted child's index, or (node, token drawn from what is left of p).
    `first`: a point-mass child tried before the drafted `kids` (None: none)."""
    if first is not None:
        x = int(tokens[first])
        if float(uniform((), generator, p_left.device)) < float(p_left[x]):
            return first
        p_left[x] = 0.0
        p_left /= p_left.sum()
    for c in kids:
        x = int(tokens[c])
        if q_left is None:  # a point mass on x: accept with probability p(x)
            q_x, residual = 1.0, None
        else:
            mass = q_left.sum()
            q_x = float(q_left[x] / mass) if mass > 0 else 0.0
            if q_x == 0.0:  # more children asked for than q has tokens: the rest were never drawn from q
                break
            residual = q_left / mass
        u = float(uniform((), generator, p_left.device))
        if u * q_x < float(p_left[x]):
            return c
        if residual is None:
            p_left[x] = 0.0
        else:
            p_left = (p_left - residual).clamp_(min=0.0)
            q_left[x] = 0.0  # the next sibling was drawn without x
        p_left /= p_left.sum()
    return node, sample(p_left, generator)
