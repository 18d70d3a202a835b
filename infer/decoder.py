"""Speculative decoding with an EAGLE head: draft, verify in one target pass, accept, reuse the KV caches.

    from infer import SpeculativeDecoder
    dec = SpeculativeDecoder.from_pretrained("smollm2-135m", "runs/demo/head", num_speculative_tokens=4)
    out = dec.generate("Tell me about owls.", max_new_tokens=128)
    print(out.text, out.tau, out.accept_lengths)

    for tokens in dec.stream("Tell me about owls."):   # new tokens after every round
        ...

`dec.generate(..., speculative=False)` is the plain autoregressive baseline on the same engine.
Paper notation: p is the target, q the draft. The draft is a tree of parent indices; a chain is one tree.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from eagle import EagleHead, HeadCache, TargetModel, load_target
from eagle.fastlinear import disable_fast_linear, enable_fast_linear, fast_linear_enabled
from infer import tree
from infer.cache import TargetCache


@dataclass
class DecodeConfig:
    num_speculative_tokens: int = 4
    max_new_tokens: int = 128
    # chat template for string prompts ("auto": the target's own when it has one, else the raw text)
    chat_template: str = "auto"
    # on CPU, run the target's and the head's linear layers through the measured matmul layouts (eagle.fastlinear)
    fast_linear: bool = True


@dataclass
class GenerateOutput:
    token_ids: list[int]  # new tokens only, the stop token included, nothing after it
    text: str
    prompt_len: int
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round, bonus token excluded
    stop_reason: str = ""  # "eos" | "max_new_tokens" | "context_length"
    prefill_s: float = 0.0  # the prompt's forward pass, up to the first new token
    draft_s: float = 0.0
    verify_s: float = 0.0  # verification passes, with acceptance and cache compaction
    total_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens emitted per target verification pass (accepted drafts + 1)."""
        return (sum(self.accept_lengths) + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s else 0.0


def verify_mask(prefix_len: int, node_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, prefix + N] additive mask: every node sees the whole prefix and its own ancestors."""
    n = node_mask.shape[0]
    allowed = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), node_mask], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def accept_greedy(tokens: torch.Tensor, predicted: torch.Tensor, parents: torch.Tensor,
                  node_mask: torch.Tensor, depth: torch.Tensor) -> int:
    """Deepest node whose whole root path agrees with the target's argmax; returns its index (0: none accepted)."""
    match = torch.ones_like(tokens, dtype=torch.bool)
    match[1:] = tokens[1:] == predicted[parents[1:]]
    path_ok = ~(node_mask & ~match[None]).any(-1)
    return int(torch.where(path_ok, depth, -1).argmax().item())  # the round's one host sync


class SpeculativeDecoder:
    def __init__(self, target: TargetModel, head: EagleHead | None, config: DecodeConfig | None = None,
                 proposer=None):
        self.target, self.head = target, head
        self.config = config or DecodeConfig()
        if head is not None:
            head.attach(target)
        self.proposer = proposer or (EagleProposer(head) if head is not None else None)

    def _use_fast_linear(self, on: bool) -> None:
        """Patch (or restore) the linear layers of the target and the head in place; the first call on a machine
        calibrates for a few seconds (eagle.fastlinear)."""
        for model in (self.target.model, self.head):
            if model is None:
                continue
            if on and self.target.device.type == "cpu" and not fast_linear_enabled(model):
                enable_fast_linear(model, run=self._calibration_pass if model is self.target.model else None)
            elif not on and fast_linear_enabled(model):
                disable_fast_linear(model)

    @classmethod
    def from_pretrained(cls, target: str | TargetModel, draft: str | EagleHead | None = None,
                        device: str = "cpu", dtype: torch.dtype = torch.float32, **config) -> "SpeculativeDecoder":
        if isinstance(target, str):
            target = load_target(target, device=device, dtype=dtype)
        if isinstance(draft, str):
            draft = EagleHead.from_pretrained(draft, device=target.device, dtype=target.dtype)
        return cls(target, draft, DecodeConfig(**config))

    @torch.inference_mode()
    def _calibration_pass(self, rows: int, context: int = 128) -> float:
        """Seconds of one verification-sized target pass: `rows` new tokens after `context` cached ones."""
        t, cache = self.target, TargetCache()
        ids = torch.arange(context + rows, device=t.device)[None] % t.vocab_size
        t.features(ids[:, :context], position_ids=torch.arange(context, device=t.device)[None], cache=cache.hf)
        t0 = time.perf_counter()
        feats = t.features(ids[:, context:], position_ids=torch.arange(context, context + rows, device=t.device)[None],
                           cache=cache.hf)
        t.logits(feats[0]).argmax(-1)
        return time.perf_counter() - t0

    # -- prompts -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        tok = self.target.tokenizer
        if self.config.chat_template == "auto" and tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return tok(text, add_special_tokens=False).input_ids
        return tok(prompt).input_ids

    # -- public API ----------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None, speculative: bool = True,
                 **config) -> GenerateOutput:
        stream = self.stream(prompt, max_new_tokens, speculative, **config)
        while True:
            try:
                next(stream)
            except StopIteration as stop:
                return stop.value

    def stream(self, prompt: str | list[int], max_new_tokens: int | None = None, speculative: bool = True,
               **config):
        """Yield the new tokens of every round; the generator's return value is the GenerateOutput."""
        cfg = dataclasses.replace(self.config, **config)
        if max_new_tokens is not None:
            cfg.max_new_tokens = max_new_tokens
        if speculative and self.proposer is None:
            raise ValueError("speculative decoding needs a draft head; pass draft=... or speculative=False")
        self._use_fast_linear(cfg.fast_linear)
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        out = GenerateOutput(token_ids=[], text="", prompt_len=len(prompt_ids))
        eos = set(self.target.eos_ids)
        limit = min(cfg.max_new_tokens, self.target.max_length - len(prompt_ids))
        t0 = time.perf_counter()
        rounds = self._speculate(prompt_ids, cfg, out) if speculative else self._autoregressive(prompt_ids)
        out.stop_reason = "context_length" if limit < cfg.max_new_tokens else "max_new_tokens"
        for new in rounds:
            take = new[: limit - len(out.token_ids)]
            hit = next((i for i, t in enumerate(take) if t in eos), None)
            if hit is not None:
                take, out.stop_reason = take[: hit + 1], "eos"
            out.token_ids += take
            if take:
                yield take
            if hit is not None or len(out.token_ids) >= limit:
                break
        rounds.close()
        out.total_s = time.perf_counter() - t0
        out.text = self.target.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out

    # -- engines -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _autoregressive(self, prompt_ids: list[int]):
        """Plain greedy decoding with the KV cache: the baseline."""
        t, cache = self.target, TargetCache()
        ids = torch.tensor([prompt_ids], device=t.device)
        pos = torch.arange(ids.shape[1], device=t.device)[None]
        while True:
            feats = t.features(ids, position_ids=pos, cache=cache.hf)
            ids = t.logits(feats[:, -1:]).argmax(-1)
            pos = pos[:, -1:] + 1
            yield [int(ids.item())]

    @torch.inference_mode()
    def _speculate(self, prompt_ids: list[int], cfg: DecodeConfig, out: GenerateOutput):
        """The verify loop: 1 prefill, 2 draft, 3 verify with the tree mask, 4 accept, 5 compact and advance."""
        t, q, dev = self.target, self.proposer, self.target.device
        cache = TargetCache()
        q.reset()
        parents = tree.chain(cfg.num_speculative_tokens)
        node_mask, depth = tree.ancestor_mask(parents), tree.depths(parents)
        node_depth = depth.to(dev)[None]
        # 1. prefill: the target reads the prompt and emits the root, the first new token
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=dev)
        L = ids.shape[1]
        feats = t.features(ids, position_ids=torch.arange(L, device=dev)[None], cache=cache.hf)
        root = t.logits(feats[:, -1]).argmax(-1)
        out.prefill_s = time.perf_counter() - t0
        yield [int(root.item())]
        pair_feats, pair_tokens = feats, torch.cat([ids[:, 1:], root[:, None]], dim=1)
        while True:
            # 2. draft: catch the head up on the accepted tokens, then extend the chain
            t1 = time.perf_counter()
            drafts = q.propose(pair_feats, pair_tokens, cfg.num_speculative_tokens)
            tokens = torch.cat([root[:, None], drafts], dim=1)
            # 3. verify every node in one target pass; node i sits at position L + depth(i)
            t2 = time.perf_counter()
            mask = verify_mask(L, node_mask, feats.dtype).to(dev)
            feats = t.features(tokens, position_ids=L + node_depth, attention_mask=mask, cache=cache.hf)
            p_argmax = t.logits(feats[0]).argmax(-1)
            # 4. accept the deepest agreeing path, plus the target's own token after it
            best = accept_greedy(tokens[0].cpu(), p_argmax.cpu(), parents, node_mask, depth)
            path = tree.path_to(node_mask, best)
            out.accept_lengths.append(int(depth[best]))
            root = p_argmax[best].view(1)
            # 5. keep only the accepted path in both caches; the head resumes from the target's features
            cache.compact(L, path)
            q.rollback(L)
            L += path.shape[0]
            pair_feats = feats[:, path.to(dev)]
            pair_tokens = torch.cat([tokens[:, path[1:].to(dev)], root[:, None]], dim=1)
            t3 = time.perf_counter()
            out.draft_s += t2 - t1
            out.verify_s += t3 - t2
            yield pair_tokens[0].tolist()


class EagleProposer:
    """Drafts with an EAGLE head and its own KV cache (one entry per committed (feature, next token) pair)."""

    def __init__(self, head: EagleHead):
        self.head, self.cache = head, HeadCache()

    def reset(self) -> None:
        self.cache = HeadCache()

    def rollback(self, n: int) -> None:
        """Forget everything past the first n pairs: the drafted entries of the last round."""
        self.cache.crop(n)

    def propose(self, feats: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Read the newly committed (feature, next token) pairs, then draft a chain of k tokens greedily; [1, k]."""
        head, start = self.head, self.cache.length
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        h = head(feats, tokens, pos, cache=self.cache)[:, -1:]
        drafts = []
        for i in range(k):
            q_argmax = head.to_target_ids(head.logits(h).argmax(-1))  # [1, 1]
            drafts.append(q_argmax)
            if i + 1 < k:
                pos = torch.tensor([[self.cache.length]], device=tokens.device)
                h = head(h, q_argmax, pos, cache=self.cache)
        return torch.cat(drafts, dim=1)
