"""The draft head's config: what a checkpoint's config.json holds, shaped after the target it drafts for.

    cfg = HeadConfig.for_target(target, draft_vocab_size=4096)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HeadConfig:
    head_type: str = "eagle1"
    hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fc_bias: bool = True
    feature_layer_ids: list[int] = field(default_factory=lambda: [-1])
    num_layers: int = 1  # decoder layers of an EAGLE-1/2 head (EAGLE's: one)
    # 0: draft over the target's whole vocabulary; n > 0: over n target tokens listed in the `d2t` buffer
    # (EAGLE-3's reduced draft vocabulary, here for EAGLE-1/2 heads too: the lm_head dominates drafting cost)
    draft_vocab_size: int = 0
    # EAGLE-3.1 (arXiv 2605.09992), EAGLE-3 heads only: an RMSNorm on each fused target layer before fc, and the
    # normed output (not the pre-norm hidden) fed to the next draft step
    fc_norm: bool = False
    norm_output: bool = False
    logit_softcap: float | None = None
    target: str = ""
    tokenizer_fingerprint: str = ""

    @classmethod
    def for_target(cls, target, **overrides) -> "HeadConfig":
        """Shape the head after a target (a TargetModel): same hidden size, heads and vocabulary."""
        c = target.config
        kv_heads, head_dim = target.kv_heads_and_dim
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        kw = dict(
            hidden_size=c.hidden_size,
            vocab_size=target.vocab_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            # Falcon names it ffn_hidden_size, GPT-2 n_inner (None there: 4 x hidden, as both default)
            intermediate_size=(getattr(c, "intermediate_size", None) or getattr(c, "ffn_hidden_size", None)
                               or getattr(c, "n_inner", None) or 4 * c.hidden_size),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            logit_softcap=target.softcap,
            target=target.name,
            tokenizer_fingerprint=target.fingerprint,
        )
        kw.update(overrides)
        return cls(**kw)


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default feature layers (low, middle, high), indexed like transformers' `hidden_states` tuple
    (0 is the embedding output, i the output of layer i)."""
    return [2, num_layers // 2, num_layers - 3]
