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

import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import cpu_backend
from cpu_backend import CPUConfig
from eagle import EagleHead, TargetModel, load_target
from eagle.attention import use_gqa_sdpa
from infer import tree
from infer.cache import TargetCache
from infer.proposer import Draft, EagleProposer, LookupProposer, ModelProposer, load_choices
from infer.sampling import accept_greedy, accept_sampled, greedy_tokens, process, sample


@dataclass
class DecodeConfig:
    mode: str = "chain"  # chain | static | dynamic (EAGLE-2)
    num_speculative_tokens: int = 4  # chain: drafted tokens per round
    tree: str = ""  # static: choice paths, a JSON list (or a file holding one) such as [[0], [1], [0, 0]]
    # dynamic-tree defaults: the fastest of a 36-setting sweep on this 2-core CPU (BENCHMARKS.md), where every
    # verified node costs time; on an accelerator larger trees (e.g. 8, 5, 32: tau 1.80 against 1.51) pay off
    top_k: int = 2  # dynamic: children per expanded node, and nodes expanded per level
    depth: int = 3  # dynamic: levels drafted per round
    total_tokens: int = 4  # dynamic: tree nodes verified per round, the root included
    # prompt lookup (n-gram) drafts: the prompt_lookup_num_tokens tokens that followed the latest earlier occurrence
    # of the text's last prompt_lookup_max .. prompt_lookup_min tokens, as one more branch of the head's tree
    # (sampling tries it first, as a point mass), or the whole draft without a head; 0: off (LookupProposer)
    prompt_lookup_num_tokens: int = 0
    prompt_lookup_min: int = 2  # 2-4 drafted more than 3-3 or 3-5 on 20 MT-bench prompts (tau 2.05 / 1.99 / 1.99)
    prompt_lookup_max: int = 4
    # greedy: also continue each leaf of the head's tree with a lookup of the text followed by the leaf's drafted path
    prompt_lookup_after_drafts: bool = False
    # the lookup's length follows its acceptance, as transformers' "heuristic" schedule of assistant tokens: from
    # prompt_lookup_num_tokens, 2 more after a round that accepted the whole lookup, 1 fewer after one that did not,
    # within 1 .. prompt_lookup_num_tokens (where each verified token costs time, unaccepted lookups are not free);
    # lookups after drafts take the same length, and a round that took one of them whole counts as taken
    prompt_lookup_adaptive: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy; > 0: lossless sampling from the target's distribution
    top_p: float = 1.0
    sampling_top_k: int = 0  # top-k filter of the sampling distribution (0: off); `top_k` shapes the tree
    seed: int | None = None  # sampling without a generator: seeds one (None: the global RNG)
    stop: list[str] = field(default_factory=list)  # stop strings: the output ends with the first one
    # chat template for string prompts: "auto" (the target's own; a target without one gets the raw text, said once),
    # "none" (the raw text), a file holding a Jinja template, or the template itself (a string with {{ or {%)
    chat_template: str = "auto"


@dataclass
class GenerateOutput:
    token_ids: list[int]  # new tokens only, the stop token included, nothing after it
    text: str
    prompt_len: int
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round, bonus token excluded
    stop_reason: str = ""  # "eos" | "stop_string" | "max_new_tokens" | "context_length"
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


