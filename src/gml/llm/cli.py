"""``gml generate SOURCE``: greedy / sampled generation from a local Hugging Face folder or a .gguf file on
gml.llm."""

from __future__ import annotations

import argparse

from gml.errors import InputError

DESCRIPTION = (
    "Generate tokens with a decoder-only causal LM (Llama, Mistral, Qwen2/3, Gemma, Gemma3, Phi-3, GPT-2) from a "
    "local Hugging Face folder or a llama.cpp .gguf file, on GML's KV cache with fp32 / bf16 / int8 / int4 "
    "weights. Prints the new token ids, the text when the folder has a tokenizer (a GGUF's: with --prompt), and "
    "prefill / decode tokens per second."
)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="a local Hugging Face model folder (config.json + weights), a .gguf file (needs the [llm] extra) "
        "or a file lm.save wrote; read offline",
    )
    p.add_argument(
        "--weights",
        choices=("fp32", "bf16", "int8", "int4"),
        default=None,
        help="(default: fp32; a saved LLM file: its own)",
    )
    p.add_argument("--tokenizer", metavar="FOLDER", help="a folder with the tokenizer (default: SOURCE's own)")
    p.add_argument("--save", metavar="FILE", help="also write the LLM (its weights as quantized) to FILE")
    p.add_argument(
        "--group-size",
        type=_group_size,
        default=32,
        help="int8 / int4 weights: a scale per group of 32, 64 or 128 input features, or 'channel' (int8 "
        "only: per output channel) (default: 32)",
    )
    p.add_argument(
        "--zero-points",
        action="store_true",
        help="int4 weights with a uint8 zero point per group (asymmetric): more accurate than the default "
        "(Gemma-3-270M mean KL 0.165 vs 0.198, docs/llm.md), 0.25 bit per weight more, decode 3-12%% slower",
    )
    p.add_argument(
        "--activations",
        choices=("fp32", "int8"),
        default=None,
        help="int8: int8/int4 decode steps quantize activations per block of 32 (default: int8 for int4 "
        "weights, fp32 otherwise)",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the folder's tokenizer)")
    g.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated: 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32, help="(default: 32)")
    p.add_argument("--max-length", type=int, default=None, help="KV cache length (default: prompt + new tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-ids", metavar="IDS", default="", help="stop token ids, comma separated")


def _group_size(text: str) -> int | None:
    if text == "channel":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 32, 64, 128 or channel") from None


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"{flag} {text!r} is not a comma-separated list of integers", f"e.g. {flag} 1,2,3") from None


def generate_command(args: argparse.Namespace, console) -> int:
    from gml.llm.api import llm, load_tokenizer

    tokenizer = None
    if args.prompt_ids is not None:
        prompt_ids = _ids(args.prompt_ids, "--prompt-ids")
        if not prompt_ids:
            raise InputError("--prompt-ids is empty", "give at least one token id, e.g. --prompt-ids 1,2,3")
    else:
        where = args.tokenizer or args.source
        tokenizer = load_tokenizer(where)
        if tokenizer is None:
            raise InputError(
                f"{where!r} has no tokenizer, so --prompt cannot be tokenized",
                "give --prompt-ids 1,2,3, or --tokenizer FOLDER (the model's Hugging Face folder)",
            )
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    max_length = args.max_length or len(prompt_ids) + args.max_new_tokens
    if args.zero_points and args.weights != "int4":
        raise InputError(
            f"--zero-points applies to int4 weights, not --weights {args.weights or 'fp32'}",
            "add --weights int4, or leave --zero-points out",
        )
    kwargs = {"group_size": args.group_size, "max_length": max_length, "activations": args.activations}
    if args.zero_points:
        kwargs["symmetric"] = False
    lm = llm(args.source, weights=args.weights, **kwargs)
    if lm.tokenizer is None and args.tokenizer:
        lm.tokenizer = load_tokenizer(args.tokenizer)
    out = lm.generate(
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_tokens=_ids(args.stop_ids, "--stop-ids"),
    )
    console.print(" ".join(str(t) for t in out), soft_wrap=True)
    tokenizer = lm.tokenizer or tokenizer  # a GGUF's tokenizer is loaded only for --prompt
    if tokenizer is not None:
        console.print(tokenizer.decode(out), markup=False, soft_wrap=True)
    s = lm.stats
    console.print(
        f"{lm}: prompt {s.prompt_tokens} tokens, prefill {s.prefill_tokens_per_second:.1f} tok/s; "
        f"{s.new_tokens} new tokens, decode {s.decode_tokens_per_second:.1f} tok/s",
        markup=False,
        soft_wrap=True,
    )
    if args.save:
        console.print(f"saved {lm.save(args.save)}", markup=False)
    return 0
