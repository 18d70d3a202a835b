"""Proposers: what drafts a round's tree. The EAGLE head drafts chains, static trees and EAGLE-2 dynamic trees.

Contract (as in transformers' candidate generators): `reset(prompt_ids)`, `rollback(n)` and
`propose(feats, tokens, cfg, generator) -> Draft`, where `feats[t]` / `tokens[t]` are the newly committed
(target feature, next token) pairs and `tokens[:, -1]` is the root, the last emitted token; `rollback(n)` keeps
the first n pairs (the committed text's first n + 1 tokens, the root included) and forgets the drafts.

Shapes of the draft, all one code path (levels of nodes expanded with the head's own KV cache, one head pass per
level with a tree attention mask):
- chain: k levels of one node;
- static: EAGLE-1 / Medusa choice lists, converted to parents by `tree.from_choices`; node rank r is the parent's
  r-th best token (greedy) or its r-th draw without replacement from q (sampling);
- dynamic (EAGLE-2): `depth` levels; each level expands the `top_k` nodes of best cumulative log q, each into its
  `top_k` best children; the `total_tokens - 1` best nodes of all levels are kept. With sampling the drafts stay
  deterministic (top-k), which is lossless with a point-mass q: choosing nodes by the values of sampled children
  would bias them.

A draft model (`ModelProposer`: any small causal LM with the target's tokenizer, as in Leviathan et al. 2023
and transformers' assisted generation) drafts a chain, token by token, with its own KV cache.

Prompt lookup (`LookupProposer`, the n-gram drafts of transformers' `prompt_lookup_num_tokens` and vLLM's ngram
proposer) drafts the tokens that followed the latest earlier occurrence of the text's last n tokens. Alone it
drafts a chain; around an EAGLE proposer its chain joins the head's tree as one more branch from the root, sharing
the nodes it agrees with, so a round accepts the longer of the two. Small targets repeat themselves (lists, code,
loops), where the head's few-token chains stop short and a lookup continues.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import cpu_backend
from eagle import EagleHead, HeadCache, TargetModel
from infer import tree
from infer.cache import TargetCache
from infer.sampling import greedy_tokens, gumbel_top, process, sample


@dataclass
class Draft:
    tokens: torch.Tensor             # [N] target token ids; node 0 is the root
    parents: torch.Tensor            # [N] parent indices, parents[0] == -1, siblings in drawing order
    q: torch.Tensor | None = None    # [N, V] the distribution node n's children were drawn from (None: point mass)
    node_mask: torch.Tensor | None = None  # tree.ancestor_mask(parents), derived unless a fixed tree supplies it
    depth: torch.Tensor | None = None      # tree.depths(parents), likewise
    lookup: torch.Tensor | None = None     # [N] bool: nodes of a merged prompt-lookup chain (a point mass each)
    drafted: torch.Tensor | None = None    # [N] bool: nodes the proposer drew (None: all of them)

    def __post_init__(self):
        if self.node_mask is None:
            self.node_mask = tree.ancestor_mask(self.parents)
        if self.depth is None:
            self.depth = self.node_mask.sum(-1) - 1

    @classmethod
    def chain(cls, root: torch.Tensor, drafts: torch.Tensor) -> "Draft":
        return cls(torch.cat([root.view(1), drafts.view(-1)]), tree.chain(drafts.numel()))


def load_choices(spec) -> list[list[int]]:
    """Static-tree choices from a list, a JSON string or a JSON file."""
    if isinstance(spec, (list, tuple)):
        return [list(c) for c in spec]
    text = Path(spec).read_text() if not str(spec).lstrip().startswith("[") else str(spec)
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"tree {spec!r}: not a JSON list of choice paths ({e})") from None
    if not isinstance(choices, list) or not all(isinstance(c, list) and c for c in choices):
        raise ValueError(f"tree {spec!r}: expected a JSON list of non-empty lists such as [[0], [1], [0, 0]]")
    return choices


@dataclass
class Level:
    """One depth of a fixed tree, with every index the drafting loop needs precomputed."""

    nodes: torch.Tensor        # the nodes at this depth
    rows: torch.Tensor         # each node's parent, as a row of the previous level's expanded nodes (the frontier)
    rank: torch.Tensor         # greedy: which best token of its parent each node takes
    draw: torch.Tensor         # sampling: which draw without replacement (rank order among its siblings)
    need_rank: int
    need_draw: int
    expand: torch.Tensor       # nodes at this depth with children of their own: the next frontier
    expand_parent_rows: torch.Tensor  # their parents' rows in the frontier (whose hidden states they read)
    anc: torch.Tensor          # [len(expand), slots] drafted ancestors' head-cache slots (past the committed pairs)


@dataclass
class FixedPlan:
    parents: torch.Tensor
    root: torch.Tensor
    levels: list[Level]
    node_mask: torch.Tensor  # of the whole tree, the same every round
    depth: torch.Tensor

    @classmethod
    def build(cls, parents: torch.Tensor, ranks: torch.Tensor) -> "FixedPlan":
        """Precompute the per-level indices of a chain or static tree. Expanded nodes take head-cache slots in
        expansion order, so every level's attention mask is known in advance."""
        depth = tree.depths(parents)
        has_children = torch.zeros(parents.shape[0], dtype=torch.bool)
        has_children[parents[1:]] = True
        slot = torch.full((parents.shape[0],), -1, dtype=torch.long)
        anc = torch.zeros(parents.shape[0], int(has_children.sum()), dtype=torch.bool)
        levels, frontier, used = [], torch.tensor([0]), 0
        for d in range(1, int(depth.max()) + 1):
            nodes = (depth == d).nonzero().flatten()
            par = parents[nodes]
            rows = (par[:, None] == frontier[None]).int().argmax(-1)
            draw = torch.empty_like(nodes)
            for f in par.unique():  # rank order among siblings -> draw position
                sib = par == f
                draw[sib] = ranks[nodes[sib]].argsort().argsort()
            expand = nodes[has_children[nodes]]
            p_exp = parents[expand]
            anc[expand] = anc[p_exp]
            with_slot = slot[p_exp] >= 0
            anc[expand[with_slot], slot[p_exp[with_slot]]] = True
            slot[expand] = torch.arange(used, used + expand.shape[0])
            used += expand.shape[0]
            levels.append(Level(nodes, rows, ranks[nodes], draw, int(ranks[nodes].max()) + 1, int(draw.max()) + 1,
                                expand, rows[has_children[nodes]], anc[expand].clone()))
            frontier = expand
        return cls(parents, torch.tensor([0]), levels, tree.ancestor_mask(parents), depth)