def check_config(c: DecodeConfig) -> None:
    """One-line errors for decoding settings that cannot work."""
    problems = []
    if c.max_new_tokens < 1:
        problems.append(f"max_new_tokens {c.max_new_tokens} must be at least 1")
    if c.mode not in ("chain", "static", "dynamic"):
        problems.append(f"mode {c.mode!r} is not chain, static or dynamic")
    if c.mode == "chain" and c.num_speculative_tokens < 1:
        problems.append(f"num_speculative_tokens {c.num_speculative_tokens} must be at least 1")
    if c.mode == "static" and not c.tree:
        problems.append("mode static needs a tree (a JSON list of choice paths, or a file holding one)")
    elif c.mode == "static":
        try:
            load_choices(c.tree)
        except OSError as e:
            problems.append(f"tree {c.tree!r}: cannot read it ({e.strerror or e})")
        except ValueError as e:
            problems.append(str(e))
    if c.mode == "dynamic" and (c.top_k < 1 or c.depth < 1 or c.total_tokens < 2):
        problems.append(f"dynamic tree needs top_k >= 1, depth >= 1, total_tokens >= 2 "
                        f"(got {c.top_k}, {c.depth}, {c.total_tokens})")
    if c.prompt_lookup_num_tokens < 0 or not 1 <= c.prompt_lookup_min <= c.prompt_lookup_max:
        problems.append(f"prompt lookup needs prompt_lookup_num_tokens >= 0 and 1 <= prompt_lookup_min <= "
                        f"prompt_lookup_max (got {c.prompt_lookup_num_tokens}, {c.prompt_lookup_min}, "
                        f"{c.prompt_lookup_max})")
    if c.prompt_lookup_adaptive and c.prompt_lookup_num_tokens == 0:
        problems.append("prompt_lookup_adaptive needs prompt_lookup_num_tokens > 0 (the longest lookup)")
    if c.temperature < 0 or not 0 < c.top_p <= 1 or c.sampling_top_k < 0:
        problems.append(f"sampling needs temperature >= 0, 0 < top_p <= 1, sampling_top_k >= 0 "
                        f"(got {c.temperature}, {c.top_p}, {c.sampling_top_k})")
    try:
        chat_template_text(c.chat_template)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError("decoding config: " + "; ".join(problems))


RAW_TEXT = ("none", "raw")  # chat_template values that mean: the prompt's text as it is


def chat_template_text(spec: str) -> str | None:
    """The Jinja template that `chat_template` names: None for "auto" (the target's own) and "none" / "raw" (no
    template), a file's text, or `spec` itself when it is a template ({{ or {%)."""
    if spec in ("auto", *RAW_TEXT):
        return None
    path = Path(spec).expanduser() if spec and "{" not in spec else None
    if path is not None and path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template {spec!r}: cannot read the file ({e})") from None
    elif "{{" in spec or "{%" in spec:
        text = spec
    else:
        raise ValueError(f"chat_template {spec!r} is not auto, none, a template file or a Jinja template"
                         + (" (it is a directory)" if path is not None and path.is_dir() else ""))
    return text


