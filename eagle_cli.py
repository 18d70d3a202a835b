"""The `eagle` command: prep, plan, train, eval, bench, export, check, generate.

    eagle prep --target smollm2-135m --data sharegpt --out runs/demo/data --max-rows 300 --regenerate
    eagle plan --target smollm2-135m --data sharegpt --max-rows 2400 --max-new-tokens 128 --max-length 448
    eagle train --config configs/smollm2-135m-eagle1.yaml budget.minutes=10
    eagle eval --target smollm2-135m --draft runs/demo/head --data prompts.jsonl --out runs/demo/eval
    eagle bench --target smollm2-135m --draft runs/demo/head --data prompts.jsonl --out runs/demo/bench
    eagle export --draft runs/demo/head --out runs/demo/head-vllm
    eagle export --draft runs/demo/head3 --out runs/demo/head3.gguf --format llama.cpp
    eagle check runs/demo/head-vllm --for vllm            # the loader's rules: names, shapes, dtypes, config keys
    eagle generate --target smollm2-135m --draft runs/demo/head --prompt "Tell me about owls."

Options of prep, plan, eval and bench are the fields of their config dataclasses (PrepConfig, PlanConfig, EvalConfig,
BenchConfig): the defaults live there only. Errors in the input end the command with one line naming the input and the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing


def _add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    """One flag per field; a nested dataclass field contributes its own fields as flat flags."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            _add_dataclass_args(parser, tp, prefix + f.name + ".")
            continue
        if tp is bool:
            parser.add_argument(flag, dest=prefix + f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            parser.add_argument(flag, dest=prefix + f.name, default=None, metavar=f.name.upper(),
                                help=f"default: {default}" if default not in (None, "") else None)


def _values(cls, flat: dict, prefix: str = "") -> dict:
    """The flags that were given, nested the way the dataclass nests its fields."""
    out = {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            sub = _values(tp, flat, prefix + f.name + ".")
            if sub:
                out[f.name] = sub
        elif flat.get(prefix + f.name) is not None:
            out[f.name] = flat[prefix + f.name]
    return out


def _config_from_args(cls, args: argparse.Namespace, required: tuple[str, ...] = ()):
    from eagle.configio import from_dict

    values = _values(cls, vars(args))
    missing = [r for r in required if r not in values]
    if missing:
        raise ValueError(f"missing required option --{missing[0].replace('_', '-')}")
    return from_dict(cls, values)


def cmd_prep(args) -> None:
    from data_prep.prep import PrepConfig, prepare

    cfg = _config_from_args(PrepConfig, args, required=("target", "data", "out"))
    summary = prepare(cfg)
    print(summary.format())


def cmd_train(args) -> None:
    from eagle.configio import load_config
    from train.config import TrainConfig
    from train.loop import train

    cfg = load_config(TrainConfig, args.config, args.overrides)
    train(cfg)


def cmd_plan(args) -> int:
    from train.plan import PlanConfig, plan_command

    return plan_command(_config_from_args(PlanConfig, args, required=("target",)))


def cmd_eval(args) -> None:
    from infer.evaluate import EvalConfig, evaluate, markdown

    cfg = _config_from_args(EvalConfig, args, required=("data",))
    report = evaluate(cfg)
    print(markdown(report))
    print(f"report: {cfg.out}/report.json, {cfg.out}/report.md")


def cmd_bench(args) -> None:
    from infer.bench import BenchConfig, bench, markdown

    cfg = _config_from_args(BenchConfig, args, required=("data",))
    report = bench(cfg)
    print(markdown(report, cfg))
    print(f"report: {cfg.out}/bench.json, {cfg.out}/bench.md")


def cmd_export(args) -> None:
    from pathlib import Path

    from eagle import EagleHead
    from eagle.checkpoint import check_head_dir
    from eagle.interop import export_published, export_speculators

    if Path(args.out).resolve() == Path(args.draft).resolve():
        raise ValueError(f"--out {args.out!r} is the --draft directory: name a new one (the published layout would "
                         "replace the head, and may not hold all of it)")
    if args.format == "llama.cpp":
        return export_llamacpp(args)
    check_head_dir(args.out, "--out ")  # a directory that holds anything but a head is never replaced
    head = EagleHead.from_pretrained(args.draft)
    if args.format == "speculators":
        notes = export_speculators(head, args.out, args.allow_lossy, verifier=args.target or "")
        engine, layout = "vllm", ("the speculators format: `vllm serve OUT` loads it as a speculator model; as "
                                   "speculative_config's model, name method eagle3")
    else:
        notes = export_published(head, args.out, args.engine, args.allow_lossy)
        engine, layout = args.engine, "the published EAGLE layout that vLLM and SGLang load"
    for line in notes:
        print(f"note: {line}")
    print(f"wrote {args.out}/config.json and model.safetensors ({head.config.head_type}, {layout}; {engine}'s "
          f"loader rules checked)")


def cmd_check(args) -> int:
    from eagle.contracts import check_head, rules

    problems = check_head(args.head, args.engine)
    for p in problems:
        print(p)
    n = len(rules(args.engine, str(args.head).endswith(".gguf")))
    print(f"{args.head}: {'ok' if not problems else f'{len(problems)} broken'} against {n} rules of "
          f"{args.engine}'s loader")
    return 1 if problems else 0


def export_llamacpp(args) -> None:
    from pathlib import Path

    from eagle import EagleHead
    from eagle.llamacpp import ExportError, check, export_llamacpp
    from eagle.target import resolve_target

    head = EagleHead.from_pretrained(args.draft)
    check(head.config, Path(args.out), args.outtype)  # before the target is looked for
    target_gguf = args.target_gguf
    if target_gguf is None:
        found = resolve_target(args.target or head.config.target) if (args.target or head.config.target) else None
        if not (isinstance(found, Path) and found.suffix == ".gguf"):
            raise ExportError(f"the head's target {head.config.target!r} is not a GGUF file: name the target's GGUF, "
                              "the one llama.cpp serves, with --target-gguf")
        target_gguf = found
    for note in export_llamacpp(head, args.out, target_gguf, args.outtype):
        print(f"note: {note}")
    print(f"wrote {args.out} (llama.cpp EAGLE3 draft, {args.outtype}; target {Path(target_gguf).name}): "
          f"llama-speculative-simple -m TARGET.gguf -md {args.out} --spec-type draft-eagle3")


def cmd_generate(args) -> None:
    import torch

    from cpu_backend import CPUConfig
    from infer import DecodeConfig, SpeculativeDecoder
    from infer.decoder import check_config

    cfg = _config_from_args(DecodeConfig, args)
    check_config(cfg)  # before the target loads
    dec = SpeculativeDecoder.from_pretrained(args.target, args.draft, draft_model=args.draft_model,
                                             device=args.device, dtype=args.dtype,
                                             cpu=_config_from_args(CPUConfig, args), **dataclasses.asdict(cfg))
    tok = dec.target.tokenizer
    g = (torch.Generator(device=dec.target.device).manual_seed(cfg.seed)
         if cfg.temperature > 0 and cfg.seed is not None else None)
    speculative = bool(args.draft or args.draft_model) or cfg.prompt_lookup_num_tokens > 0
    stream = dec.stream(args.prompt, speculative=speculative, generator=g)
    ids, shown = [], ""
    while True:
        try:
            ids += next(stream)
        except StopIteration as stop:
            out = stop.value
            break
        text = tok.decode(ids, skip_special_tokens=True)
        print(text[len(shown):], end="", flush=True)
        shown = text
    print()
    print(f"[{len(out.token_ids)} tokens in {out.total_s:.2f}s, {out.tokens_per_s:.1f} tok/s"
          + (f", tau {out.tau:.2f} over {out.rounds} rounds" if out.rounds else "") + f", stop: {out.stop_reason}]",
          file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from data_prep.prep import PrepConfig
    from cpu_backend import CPUConfig
    from infer import DecodeConfig
    from infer.bench import BenchConfig
    from infer.evaluate import EvalConfig
    from train.plan import PlanConfig

    p = argparse.ArgumentParser(prog="eagle", description="Train EAGLE draft heads and decode with them.")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("prep", help="chat data -> tokenized rows with assistant loss masks")
    _add_dataclass_args(sp, PrepConfig)
    sp.set_defaults(func=cmd_prep)
    st = sub.add_parser("train", help="train a draft head from a YAML config plus key=value overrides")
    st.add_argument("--config", required=False, default=None)
    st.add_argument("overrides", nargs="*", help="dotted key=value, e.g. optim.lr=1e-4 budget.minutes=5")
    st.set_defaults(func=cmd_train)
    spl = sub.add_parser("plan", help="disk, host and device memory a prep + training run will need, before it runs")
    _add_dataclass_args(spl, PlanConfig)
    spl.set_defaults(func=cmd_plan)
    se = sub.add_parser("eval", help="baseline vs speculative decoding on a prompt set")
    _add_dataclass_args(se, EvalConfig)
    se.set_defaults(func=cmd_eval)
    sb = sub.add_parser("bench", help="measure chains, trees and prompt lookup; name the fastest setting")
    _add_dataclass_args(sb, BenchConfig)
    sb.set_defaults(func=cmd_bench)
    sx = sub.add_parser("export", help="write a head in the published EAGLE layout (vLLM, SGLang) or as a "
                                       "llama.cpp draft GGUF")
    sx.add_argument("--draft", required=True, help="our head directory")
    sx.add_argument("--out", required=True, help="a directory (hf), a .gguf file (llama.cpp)")
    sx.add_argument("--format", choices=("hf", "speculators", "llama.cpp"), default="hf",
                    help="hf: config.json + model.safetensors as vLLM and SGLang load them; speculators: the "
                         "speculators library's format, which vLLM loads as a speculator model (EAGLE-3 heads); "
                         "llama.cpp: an EAGLE3 draft GGUF (EAGLE-3 heads)")
    sx.add_argument("--allow-lossy", action="store_true",
                    help="write an export the engine would run differently from the trained head (weights it drops "
                         "or leaves uninitialized); refused otherwise")
    sx.add_argument("--target", default=None, help="llama.cpp: the target (default: the head's), a GGUF alias or file; "
                                                 "speculators: the verifier's name or path as vLLM loads it")
    sx.add_argument("--target-gguf", default=None, help="llama.cpp: the target's GGUF file, for its tokenizer")
    sx.add_argument("--outtype", default="f16", help="llama.cpp: f16 (as llama.cpp's converter), f32 or bf16")
    sx.add_argument("--for", dest="engine", choices=("vllm", "sglang"), default="vllm",
                    help="hf: the server whose conventions settle what the two disagree on (an EAGLE-1 head's "
                         "architectures)")
    sc = sub.add_parser("check", help="check a published-layout head or a draft GGUF against a server's loader")
    sc.add_argument("head", help="a head directory (config.json + weights) or a .gguf draft")
    sc.add_argument("--for", dest="engine", required=True, choices=("vllm", "sglang", "llama.cpp"))
    sc.set_defaults(func=cmd_check)
    sx.set_defaults(func=cmd_export)
    sg = sub.add_parser("generate", help="stream a completion and print the statistics")
    sg.add_argument("--target", default="smollm2-135m")
    sg.add_argument("--draft", default=None, help="an EAGLE head (a checkpoint directory)")
    sg.add_argument("--draft-model", default=None, help="instead of a head: a small LM with the target's tokenizer")
    sg.add_argument("--prompt", required=True)
    sg.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    sg.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    _add_dataclass_args(sg, DecodeConfig)
    _add_dataclass_args(sg, CPUConfig)
    sg.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        print(f"eagle {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        # Bad input raises our errors (all ValueError subclasses) with one line naming the input.
        print(f"eagle {args.command}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    return code or 0  # (eagle check: 1 when a rule is broken)


if __name__ == "__main__":
    sys.exit(main())