class EagleProposer:
    """Drafts with an EAGLE head and its own KV cache (one entry per committed (feature, next token) pair)."""

    def __init__(self, head: EagleHead):
        self.head, self.cache = head, HeadCache()
        # greedy drafts through the CPU backend's screen (`cpu_backend.Screen`, and greedy chains in C through
        # `cpu_backend.greedy_chain`): set by the decoder for each decoding, with the backend on
        self.screen = False
        self._plans: dict = {}  # FixedPlan of each chain length or static tree drafted so far (copies share it)
        self._steps = None  # the backend's drafting steps in C: None until built, False: none fit
        self._draft_screen = None  # the Screen of the head's draft rows: None until built, False: none fits

    def reset(self, prompt_ids: list[int] | None = None) -> None:
        self.cache = HeadCache()
        self._steps = self._draft_screen = None  # built again when first asked: the kernel settings may have changed

    def rollback(self, n: int) -> None:
        """Forget everything past the first n pairs: the drafted entries of the last round."""
        self.cache.crop(n)

    @torch.inference_mode()
    def propose(self, feats: torch.Tensor, tokens: torch.Tensor, cfg, generator=None) -> Draft:
        steps = self._greedy_steps(feats, tokens)
        if cfg.mode == "chain" and cfg.temperature <= 0:
            return self._greedy_chain(feats, tokens, cfg, steps if self.screen else None)
        if steps:  # the same C calls as the modules' forward, without their Python
            steps.read(self.cache, feats[0].contiguous(), tokens[0])
            h_root = steps.feature(tokens.shape[1]).clone()
        else:
            start = self.cache.length
            pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
            h_root = self.head(feats, tokens, pos, cache=self.cache)[0, -1:]  # predicts the root's feature
        if cfg.mode == "dynamic":
            return self._dynamic(h_root, tokens[0, -1], cfg)
        sampling = cfg.temperature > 0
        return self._fixed(h_root, tokens[0, -1], self._fixed_plan(cfg), cfg, generator if sampling else None)

    def _greedy_chain(self, feats: torch.Tensor, tokens: torch.Tensor, cfg, steps) -> Draft:
        """k greedy drafts in a chain. Each step reads pairs into the head's cache (first the new committed pairs,
        then the feature predicted last with the token drafted from it) and drafts the best token after the last
        one: through the backend's steps where given (`GreedySteps.step`: the read and the screen's argmax in C),
        else through the head's modules (`_step`): the same bits, the former without the modules' Python."""
        step, feature = (steps.step, steps.feature) if steps is not None else (self._step, self._feature)
        f, t, drafted = feats[0].contiguous(), tokens[0], [tokens[0, -1:]]
        for d in range(cfg.num_speculative_tokens):
            if d:
                f, t = feature(t.shape[0]), drafted[-1]
            drafted.append(step(self.cache, f, t))
        plan = self._fixed_plan(cfg)
        return Draft(torch.cat(drafted), plan.parents, None, plan.node_mask, plan.depth)

    def _step(self, cache: HeadCache, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`GreedySteps.step` through the head's modules: pairs (feats [T, H], tokens [T]) read into `cache` after
        what it holds, causal over them, and the greedy draft after the last one ([1], a target id; the screen's
        argmax where it applies); the predicted feature kept for `_feature`."""
        start = cache.length
        pos = torch.arange(start, start + tokens.shape[0], device=tokens.device)[None]
        self._h = h = self.head(feats[None], tokens[None], pos, cache=cache)[0, -1:]
        best = self._screened_argmax(h)
        if best is None:
            best = self._logq(h).topk(1, dim=-1).indices[:, 0]
        return self.head.to_target_ids(best)

    def _feature(self, rows: int) -> torch.Tensor:
        """The feature `_step` predicted after its last pair, [1, H]."""
        return self._h

    # -- helpers -------------------------------------------------------------------------------------------
    def _fixed_plan(self, cfg) -> "FixedPlan":
        if cfg.mode not in ("chain", "static"):
            raise ValueError(f"mode {cfg.mode!r}: expected chain, static or dynamic")
        key = ("chain", cfg.num_speculative_tokens) if cfg.mode == "chain" else ("static", str(cfg.tree))
        if key not in self._plans:
            if cfg.mode == "chain":
                k = cfg.num_speculative_tokens
                parents, ranks = tree.chain(k), torch.zeros(k + 1, dtype=torch.long)
            else:
                parents, ranks = tree.from_choices(load_choices(cfg.tree))
            self._plans[key] = FixedPlan.build(parents, ranks)
        return self._plans[key]

    def _greedy_steps(self, feats: torch.Tensor, tokens: torch.Tensor):
        """The backend's drafting steps in C for this head and these new pairs (None where its modules would not run
        them: the backend off, more rows than a step reads, other dtypes or devices, sampling heads, ...)."""
        if tokens.shape[1] > cpu_backend.PREFILL_ROWS or feats.dtype != torch.float32 or not feats.is_cpu:
            return None
        if self._steps is None:
            self._steps = cpu_backend.greedy_chain(self.head) or False
        return self._steps or None

    def _logq(self, h: torch.Tensor, cfg=None) -> torch.Tensor:
        """log q over the draft vocabulary for each row of h, shaped like the sampling distribution p (greedy drafts:
        no `cfg`, or its temperature 0)."""
        logits = self.head.logits(h)
        if cfg is not None and cfg.temperature > 0:
            return process(logits, cfg.temperature, cfg.sampling_top_k, cfg.top_p).log()
        return torch.log_softmax(logits.float(), dim=-1)

    def _screened_argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """The draft-vocabulary argmax of each row of h through the backend's int8 screen (`cpu_backend.Screen`: the
        argmax of the kernel's logits, bit for bit, for about a quarter of the draft lm_head's bytes) where it applies:
        greedy drafts (the callers ask only for them) with `screen` on, an EAGLE-1/2 head without soft-capping whose
        logits the fast path multiplies in the kernel for this many rows; else None."""
        if not self.screen:
            return None
        if self._draft_screen is None:
            head = self.head
            fits = head.config.head_type == "eagle1" and not head.config.logit_softcap and head.lm_head is not None
            self._draft_screen = (fits and cpu_backend.Screen.of(head.lm_head, head.draft_lm_weight)) or False
        return self._draft_screen.argmax(h) if self._draft_screen else None

    def _extend(self, h_parent: torch.Tensor, token: torch.Tensor, depth: int, anc_slots: torch.Tensor,
                committed: int) -> torch.Tensor:
        """One head pass over new nodes (one row each): inputs are the parent's predicted feature and the node's
        token; node i sees the committed pairs, its drafted ancestors (`anc_slots[i]`, head-cache slots past
        `committed`) and itself. Returns their predicted features [n, H]."""
        n, start = token.shape[0], self.cache.length
        mask = torch.zeros(n, start + n, dtype=torch.bool, device=token.device)
        mask[:, :committed] = True
        mask[:, committed:start] = anc_slots[:, : start - committed]
        mask[:, start:] = torch.eye(n, dtype=torch.bool, device=token.device)
        pos = torch.full((1, n), committed - 1 + depth, device=token.device)
        return self.head(h_parent[None], token[None], pos, cache=self.cache, mask=mask)[0]

    def _fixed(self, h_root, root, plan: "FixedPlan", cfg, generator) -> Draft:
        """Chain or static tree: level by level, each node's token is its parent's rank-th choice (greedy) or its
        rank-th draw without replacement (sampling); one head pass per level over the nodes that have children."""
        head, committed = self.head, self.cache.length
        toks = torch.empty(plan.parents.shape[0], dtype=torch.long, device=root.device)
        toks[0] = root
        q_rows = torch.zeros(plan.parents.shape[0], head.config.vocab_size) if generator is not None else None
        h_front, front = h_root, plan.root
        for d, lv in enumerate(plan.levels, start=1):
            greedy = generator is None and cfg.temperature <= 0 and lv.need_rank == 1
            best = self._screened_argmax(h_front) if greedy else None
            if best is not None:
                chosen = best[lv.rows]
            elif generator is None:
                chosen = self._logq(h_front, cfg).topk(lv.need_rank, dim=-1).indices[lv.rows, lv.rank]
            else:
                logq = self._logq(h_front, cfg)  # [frontier, Vd]
                chosen = gumbel_top(logq, lv.need_draw, generator)[lv.rows, lv.draw]
                q_rows[front] = self._to_target_probs(logq.exp())
            toks[lv.nodes] = head.to_target_ids(chosen)
            if lv.expand.numel():
                h_front = self._extend(h_front[lv.expand_parent_rows], toks[lv.expand], d, lv.anc, committed)
            front = lv.expand
        return Draft(toks, plan.parents, q_rows, plan.node_mask, plan.depth)

    def _dynamic(self, h_root, root, cfg) -> Draft:
        """EAGLE-2: expand the top_k best frontier nodes for `depth` levels, keep the total_tokens best nodes."""
        head, committed, k = self.head, self.cache.length, cfg.top_k
        dev = root.device
        # every candidate node: token (draft id), parent (candidate index, -1 = root), cumulative log q
        cand_tok, cand_par, cand_score = [], [], []
        front_h, front_idx = h_root, torch.tensor([-1])
        front_score = torch.zeros(1)
        front_anc = torch.zeros(1, max(1, k * cfg.depth), dtype=torch.bool)
        n_cand = 0
        for d in range(1, cfg.depth + 1):
            logq = self._logq(front_h, cfg)  # [f, Vd]
            top = logq.topk(k, dim=-1)
            scores = (front_score[:, None] + top.values.cpu()).flatten()  # [f * k]
            tok = top.indices.flatten()
            par = front_idx.repeat_interleave(k)
            rows = torch.arange(front_idx.shape[0]).repeat_interleave(k)
            cand_tok.append(tok)
            cand_par.append(par)
            cand_score.append(scores)
            new_idx = torch.arange(n_cand, n_cand + tok.shape[0])
            n_cand += tok.shape[0]
            if d == cfg.depth:
                break
            best = scores.topk(min(k, scores.shape[0])).indices  # the next frontier
            anc = front_anc[rows[best]].clone()
            used = self.cache.length - committed
            if d > 1:  # the parents (previous frontier) occupy slots used - f .. used - 1
                anc[torch.arange(best.shape[0]), used - front_idx.shape[0] + rows[best]] = True
            front_h = self._extend(front_h[rows[best]], head.to_target_ids(tok[best]), d, anc, committed)
            front_idx, front_score, front_anc = new_idx[best], scores[best], anc
        tok, par, score = torch.cat(cand_tok), torch.cat(cand_par), torch.cat(cand_score)
        # keep the best total_tokens - 1 nodes; a child never scores above its parent, and ties go to the older
        # node, so the kept set is closed under parents
        keep_n = min(cfg.total_tokens - 1, score.shape[0])
        order = torch.argsort(-score, stable=True)[:keep_n].sort().values
        new_index = torch.full((score.shape[0] + 1,), -1, dtype=torch.long)  # shifted by one: -1 -> root
        new_index[0] = 0
        new_index[order + 1] = torch.arange(1, keep_n + 1)
        parents = torch.cat([torch.tensor([-1]), new_index[par[order] + 1]])
        if (parents[1:] < 0).any():
            raise RuntimeError("dynamic tree lost a parent")  # cannot happen: scores fall along every path
        tokens = torch.cat([root.view(1), head.to_target_ids(tok[order].to(dev))])
        return Draft(tokens, parents, None)

    def _to_target_probs(self, q_draft: torch.Tensor) -> torch.Tensor:
        """[n, Vd] draft-vocabulary probabilities -> [n, V] over the target vocabulary (zero outside the draft's)."""
        head = self.head
        if not head.config.draft_vocab_size:
            return q_draft.float().cpu()
        out = torch.zeros(q_draft.shape[0], head.config.vocab_size)
        out[:, head.d2t.cpu()] = q_draft.float().cpu()
        return out


class ModelProposer:
    """Drafts a chain of `num_speculative_tokens` with a small causal LM that shares the target's tokenizer: its
    greedy tokens, or draws from its distribution q (processed like p) when sampling. Its KV cache holds the
    committed text; the drafted entries are dropped after each round."""

    def __init__(self, model: TargetModel, target: TargetModel):
        if model.fingerprint != target.fingerprint:
            raise ValueError(f"draft model {model.name!r}: its tokenizer differs from the target's "
                             f"(fingerprint {model.fingerprint} vs {target.fingerprint})")
        self.model, self.vocab = model, target.vocab_size
        self.cache, self.text = TargetCache(), []
        self.screen = False  # greedy drafts through the CPU backend's screen: set by the decoder, backend on
        self._screen = None  # its Screen of the model's lm_head: None until built, False: none fits

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache, self.text = TargetCache(), list(prompt_ids)[:1]  # the pairs start at the second token
        self._screen = None

    def rollback(self, n: int) -> None:
        self.cache.crop(n + 1)

    @torch.inference_mode()
    def propose(self, feats: torch.Tensor, tokens: torch.Tensor, cfg, generator=None) -> Draft:
        if cfg.mode != "chain":
            raise ValueError(f"mode {cfg.mode!r}: a draft model drafts chains only (mode chain)")
        m, k = self.model, cfg.num_speculative_tokens
        self.text += tokens[0].tolist()
        start = len(self.cache)  # the committed text before this round's new tokens (the previous root included)
        ids = torch.tensor([self.text[start:]], device=m.device)
        drafts, q_rows = [], []
        for _ in range(k):
            pos = torch.arange(start, start + ids.shape[1], device=m.device)[None]
            h = m.features(ids, position_ids=pos, cache=self.cache.hf)[0, -1]
            if cfg.temperature <= 0:
                tok = self._greedy(h)
            else:
                q = process(m.logits(h)[: self.vocab][None], cfg.temperature, cfg.sampling_top_k, cfg.top_p)[0].cpu()
                q = torch.nn.functional.pad(q, (0, self.vocab - q.shape[0]))
                tok = sample(q, generator)
                q_rows.append(q)
            drafts.append(tok)
            start += ids.shape[1]
            ids = torch.tensor([[tok]], device=m.device)
        q = torch.cat([torch.stack(q_rows), torch.zeros(1, self.vocab)]) if q_rows else None
        return Draft(torch.tensor([tokens[0, -1].item()] + drafts, device=tokens.device), tree.chain(k), q)

    def _greedy(self, h: torch.Tensor) -> int:
        """The draft model's greedy token after features h [H], through the CPU backend's screen where it can
        (`screen` on, its vocabulary the target's)."""
        m = self.model
        if m.vocab_size == self.vocab:
            if self._screen is None:
                self._screen = (self.screen and not m.softcap and cpu_backend.Screen.of(m.lm_head)) or False
            return int(greedy_tokens(m, h.view(1, -1), self._screen or None)[0])
        return int(m.logits(h)[: self.vocab].argmax())


class NgramIndex:
    """The committed text and, for every n-gram in it (min_n <= n <= max_n), where the token after its latest
    occurrence sits. `draft(m)` continues the text's longest indexed suffix: the m tokens that followed it last
    time, running on into the draft itself where that occurrence is too recent (a loop shorter than m)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.text: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.text)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.after[tuple(self.text[i - n:])] = i
            self.text.append(t)

    def draft(self, m: int, extra: list[int] = ()) -> list[int]:
        """The m tokens after the longest indexed suffix of the text followed by `extra` (drafted tokens, not
        committed), or [] where no suffix of min_n or more tokens occurred before."""
        seq = self.text + list(extra) if extra else self.text
        L = len(seq)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            s = self.after.get(tuple(seq[L - n:]))
            if s is not None:
                out: list[int] = []
                for j in range(m):
                    out.append(seq[s + j] if s + j < L else out[s + j - L])
                return out
        return []


def merge_chain(draft: Draft, chain: list[int], start: int = 0, shapes: dict | None = None) -> Draft:
    """`draft` with `chain` added as a path below node `start` (the root by default): each token is a child of the
    one before it, reusing a node the draft already has for it. `lookup` marks the chain's nodes (and those of
    chains merged into `draft` before) and `drafted` the proposer's own, for sampling; new nodes get zero rows of q
    (their children, if any, are lookup nodes too). `shapes` (a dict the caller keeps) holds the tensors of each
    tree shape seen (parents, ancestor mask, depths, lookup and drafted marks) for the next draft of that shape:
    a drafting round repeats a few shapes, and making them costs more than the rest of the merge."""
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    child = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks))}  # (parent, token) -> node
    n0, node, on_chain = len(toks), start, []
    for t in chain:
        if (node, t) not in child:
            child[node, t] = len(toks)
            toks.append(t)
            pars.append(node)
        node = child[node, t]
        on_chain.append(node)
    new = len(toks) - n0  # (lists, then one tensor each: a drafting round is short of microseconds)
    lookup = (draft.lookup.tolist() if draft.lookup is not None else [False] * n0) + [False] * new
    for i in on_chain:
        lookup[i] = True
    drafted = (draft.drafted.tolist() if draft.drafted is not None else [True] * n0) + [False] * new
    key = (tuple(pars), tuple(lookup), tuple(drafted), n0)
    shape = shapes.get(key) if shapes is not None else None
    if shape is None:
        parents = torch.tensor(pars) if new else draft.parents
        if new:
            depth = draft.depth.tolist()
            for p in pars[n0:]:
                depth.append(depth[p] + 1)
            shape = (parents, tree.ancestor_mask(parents), torch.tensor(depth), torch.tensor(lookup),
                     torch.tensor(drafted))
        else:
            shape = (parents, draft.node_mask, draft.depth, torch.tensor(lookup), torch.tensor(drafted))
        if shapes is not None and len(shapes) < 4096:
            shapes[key] = shape
    parents, node_mask, depth, lookup, drafted = shape
    q = draft.q
    if not new:
        return Draft(draft.tokens, parents, q, node_mask, depth, lookup, drafted)
    if q is not None:
        q = torch.cat([q, q.new_zeros(new, q.shape[1])])
    return Draft(torch.tensor(toks, device=draft.tokens.device), parents, q, node_mask, depth, lookup, drafted)


class LookupProposer:
    """Prompt lookup drafts, alone (`inner=None`: a chain, empty when the text's suffix occurred nowhere before) or
    merged into the tree of an inner proposer (with sampling, each lookup node is tried as a point mass before its
    parent's drafted children: `sampling.accept_sampled`). Settings come from the decoding config:
    `prompt_lookup_num_tokens` drafted tokens (with `prompt_lookup_adaptive`, a length that follows the lookups'
    acceptance), suffixes of `prompt_lookup_max` down to `prompt_lookup_min` tokens."""

    def __init__(self, inner=None):
        self.inner = inner
        self.index: NgramIndex | None = None
        self._shapes: dict = {}  # merge_chain's tensors of each tree shape seen
        self.length: int | None = None  # the adaptive lookup length (None: prompt_lookup_num_tokens)
        self._last: list[list[int]] = []  # the last round's lookups, each as the tokens from the root to its end

    def __copy__(self) -> "LookupProposer":
        """A copy that drafts on its own (one per generation): its inner proposer copied too."""
        new = object.__new__(LookupProposer)
        new.__dict__.update(self.__dict__, inner=copy.copy(self.inner))
        return new

    def reset(self, prompt_ids: list[int] | None = None) -> None:
        self.index, self.length, self._last = None, None, []
        if self.inner is not None:
            self.inner.reset(prompt_ids)

    def rollback(self, n: int) -> None:
        if self.inner is not None:  # the index holds committed tokens only: nothing to forget
            self.inner.rollback(n)

    def propose(self, feats: torch.Tensor, tokens: torch.Tensor, cfg, generator=None) -> Draft:
        if self.index is None:
            self.index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        committed = tokens[0].tolist()
        self.index.extend(committed)
        m, adaptive = cfg.prompt_lookup_num_tokens, cfg.prompt_lookup_adaptive
        if adaptive:
            # the tokens committed since the last round, but for the target's own last one, are the drafts it took:
            # whole when one of the lookups is a prefix of them
            taken = any(seq == committed[:len(seq)] and len(committed) > len(seq) for seq in self._last)
            n = self.length or m
            self.length = n if not self._last else min(m, n + 2) if taken else max(1, n - 1)
            m = self.length
        chain = self.index.draft(m)
        self._last = [chain] if chain and adaptive else []  # kept for the next round only when adaptive
        if self.inner is None:
            return Draft.chain(tokens[0, -1], torch.tensor(chain, dtype=torch.long, device=tokens.device))
        draft = merge_chain(self.inner.propose(feats, tokens, cfg, generator), chain, shapes=self._shapes)
        if cfg.prompt_lookup_after_drafts and cfg.temperature <= 0:
            # lookups after the drafted path to each leaf of the proposer's own tree (a node below the root no
            # other node descends from), from that leaf on
            toks, node_mask = draft.tokens, draft.node_mask
            leaf = (node_mask.sum(0) == 1) & draft.drafted
            leaf[0] = False
            leaves = leaf.nonzero().flatten().tolist()
            for leaf in leaves:
                drafted = toks[tree.path_to(node_mask, leaf)[1:]].tolist()
                more = self.index.draft(m, drafted)
                if more:
                    draft = merge_chain(draft, more, start=leaf, shapes=self._shapes)
                    if adaptive:
                        self._last.append(drafted + more)
        return draft