def verify_mask(prefix_len: int, node_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, prefix + N] additive mask: every node sees the whole prefix and its own ancestors."""
    n = node_mask.shape[0]
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype)
    mask[0, 0, :, prefix_len:].masked_fill_(~node_mask, torch.finfo(dtype).min)
    return mask


class SpeculativeDecoder:
    def __init__(self, target: TargetModel, head: EagleHead | None, config: DecodeConfig | None = None,
                 proposer=None, cpu: CPUConfig | None = None):
        self.target, self.head = target, head
        self.config = config or DecodeConfig()
        self.cpu = cpu or CPUConfig()  # the CPU backend's switches
        if head is not None:
            head.attach(target)
        self.proposer = proposer or (EagleProposer(head) if head is not None else None)
        # EAGLE-3 heads read several target layers; EAGLE-1/2 heads the last features
        self._head_layers = (list(head.config.feature_layer_ids)
                             if head is not None and head.config.head_type == "eagle3" else None)
        self._fast = False  # use_fast_path: the CPU backend runs the target (and the head, a draft model)
        self._screen = None  # use_screens: the backend's Screen of the target's lm_head, for greedy tokens
        self._said_raw = False  # `encode` has said that the target has no chat template
        self._calib = None  # while a calibration runs: its context cache (`_calibration_pass`)

    def use_cpu(self, cpu: CPUConfig) -> None:
        """The CPU backend as `cpu` says: on or off (`use_fast_path`), then greedy tokens through its screens or not
        (`use_screens`). `generate` and `stream` call it with their `cpu` (else the decoder's)."""
        self.use_fast_path(cpu.fast_path)
        self.use_screens(cpu.screen_argmax)

    def use_fast_path(self, on: bool) -> None:
        """Turn the CPU backend on (or off) for the target, the head and a draft model, where their weights are on
        the CPU (`cpu_backend.enable`: measured layouts, C kernels; the first call on a machine calibrates for a few
        seconds). On any device the target's `sdpa` attention becomes `gqa_sdpa` (eagle.attention: tree-masked
        passes without copying the KV cache per query head). Call it yourself to time the target's passes as
        decoding runs them; turning the backend off turns its screens off too."""
        if on:  # (turned off in the reverse order: the backend's attention first, then gqa_sdpa)
            use_gqa_sdpa(self.target.model, True)
        self._fast = on and cpu_backend.applies(self.target.model)
        draft_model = getattr(self.proposer, "model", None)  # a ModelProposer's small LM (a TargetModel)
        models = [(self.target.model, self.target.source), (self.head, None),
                  (None, None) if draft_model is None else (draft_model.model, draft_model.source)]
        for model, gguf in models:
            if model is None:
                continue
            if self._fast and not cpu_backend.enabled(model):
                cpu_backend.enable(model, run=self._calibration_pass if model is self.target.model else None,
                                   gguf=gguf, drafts=model is self.head)
                self._calib = None  # the calibration's context cache, if it made one
            elif not self._fast:
                cpu_backend.disable(model)
        if not on:
            use_gqa_sdpa(self.target.model, False)
        if not self._fast:
            self._screen = None

    def use_screens(self, on: bool) -> None:
        """Greedy tokens (the target's, and the proposer's drafts) through the backend's int8 screens where the
        backend is on and the lm_head's layout allows (`cpu_backend.Screen`: the argmax of the kernel's logits, bit
        for bit), or (off) the argmax of the whole logits."""
        self._screen = None
        if self._fast and on and not self.target.softcap and self.target.lm_head.weight.dtype == torch.float32:
            self._screen = cpu_backend.Screen.of(self.target.lm_head)
            for rows in (1, 16):  # made now (~1 s each for SmolLM2), not in the first timed token
                self._screen and self._screen.prepare(rows)

    @classmethod
    def from_pretrained(cls, target: str | TargetModel, draft: str | EagleHead | None = None,
                        device: str | torch.device = "auto", dtype: str | torch.dtype = "float32",
                        draft_model: str | TargetModel | None = None, cpu: CPUConfig | None = None,
                        **config) -> "SpeculativeDecoder":
        """`draft`: an EAGLE head (a checkpoint directory); or `draft_model`: a small causal LM with the target's
        tokenizer (any name `load_target` takes), drafting chains. `device`: auto (CUDA when present), cpu, cuda,
        cuda:N; `dtype`: float32, bfloat16, float16 (a target given as a TargetModel keeps its own). `config`:
        DecodeConfig's fields; `cpu`: the CPU backend's switches (it engages on the CPU in float32 only)."""
        if isinstance(target, str):
            target = load_target(target, device=device, dtype=dtype)
        if draft is not None and draft_model is not None:
            raise ValueError("give either draft (an EAGLE head) or draft_model (a small LM), not both")
        if isinstance(draft, str):
            draft = EagleHead.from_pretrained(draft, device=target.device, dtype=target.dtype, target=target)
        if isinstance(draft_model, str):
            draft_model = load_target(draft_model, device=target.device, dtype=target.dtype)
        proposer = ModelProposer(draft_model, target) if draft_model is not None else None
        return cls(target, draft, DecodeConfig(**config), proposer=proposer, cpu=cpu)

    @torch.inference_mode()
    def _calibration_pass(self, rows: int, context: int = 128) -> float:
        """Seconds of one verification-sized target pass: `rows` new tokens after `context` cached ones.

        The context is prefilled once and each pass is cropped away after it is timed: a calibration times
        hundreds of passes, and prefilling the context anew for each took ~28 of a fresh machine's 116 s. (Which
        layout wrote the cached context changes its values by rounding only.)"""
        t = self.target
        if self._calib is None or self._calib[1] != context:
            cache = TargetCache()
            cache.reserve(t, context)
            ids = torch.arange(context, device=t.device)[None] % t.vocab_size
            t.features(ids, position_ids=torch.arange(context, device=t.device)[None], cache=cache.hf)
            self._calib = (cache, context)
        cache = self._calib[0]
        cache.crop(context)
        cache.reserve(t, context + rows)  # room made before the clock starts, not by a buffer's growth in the pass
        ids = torch.arange(context, context + rows, device=t.device)[None] % t.vocab_size
        t0 = time.perf_counter()
        feats = t.features(ids, position_ids=torch.arange(context, context + rows, device=t.device)[None],
                           cache=cache.hf)
        t.logits(feats[0]).argmax(-1)
        return time.perf_counter() - t0

    # -- prompts -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat_template: str | None = None) -> list[int]:
        """Token ids of a prompt: ids as given (each checked against the vocabulary), or a string as one user turn
        in the chat template that `chat_template` (default: `config.chat_template`) names (`chat_template_text`), or
        its raw text."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the target's vocabulary (0 .. "
                                 f"{self.target.vocab_size - 1})")
            return ids
        tok, spec = self.target.tokenizer, chat_template or self.config.chat_template
        given = chat_template_text(spec)  # None: the tokenizer's own ("auto"), or the raw text
        if spec == "auto" and not tok.chat_template and not self._said_raw:
            self._said_raw = True  # once per decoder
            warnings.warn(f"target {self.target.name!r} has no chat template: string prompts are tokenized as raw "
                          "text (chat_template: none says so without this note; a template file or text sets one)",
                          stacklevel=2)
        if given or (spec == "auto" and tok.chat_template):
            import jinja2  # what transformers renders chat templates with

            try:
                text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True, chat_template=given)
            except jinja2.TemplateError as e:
                if not given:
                    raise
                raise ValueError(f"chat_template {spec[:80]!r}: the template fails ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from None
            return tok(text, add_special_tokens=False).input_ids
        return tok(prompt).input_ids

    # -- public API ----------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None, speculative: bool = True,
                 generator: torch.Generator | None = None, cpu: CPUConfig | None = None, **config) -> GenerateOutput:
        stream = self.stream(prompt, max_new_tokens, speculative, generator, cpu, **config)
        while True:
            try:
                next(stream)
            except StopIteration as stop:
                return stop.value

    def stream(self, prompt: str | list[int], max_new_tokens: int | None = None, speculative: bool = True,
               generator: torch.Generator | None = None, cpu: CPUConfig | None = None, **config):
        """Yield the new tokens of every round; the generator's return value is the GenerateOutput.
        Nothing after a stop (EOS, a stop string, max_new_tokens, the context length) is yielded, even when
        it was accepted in the same round. `config`: DecodeConfig's fields for this call; `cpu`: the CPU backend's
        switches for it (else the decoder's)."""
        cfg = dataclasses.replace(self.config, **config)
        if max_new_tokens is not None:
            cfg.max_new_tokens = max_new_tokens
        check_config(cfg)
        if cfg.temperature > 0 and generator is None and cfg.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(cfg.seed)
        lookup = cfg.prompt_lookup_num_tokens > 0
        if speculative and self.proposer is None and not lookup:
            raise ValueError("speculative decoding needs a draft head or prompt lookup; pass draft=..., "
                             "prompt_lookup_num_tokens=... or speculative=False")
        prompt_ids = self.encode(prompt, cfg.chat_template)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.target.max_length:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the target's context of "
                             f"{self.target.max_length} tokens (it must leave room for one new token)")
        cpu = cpu or self.cpu
        self.use_cpu(cpu)
        out = GenerateOutput(token_ids=[], text="", prompt_len=len(prompt_ids))
        eos = set(self.target.eos_ids)
        limit = min(cfg.max_new_tokens, self.target.max_length - len(prompt_ids))
        t0 = time.perf_counter()
        rounds = (self._speculate(prompt_ids, cfg, out, generator) if speculative
                  else self._autoregressive(prompt_ids, cfg, generator))
        out.stop_reason = "context_length" if limit < cfg.max_new_tokens else "max_new_tokens"
        for new in rounds:
            take = new[: limit - len(out.token_ids)]
            hit = next((i for i, t in enumerate(take) if t in eos), None)
            if hit is not None:
                take, out.stop_reason = take[: hit + 1], "eos"
            if cfg.stop:
                cut = self._stop_string_cut(out.token_ids, take, cfg.stop)
                if cut is not None:
                    take, hit, out.stop_reason = take[:cut], cut, "stop_string"
            out.token_ids += take
            if take:
                yield take
            if hit is not None or len(out.token_ids) >= limit:
                break
        rounds.close()
        out.total_s = time.perf_counter() - t0
        out.text = self.target.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out

    def _stop_string_cut(self, done: list[int], new: list[int], stops: list[str]) -> int | None:
        """How many of `new` to keep so that the text ends with the first stop string, or None if none occurs."""
        tok = self.target.tokenizer
        seen = len(tok.decode(done, skip_special_tokens=True))
        start = max(0, seen - max(len(s) for s in stops) + 1)  # a stop may begin in text already emitted
        for j in range(1, len(new) + 1):
            text = tok.decode(done + new[:j], skip_special_tokens=True)
            if any(s in text[start:] for s in stops):
                return j
        return None

    @property
    def screens_greedy_tokens(self) -> bool:
        """Whether greedy tokens go through the backend's int8 screen where the lm_head's layout allows: set by
        `use_screens`."""
        return self._screen is not None

    def greedy_tokens(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's greedy tokens for features [..., hidden], as decoding takes them: through the backend's
        screen where `use_screens` set one up and it takes this many rows (the same tokens, bit for bit), else the
        argmax of the logits."""
        return greedy_tokens(self.target, feats, self._screen)

    def _next_token(self, feats: torch.Tensor, cfg: DecodeConfig, generator) -> torch.Tensor:
        """The target's token after one row of features: its argmax, or a draw from p."""
        if cfg.temperature > 0:
            p = process(self.target.logits(feats).view(1, -1), cfg.temperature, cfg.sampling_top_k, cfg.top_p)[0]
            return torch.tensor([sample(p.cpu(), generator)], device=feats.device)
        return self.greedy_tokens(feats.view(1, -1)).view(1)

    def _prefill(self, ids: torch.Tensor, cache: TargetCache,
                 layers: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt ids [1, L] read into the cache: the features of every position, and the target `layers`
        concatenated (`TargetModel.hidden`). With the CPU backend on, in chunks of up to `cpu_backend.PREFILL_ROWS`
        tokens into a cache whose buffers are made first, the first chunk with an explicit causal mask: the backend's
        all-layer C call takes every chunk, where the whole prompt at once would go through the layers' own path."""
        t, n = self.target, ids.shape[1]
        pos = torch.arange(n, device=ids.device)[None]
        if not self._fast or n <= 1:
            return t.hidden(ids, position_ids=pos, cache=cache.hf, layers=layers)
        cache.reserve(t, n)
        chunk = cpu_backend.PREFILL_ROWS
        bounds = [0, *range(chunk, n, chunk), n]
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            mask = verify_mask(0, torch.ones(b, b, dtype=torch.bool).tril(), t.dtype).to(ids.device) if a == 0 else None
            parts.append(t.hidden(ids[:, a:b], position_ids=pos[:, a:b], attention_mask=mask, cache=cache.hf,
                                  layers=layers))
        feats = torch.cat([f for f, _ in parts], dim=1)
        return feats, None if layers is None else torch.cat([a for _, a in parts], dim=1)

    # -- engines -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _autoregressive(self, prompt_ids: list[int], cfg: DecodeConfig, generator):
        """Plain decoding with the KV cache, one token per target pass: the baseline."""
        t, cache = self.target, TargetCache()
        ids = torch.tensor([prompt_ids], device=t.device)
        feats = self._prefill(ids, cache, None)[0]
        pos = torch.tensor([[ids.shape[1] - 1]], device=t.device)
        while True:
            ids = self._next_token(feats[0, -1], cfg, generator)[None]
            pos = pos + 1
            yield [int(ids.item())]
            feats = t.features(ids, position_ids=pos, cache=cache.hf)

    @torch.inference_mode()
    def _speculate(self, prompt_ids: list[int], cfg: DecodeConfig, out: GenerateOutput, generator):
        """The verify loop: 1 prefill, 2 draft, 3 verify with the tree mask, 4 accept, 5 compact and advance."""
        t, dev = self.target, self.target.device
        # a copy of the proposer, so that its caches belong to this generation alone: streams of one decoder taken in
        # turns each draft from their own text (the head and its kept layouts are shared)
        q = copy.copy(self.proposer)
        if q is not None:  # greedy drafts through the backend's screen as greedy tokens are
            q.screen = self._screen is not None
        if cfg.prompt_lookup_num_tokens > 0:
            q = LookupProposer(q)
        cache = TargetCache(move=cpu_backend.compact_kv if self._fast else None)
        q.reset(prompt_ids)
        # 1. prefill: the target reads the prompt and emits the root, the first new token
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=dev)
        L = ids.shape[1]
        feats, aux = self._prefill(ids, cache, self._head_layers)
        root = self._next_token(feats[0, -1], cfg, generator)
        out.prefill_s = time.perf_counter() - t0
        yield [int(root.item())]
        head_in = feats if aux is None else aux  # what the head reads: last features, or EAGLE-3's fused layers
        pair_feats, pair_tokens = head_in, torch.cat([ids[:, 1:], root[:, None]], dim=1)
        while True:
            # 2. draft a tree (a chain is one) after catching the head up on the newly committed pairs
            t1 = time.perf_counter()
            draft: Draft = q.propose(pair_feats, pair_tokens, cfg, generator)
            node_mask, depth = draft.node_mask, draft.depth
            tokens = draft.tokens.to(dev)[None]
            # 3. verify every node in one target pass; node i sits at position L + depth(i)
            t2 = time.perf_counter()
            mask = verify_mask(L, node_mask, feats.dtype).to(dev)
            feats, aux = t.hidden(tokens, position_ids=L + depth.to(dev)[None], attention_mask=mask, cache=cache.hf,
                                  layers=self._head_layers)
            # 4. accept the deepest path the target agrees with, plus the target's own token after it
            if cfg.temperature > 0:
                p = process(t.logits(feats[0]), cfg.temperature, cfg.sampling_top_k, cfg.top_p).cpu()
                best, nxt = accept_sampled(draft.tokens.cpu(), draft.parents, p, draft.q, generator, draft.lookup,
                                           draft.drafted)
            else:
                p_argmax = self.greedy_tokens(feats[0]).cpu()
                best = accept_greedy(draft.tokens.cpu(), p_argmax, draft.parents, depth)
                nxt = int(p_argmax[best])
            path = tree.path_to(node_mask, best)
            out.accept_lengths.append(int(depth[best]))
            root = torch.tensor([nxt], device=dev)
            # 5. keep only the accepted path in both caches; the head resumes from the target's features
            cache.compact(L, path)
            q.rollback(L)
            L += path.shape[0]
            pair_feats = (feats if aux is None else aux)[:, path.to(dev)]
            pair_tokens = torch.cat([tokens[:, path[1:].to(dev)], root[:, None]], dim=1)
            t3 = time.perf_counter()
            out.draft_s += t2 - t1
            out.verify_s += t3 - t2
            yield pair_tokens[0].tolist()
